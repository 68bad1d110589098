"""``messages.assign``: the caller's argument takes the state a module on
another stage left in its copy, for every type whose state can be assigned in place, and a
type whose state cannot be is refused by name, never dropped (design.md §4.6)."""

from __future__ import annotations

import array
import collections
import pickle
import random

import numpy as np
import pytest
import torch

from smp.core.messages import WriteBackError, assign, fingerprint


class Output(collections.OrderedDict):
    """Like a Hugging Face ``ModelOutput``: items mirrored as attributes, ``update`` refused."""

    def __setitem__(self, key, value):
        super().__setitem__(key, value)
        super().__setattr__(key, value)

    def update(self, *args, **kwargs):
        raise RuntimeError("update is not allowed")


def _grown(value, grow):
    """(the caller's value, the owner's changed copy of it), as a remote call leaves them."""
    theirs = pickle.loads(pickle.dumps(value))
    grow(theirs)
    return value, theirs


@pytest.mark.parametrize(
    "make, grow",
    [
        (list, lambda b: b.append(1)),
        (collections.deque, lambda b: b.extend([1, 2])),
        (lambda: collections.deque([0], maxlen=2), lambda b: b.extend([1, 2])),
        (bytearray, lambda b: b.extend(b"ab")),
        (lambda: array.array("d", [1.0]), lambda b: b.append(2.0)),
        (set, lambda b: b.add(3)),
        (lambda: collections.OrderedDict(a=1, b=2), lambda b: b.move_to_end("a")),
        (lambda: collections.defaultdict(int), lambda b: b.__setitem__("k", b["j"] + 1)),
        (collections.Counter, lambda b: b.update("aab")),
        (lambda: Output(x=1), lambda b: b.__setitem__("y", 2)),
        (lambda: np.zeros(3), lambda b: b.__setitem__(1, 5.0)),
        (lambda: (3, [1], {"a": 1}), lambda b: (b[1].append(2), b[2].pop("a"))),
    ],
)
def test_assign_gives_the_callers_object_the_new_state(make, grow):
    mine, theirs = _grown(make(), grow)
    keep = mine
    assign(mine, theirs)
    assert keep is mine and fingerprint(keep) == fingerprint(theirs)
    assert pickle.dumps(keep) == pickle.dumps(theirs)


@pytest.mark.parametrize(
    "make, grow",
    [
        (lambda: random.Random(3), lambda b: b.random()),  # state in C, not in __dict__
        (lambda: np.zeros(3), lambda b: b.resize(4, refcheck=False)),  # another shape
    ],
)
def test_assign_refuses_state_it_cannot_write_back(make, grow):
    mine, theirs = _grown(make(), grow)
    with pytest.raises(WriteBackError, match="argument 0 of module 'b'.*cannot write that"):
        assign(mine, theirs, "argument 0 of module 'b'")


def test_assign_refuses_a_replaced_type_and_passes_tensors_of_tuples_by():
    with pytest.raises(WriteBackError, match="changed an argument of type list into dict"):
        assign([1], {"a": 1})
    t = torch.zeros(1)
    assign((t, [1]), (torch.ones(1), [1, 2]))  # tuples are immutable: their items take it
    assert t.item() == 0
