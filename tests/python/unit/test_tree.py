"""smp.core.tree: the one walker for step inputs and outputs, call arguments and results, and TP
region arguments: pytree's containers plus smp's rules (mappings and sequences of any type,
objects holding tensors on request), rebuilding the original types."""

from __future__ import annotations

import dataclasses
from collections import OrderedDict, defaultdict, namedtuple

import pytest
import torch

from smp.core import tree

Pair = namedtuple("Pair", "first second")


class Bag(dict):
    """A dict subclass that pytree does not know."""


class Row(list):
    pass


class Fields(dict):
    """A mapping built from keywords only (as ModelOutput-like classes are)."""

    def __init__(self, **items):
        super().__init__(**items)


@dataclasses.dataclass
class Holder:
    weight: torch.Tensor
    name: str


def _value():
    return {
        "t": torch.ones(2),
        "seq": [1, torch.zeros(1), (torch.ones(3), "x")],
        "bag": Bag(a=torch.ones(1), b=2),
        "row": Row([torch.ones(1), None]),
        "pair": Pair(torch.ones(1), Fields(z=torch.ones(2))),
        "ordered": OrderedDict(k=torch.ones(1)),
        "default": defaultdict(list, {"d": torch.ones(1)}),
        "size": torch.Size([2, 3]),
        "holder": Holder(torch.ones(4), "w"),
    }


def test_flatten_finds_every_tensor_and_unflatten_rebuilds_every_type():
    value = _value()
    leaves, spec = tree.flatten(value)
    assert sum(isinstance(v, torch.Tensor) for v in leaves) == 9  # holder's kept whole
    back = tree.unflatten(leaves, spec)
    assert type(back["bag"]) is Bag and type(back["row"]) is Row
    assert type(back["pair"]) is Pair and type(back["pair"].second) is Fields
    assert type(back["ordered"]) is OrderedDict
    assert type(back["default"]) is defaultdict and back["default"].default_factory is list
    assert type(back["size"]) is torch.Size and back["size"] == torch.Size([2, 3])
    assert back["holder"] is value["holder"]  # an object is a leaf unless asked for


def test_map_tensors_rebuilds_and_keeps_what_holds_no_tensor():
    value = _value()
    doubled = tree.map_tensors(lambda t: t * 2, value)
    assert torch.equal(doubled["bag"]["a"], torch.full((1,), 2.0)) and doubled["bag"]["b"] == 2
    assert torch.equal(doubled["pair"].second["z"], torch.full((2,), 2.0))
    plain = {"a": [1, "b"], "c": Bag(d=3)}
    assert tree.map_tensors(lambda t: t * 2, plain) is plain


def test_objects_holding_tensors_are_rebuilt_on_request():
    value = {"holder": Holder(torch.ones(4), "w")}
    assert len(tree.tensors(value)) == 0
    assert len(tree.tensors(value, objects=True)) == 1
    tripled = tree.map_tensors(lambda t: t * 3, value, objects=True)["holder"]
    assert isinstance(tripled, Holder) and tripled.name == "w"
    assert torch.equal(tripled.weight, torch.full((4,), 3.0))
    assert torch.equal(value["holder"].weight, torch.ones(4))  # a copy: the original stays


def test_hugging_face_outputs_batches_and_caches():
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_outputs import CausalLMOutputWithPast

    out = CausalLMOutputWithPast(loss=torch.ones(()), logits=torch.ones(2, 3))
    leaves, spec = tree.flatten(out)
    assert len(leaves) == 2 and type(tree.unflatten(leaves, spec)) is CausalLMOutputWithPast
    batch = transformers.BatchEncoding({"input_ids": torch.ones(2, 4), "mask": torch.ones(2, 4)})
    assert type(tree.map_tensors(lambda t: t, batch)) is transformers.BatchEncoding
    cache = transformers.DynamicCache()
    cache.update(torch.ones(1, 1, 2, 2), torch.ones(1, 1, 2, 2), 0)
    assert tree.tensors(cache) == [] and len(tree.tensors(cache, objects=True)) == 2


def test_leaf_paths_name_each_leaf():
    paths = tree.leaf_paths({"a": [torch.ones(1), Bag(b=torch.ones(1))]})
    assert paths == ["['a'][0]", "['a'][1]['b']"]
