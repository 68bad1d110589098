"""What a pipelined step's rewind snapshot costs (design.md §4.3, Note [Rewind without walking
the model] in smp/step.py).

Before each pipelined step smp records the model's random generators, buffers and parameter
versions (``smp.step._Rewind``), so that a step whose call structure changed can run again
exactly. The snapshot keeps each model's list of buffer slots and parameters across steps and
rebuilds it only after a module, buffer or parameter is registered. Timed here on the HF Llama of
``pipeline_hf_llama.py`` (built from its config, one process, no distributed set-up), alternating
rounds of: the snapshot as it runs, and the same with the lists rebuilt every step (a walk of
the whole model per step, as before). Medians of the rounds.

    .venv/bin/python benchmarks/rewind.py
"""

from __future__ import annotations

import importlib
import statistics
import sys
import time
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from pipeline_hf_llama import _llama  # noqa: E402


def main(rounds: int = 5, steps: int = 2000) -> None:
    step = importlib.import_module("smp.step")
    model = types.SimpleNamespace(module=_llama(), _changing_buffers=set(), _window_position=0)

    def per_step(walk_each_step: bool) -> float:
        start = time.perf_counter()
        for _ in range(steps):
            if walk_each_step:
                step._walks.clear()
            step._Rewind(None, [model]).note_changes()
        return (time.perf_counter() - start) / steps

    per_step(False), per_step(True)  # warm-up
    kept, walked = [], []
    for _ in range(rounds):
        kept.append(per_step(False))
        walked.append(per_step(True))
    buffers, params = step._walk(model.module)
    print(f"HF Llama 8 layers: {len(params)} parameters, {len(buffers)} buffer slots")
    print("rewind snapshot per step, us (rounds):")
    print(f"  lists kept         {statistics.median(kept) * 1e6:7.1f}   "
          + " ".join(f"{t * 1e6:.1f}" for t in kept))  # fmt: skip
    print(f"  model walked       {statistics.median(walked) * 1e6:7.1f}   "
          + " ".join(f"{t * 1e6:.1f}" for t in walked))  # fmt: skip
    print(f"  walked / kept      {statistics.median(walked) / statistics.median(kept):7.1f}x")


if __name__ == "__main__":
    main()
