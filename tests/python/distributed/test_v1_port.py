"""A script written the SMP v1 way (examples/v1_port/train.py), ported by its import line alone,
trains at pp 2 x dp 2 and at tp 2 with its configuration in SM_HP_MP_PARAMETERS."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from conftest import REPO


@pytest.mark.parametrize(
    "nproc,config,groups",
    [
        (4, '{"partitions": 2, "microbatches": 4, "ddp": true}', "pp group [0, 1], tp group [0]"),
        (2, '{"tensor_parallel_degree": 2, "microbatches": 2, "ddp": true}', "tp group [0, 1]"),
    ],
)
def test_a_v1_style_script_runs_with_only_its_import_changed(nproc, config, groups):
    env = {**os.environ, "PYTHONFAULTHANDLER": "1", "SM_HP_MP_PARAMETERS": config}
    env.pop("SMP_CONFIG", None)
    proc = subprocess.run(
        [
            sys.executable, "-m", "torch.distributed.run", "--standalone",
            "--nproc_per_node", str(nproc), str(REPO / "examples" / "v1_port" / "train.py"),
            "--steps", "20",
        ],
        capture_output=True, text=True, timeout=240, env=env, cwd=REPO,
    )  # fmt: skip
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]  # non-zero when the loss did not fall
    assert groups in out, out[-4000:]
    assert "v1-style job done: loss" in out, out[-4000:]
