"""Pipeline runtime: what a module on another stage does to its arguments reaches
the caller as in one process, or the step fails on every rank (design.md §4.6).

- A container argument changed by a module on stage 1 (a deque, bytearray, set, dict subclass,
  array it appends to) comes back changed, however its type holds its items; a value whose
  change cannot be written back into the caller's object (a ``random.Random``) is refused.
- An argument tensor changed in place on stage 1 (a running statistic, an in-place ReLU) is
  written back into the caller's tensor, in evaluation and (changed under no_grad) in training;
  a change that autograd recorded is refused.
"""

from __future__ import annotations

import array
import collections
import random

import pytest
import torch
from models import exact_steps
from torch import nn

TOL = dict(rtol=1e-5, atol=1e-5)

_KINDS = ("list", "deque", "bytearray", "set", "ordered", "defaultdict", "counter", "array")


def _box(kind: str):
    return {
        "list": list,
        "deque": collections.deque,
        "bytearray": bytearray,
        "set": set,
        "ordered": collections.OrderedDict,
        "defaultdict": lambda: collections.defaultdict(int),
        "counter": collections.Counter,
        "array": lambda: array.array("i"),
        "random": lambda: random.Random(3),
    }[kind]()


def _grow(box, n: int) -> None:
    """Two more items in ``box`` (which has ``n``), the way code changes each type."""
    if isinstance(box, random.Random):
        box.random()  # its state is C-level: not items, not attributes
    elif isinstance(box, (list, collections.deque, array.array)):
        box.append(n + 1)
        box.append(n + 2)
    elif isinstance(box, bytearray):
        box.extend(bytes([n + 1, n + 2]))
    elif isinstance(box, set):
        box.update({n + 1, n + 2})
    elif isinstance(box, (collections.defaultdict, collections.Counter)):
        box[f"k{n}"] += n + 1  # a missing key: the default factory's / Counter's 0
        box[f"k{n + 1}"] += n + 2
    else:
        box[f"k{n}"] = n + 1
        box[f"k{n + 1}"] = n + 2


def _size(box) -> tuple[int, int]:
    if isinstance(box, random.Random):
        return 0, 0
    items = box.values() if isinstance(box, dict) else box
    return len(box), sum(items)


class Appends(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, h, box):
        _grow(box, len(box) if not isinstance(box, random.Random) else 0)
        return torch.tanh(self.fc(h))


class Boxes(nn.Module):
    """Stage 0 builds a container and calls stage 1's ``b`` twice with it; what the calls put in
    it scales the logits, so a change that does not come back changes the loss."""

    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind
        self.a, self.head = nn.Linear(8, 16), nn.Linear(16, 3)
        self.b = Appends()
        self.seen: list = []

    def forward(self, x):
        box = _box(self.kind)
        h = self.b(self.a(x), box)
        first = _size(box)
        h = self.b(h, box)
        second = _size(box)
        self.seen.append((first, second))
        return self.head(h) * (1 + sum(first) + sum(second)) / 10


def _place_boxes(module) -> None:
    import smp

    for path, stage in (("", 0), ("a", 0), ("head", 0), ("b", 1)):
        smp.set_partition(module.get_submodule(path), stage)


def _containers_worker(kinds: tuple) -> dict:
    import smp

    out = {}
    for kind in kinds:
        smp.init({"pipeline_parallel_degree": 2, "microbatches": 2, "timeout_s": 60})
        placed = []

        def place(module, placed=placed):
            _place_boxes(module)
            placed.append(module)

        variants = [None] if kind == "random" else [0, 0]
        result = exact_steps(
            smp, lambda kind=kind: Boxes(kind), place, variants, 11, 2,
            lambda *_: None, lambda step: None,
        )  # fmt: skip
        out[kind] = result[0] if kind == "random" else placed[0].seen
        smp.shutdown()
    return out


def test_containers_a_remote_module_changes_come_back_as_in_one_process(pools):
    """A deque or bytearray that a stage-1 module appends to came back empty (lengths
    0 and 0 where one process sees 2 and 4; a list came back right). Every container type whose
    items can be assigned now comes back with what the module put in it: the loss and every
    gradient match one process for two steps (the second with asynchronous calls)."""
    for rank, seen in enumerate(pools.run(2, _containers_worker, _KINDS)):
        if rank == 0:  # the root runs on the leader
            for kind in _KINDS:
                # 2 steps x 2 microbatches (after the partitioner's trace), each: two items
                # after the first call, four after the second
                steps = seen[kind][-4:]
                assert [(f[0], s[0]) for f, s in steps] == [(2, 4)] * 4, (kind, seen[kind])


def test_a_value_whose_change_cannot_be_written_back_fails_on_every_rank(pools):
    """A module that draws from a ``random.Random`` argument changes state that lives in C:
    pickle carries it, but it cannot be assigned into the caller's generator. Before, the
    caller's generator silently stayed as it was; now the step fails on every rank, naming the
    type and the module."""
    for text in pools.run(2, _containers_worker, ("random",)):
        error = text["random"]
        assert "cannot write that change back" in error and "Random" in error, error
        assert "module 'b'" in error, error


class Running(nn.Module):
    """Keeps a running statistic in a tensor the caller passes (under no_grad, as BatchNorm
    updates its buffers)."""

    def __init__(self, record: bool = False):
        super().__init__()
        self.fc = nn.Linear(16, 16)
        self.record = record  # the change is made with grad mode on: autograd records it

    def forward(self, h, stats):
        if self.record:
            stats.mul_(0.5).add_(h.mean(0))
        else:
            with torch.no_grad():
                stats.mul_(0.5).add_(h.mean(0))
        return torch.tanh(self.fc(h))


class InPlace(nn.Module):
    """Stage 1's ``b`` changes ``stats`` in place and ``relu`` (``inplace=True``) changes the
    tensor it is given and returns it: ``relu`` gets ``b``'s output by reference on stage 1
    first, then a tensor of stage 0."""

    def __init__(self, record: bool = False):
        super().__init__()
        self.a, self.head = nn.Linear(8, 16), nn.Linear(16, 3)
        self.b = Running(record)
        self.relu = nn.ReLU(inplace=True)
        self.variant = 0

    def forward(self, x):
        stats = torch.ones(16)
        h = self.a(x)
        if not torch.is_grad_enabled():  # evaluation: ReLU in place on both kinds of input
            h = self.b(h, stats)
            self.relu(h)  # h (an output of stage 1) is changed; the result is h itself
            k = self.b(h, stats)  # stage 1 takes h by reference again: the changed h
            g = self.a(x) - 0.2
            self.relu(g)  # a tensor of stage 0 is changed
            h = h + g + k
        else:
            h = self.b(h, stats)
        h = self.b(h, stats)
        return self.head(h) + stats[:3]


def _place_in_place(module) -> None:
    import smp

    for path, stage in (("", 0), ("a", 0), ("head", 0), ("b", 1), ("relu", 1)):
        smp.set_partition(module.get_submodule(path), stage)


def _in_place_eval_worker(mode: str) -> list:
    import smp

    smp.init({"pipeline_parallel_degree": 2, "microbatches": 2, "timeout_s": 60})
    torch.manual_seed(0)
    reference = InPlace()
    torch.manual_seed(0)
    module = InPlace()
    _place_in_place(module)
    model = smp.DistributedModel(module)

    @smp.step
    def evaluate(model, x):
        return model(x)

    g = torch.Generator().manual_seed(7)
    diffs = []
    for _ in range(2):  # the second step's calls are asynchronous (predicted)
        x = torch.randn(8, 8, generator=g)
        with getattr(torch, mode)():
            out = evaluate(model, x).concat()
            expected = torch.cat([reference(xs) for xs in x.chunk(2)])
        diffs.append((out - expected).abs().max().item())
        torch.testing.assert_close(out, expected, **TOL)
    return diffs


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
def test_argument_tensors_changed_in_place_on_another_stage_come_back_in_evaluation(pools, mode):
    """A stage-1 module that changes an argument tensor in place in an evaluation step
    (a running statistic; ReLU(inplace=True) on a stage-0 tensor and on an output of stage 1
    passed by reference) left the caller's tensor as it was, and the output differed silently.
    The change now reaches the caller's tensor: outputs match one process. Under
    ``torch.inference_mode`` too, whose tensors keep no version counter (a pipelined step
    under it failed on the sent-once bookkeeping before)."""
    pools.run(2, _in_place_eval_worker, mode)


def _in_place_train_worker(record: bool):
    import smp

    smp.init({"pipeline_parallel_degree": 2, "microbatches": 2, "timeout_s": 60})
    variants = [None] if record else [0, 0]
    return exact_steps(
        smp, lambda: InPlace(record), _place_in_place, variants, 5, 2,
        lambda *_: None, lambda step: None,
    )  # fmt: skip


@pytest.mark.parametrize("record", [False, True])
def test_argument_tensors_changed_in_place_in_training(pools, record):
    """In training, a change made under no_grad is written back too: loss and every gradient
    match one process. A change autograd records (the statistic updated with grad mode on from
    a tensor that requires grad) cannot take its graph across stages: the step fails on every
    rank, naming the argument and the module."""
    results = pools.run(2, _in_place_train_worker, record)
    if record:
        for (text,) in results:
            assert "in place with autograd recording it" in text, text
            assert "module 'b'" in text, text
