"""One rank of a two-process job for test_checkpoint_faults.py, launched as a script (the
test kills one of these processes, which a reused worker pool cannot survive).

``save``: pp 2; one step, checkpoint "good" (each rank also keeps its parameters beside it),
another step, then checkpoint "bad" during which rank 1 SIGKILLs itself once its own file is
written; rank 0 must get an error, not hang, and reports it.
``resume``: a fresh job resumes the newest checkpoint and reports whether its parameters are
those of "good"; then saves again (which removes what the killed save left).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "examples" / "gpt"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from models import build_model, gpt_train_step, make_batch  # noqa: E402

import smp  # noqa: E402


def main(directory: str, phase: str) -> None:
    root = Path(directory)
    smp.init({"pipeline_parallel_degree": 2, "microbatches": 2})
    torch.manual_seed(0 if phase == "save" else 5)
    model = smp.DistributedModel(build_model("gpt"))
    optimizer = smp.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2))
    train_step = gpt_train_step(smp)

    def step(n: int) -> None:
        optimizer.zero_grad()
        train_step(model, *make_batch("gpt", 4, n))
        optimizer.step()

    report = root / f"report_{phase}_{smp.rank()}.json"
    if phase == "save":
        step(0)
        smp.save_checkpoint(directory, "good", user_content={"step": 1})
        torch.save(dict(model.local_named_parameters()), root / f"expected_{smp.rank()}.pt")
        step(1)
        if smp.rank() == 1:
            from smp.checkpoints import dcp as _dcp

            write_data = _dcp._Writer.write_data

            def killed(self, plan, planner):
                future = write_data(self, plan, planner)  # this rank's file is on disk
                os.kill(os.getpid(), signal.SIGKILL)
                return future

            _dcp._Writer.write_data = killed
        started = time.monotonic()
        try:
            smp.save_checkpoint(directory, "bad", user_content={"step": 2})
            outcome = "saved"
        except Exception as exc:  # noqa: BLE001 - what the test checks
            outcome = f"{type(exc).__name__}: {exc}"
        report.write_text(json.dumps({"outcome": outcome, "seconds": time.monotonic() - started}))
        os._exit(0)  # the peer is gone: no orderly shutdown of the process group
    content = smp.resume_from_checkpoint(directory)
    step(1)  # partitions the model; the checkpoint loads right after, before the step runs
    expected = torch.load(root / f"expected_{smp.rank()}.pt")
    # Compare with the state before this step: load the checkpoint again (now, partitioned).
    smp.resume_from_checkpoint(directory)
    same = all(torch.equal(p, expected[n]) for n, p in model.local_named_parameters())
    smp.save_checkpoint(directory, "after")
    report.write_text(json.dumps({"content": content, "same": same}))
    smp.shutdown()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
