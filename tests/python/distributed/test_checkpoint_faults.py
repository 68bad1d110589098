"""A process killed with SIGKILL in the middle of ``smp.save_checkpoint``: the survivor gets an
error within seconds (no hang), the previous checkpoint and ``newest`` are untouched and a new
job resumes from them exactly; the next save removes the killed save's leftovers."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).with_name("kill_during_save.py")


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(directory: Path, phase: str) -> list[subprocess.Popen]:
    port = _port()
    procs = []
    for rank in range(2):
        env = dict(
            os.environ,
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE="2",
            LOCAL_WORLD_SIZE="2",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            OMP_NUM_THREADS="1",
        )
        procs.append(
            subprocess.Popen(
                [sys.executable, str(SCRIPT), str(directory), phase],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    return procs


def _finish(procs: list[subprocess.Popen]) -> list[tuple[int, str]]:
    out = []
    try:
        for p in procs:
            output, _ = p.communicate(timeout=180)
            out.append((p.returncode, output))
    finally:
        for p in procs:
            p.kill()
    return out


def _report(directory: Path, phase: str, rank: int) -> dict:
    return json.loads((directory / f"report_{phase}_{rank}.json").read_text())


def test_a_rank_killed_mid_save_leaves_the_previous_checkpoint_whole(tmp_path):
    (rank0, out0), (rank1, out1) = _finish(_launch(tmp_path, "save"))
    assert rank1 == -9, out1  # killed while its part of "bad" was on disk
    assert rank0 == 0, out0
    survivor = _report(tmp_path, "save", 0)
    assert survivor["outcome"].startswith("CheckpointError: smp.save_checkpoint: writing failed"), (
        survivor
    )
    assert survivor["seconds"] < 30, survivor  # an error, not a wait for a timeout
    assert (tmp_path / "newest").read_text() == "good"
    assert not (tmp_path / "bad").exists()
    leftovers = [p.name for p in tmp_path.iterdir() if p.name.startswith(".bad.tmp-")]
    assert len(leftovers) == 1, leftovers

    results = _finish(_launch(tmp_path, "resume"))
    for rank, (code, output) in enumerate(results):
        assert code == 0, output
        report = _report(tmp_path, "resume", rank)
        assert report == {"content": {"step": 1}, "same": True}, report
    assert (tmp_path / "newest").read_text() == "after"
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".")]
