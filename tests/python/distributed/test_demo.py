"""The demo training job (examples/gpt/train.py) runs at pp 2 x tp 2 and its loss falls; saved
after 4 steps and resumed for 4 more, it ends where 8 uninterrupted steps end."""

from __future__ import annotations

import os
import re
import subprocess
import sys

from conftest import REPO


def _demo(*args: str) -> str:
    env = {**os.environ, "PYTHONFAULTHANDLER": "1"}
    proc = subprocess.run(
        [
            sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "4",
            str(REPO / "examples" / "gpt" / "train.py"), "--log-every", "4", *args,
        ],
        capture_output=True, text=True, timeout=240, env=env, cwd=REPO,
    )  # fmt: skip
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    return out


def _final_loss(out: str) -> str:
    found = re.search(r"final loss (\d+\.\d+)", out)
    assert found, out[-4000:]
    return found.group(1)


def test_demo_pp2_tp2_trains_and_resumes(tmp_path):
    out = _demo("--steps", "8")
    assert "tensor parallel: h.0, h.1, h.2, h.3 split over 2 ranks each" in out, out[-4000:]
    assert "smp partition: 2 stages" in out, out[-4000:]
    assert "world size 4 = pp 2 x tp 2 x 1 data-parallel" in out, out[-4000:]

    checkpoint = tmp_path / "checkpoints"
    first = _demo("--steps", "4", "--checkpoint", str(checkpoint))
    assert "checkpoint: step 4 saved to" in first, first[-4000:]
    assert sorted(p.name for p in checkpoint.iterdir()) == ["newest", "step_4"]
    second = _demo("--steps", "4", "--checkpoint", str(checkpoint), "--resume")
    assert "done: steps 5-8" in second, second[-4000:]
    end_val = re.search(r"end: val loss (\S+)", first).group(1)
    assert f"start: val loss {end_val}" in second, second[-4000:]  # the same model came back
    assert _final_loss(second) == _final_loss(out)  # the same training as without the stop
