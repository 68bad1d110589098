"""Shared pytest fixtures: the distributed worker pools and a single-process smp."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
# Tests build Hugging Face models from tiny configs; nothing may be fetched from a hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# The demo's GPT doubles as the tests' small GPT.
sys.path.insert(0, str(REPO / "examples" / "gpt"))

from harness import PoolSet  # noqa: E402


@pytest.fixture(scope="session")
def pools():
    """``pools.run(world_size, fn, *args)`` runs ``fn`` on that many gloo processes."""
    pool_set = PoolSet()
    yield pool_set
    pool_set.close()


@pytest.fixture
def single_process_smp():
    """smp initialised as a world of one in this process; torn down after the test."""
    import smp

    def init(config=None):
        smp.init(config or {})
        return smp

    yield init
    smp.shutdown()


def pytest_collection_modifyitems(config, items):
    """The GPU tier (tests/python/gpu): marked ``gpu`` and skipped without a CUDA device. Run it
    alone with ``pytest -m gpu tests/python/gpu``."""
    import torch

    gpu_dir = REPO / "tests" / "python" / "gpu"
    for item in items:
        if gpu_dir in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.gpu)
            if not torch.cuda.is_available():
                item.add_marker(pytest.mark.skip(reason="needs a CUDA device"))
