"""Packing cross-stage call arguments and results."""

from __future__ import annotations

import collections
import dataclasses

import pytest
import torch

from smp.pipeline.messages import pack, slots, unpack


@dataclasses.dataclass
class Output:
    logits: torch.Tensor
    loss: torch.Tensor | None = None
    extra: tuple = ()


class ModelOutputLike(collections.OrderedDict):
    """Like transformers' ModelOutput: a mapping built from keyword arguments."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)


Pair = collections.namedtuple("Pair", "a b")


def test_round_trip_of_nested_values():
    x = torch.randn(2, 3, requires_grad=True)
    ids = torch.arange(4)
    value = (
        [x, None, 3, 2.5, "s", torch.float16],
        {"mask": ids > 1, "pair": Pair(ids, (x * 2,)), "size": torch.Size([1, 2])},
        Output(logits=x.detach(), extra=(ids,)),
        ModelOutputLike(hidden=ids.double(), attn=None),
        torch.tensor(7),
    )
    skeleton, tensors = pack(value)
    assert skeleton.dtype == torch.uint8 and len(tensors) == 8
    assert [s.requires_grad for s in slots(skeleton)] == [
        True, False, False, True, False, False, False, False
    ]  # fmt: skip
    back = unpack(skeleton, tensors)
    assert back[0][0] is tensors[0] and back[0][1:] == [None, 3, 2.5, "s", torch.float16]
    assert isinstance(back[1]["pair"], Pair) and back[1]["pair"].b[0] is tensors[3]
    assert back[1]["size"] == torch.Size([1, 2])
    assert isinstance(back[2], Output) and back[2].loss is None and back[2].extra[0] is tensors[5]
    assert isinstance(back[3], ModelOutputLike) and list(back[3]) == ["hidden", "attn"]
    assert back[4] is tensors[7]


def test_unsupported_values_are_named():
    with pytest.raises(TypeError, match="object cannot cross pipeline stages"):
        pack({"bad": object()})
