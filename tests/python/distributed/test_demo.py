"""The demo training job (examples/gpt/train.py) runs at pp 2 x tp 2 and its loss falls."""

from __future__ import annotations

import os
import subprocess
import sys

from conftest import REPO


def test_demo_pp2_tp2_trains():
    env = {**os.environ, "PYTHONFAULTHANDLER": "1"}
    proc = subprocess.run(
        [
            sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "4",
            str(REPO / "examples" / "gpt" / "train.py"), "--steps", "8", "--log-every", "4",
        ],
        capture_output=True, text=True, timeout=240, env=env, cwd=REPO,
    )  # fmt: skip
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "tensor parallel: h.0, h.1, h.2, h.3 split over 2 ranks each" in out, out[-4000:]
    assert "smp partition: 2 stages" in out, out[-4000:]
    assert "world size 4 = pp 2 x tp 2 x 1 data-parallel" in out, out[-4000:]
