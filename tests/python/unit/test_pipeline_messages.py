"""Packing cross-stage call arguments and results."""

from __future__ import annotations

import collections
import dataclasses
import threading

import pytest
import torch

from smp.core.messages import (
    Sent,
    Skeleton,
    assign,
    describe,
    fingerprint,
    pack,
    pack_parts,
    slots,
    unpack,
)


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
    # ids occurs twice (the pair and extra): one slot, as pickle keeps one object once.
    assert skeleton.dtype == torch.uint8 and len(tensors) == 7
    assert [s.requires_grad for s in slots(skeleton)] == [
        True, False, False, True, False, False, False
    ]  # fmt: skip
    back = unpack(skeleton, tensors)
    assert back[0][0] is tensors[0] and back[0][1:] == [None, 3, 2.5, "s", torch.float16]
    assert isinstance(back[1]["pair"], Pair) and back[1]["pair"].b[0] is tensors[3]
    assert back[1]["size"] == torch.Size([1, 2])
    assert isinstance(back[2], Output) and back[2].loss is None and back[2].extra[0] is tensors[2]
    assert back[1]["pair"].a is back[2].extra[0]
    assert isinstance(back[3], ModelOutputLike) and list(back[3]) == ["hidden", "attn"]
    assert back[4] is tensors[6]
    # The unpacked skeleton the packer returns alongside is what the receiver unpacks.
    unpacked, again, _ = pack_parts(value)
    assert torch.equal(again, skeleton) and unpacked == Skeleton.of(skeleton)
    assert unpacked.flags == (True, False, False, True, False, False, False)


def test_values_pickle_cannot_carry_are_named():
    with pytest.raises(TypeError, match="type dict cannot cross pipeline stages: .*lock"):
        pack({"bad": threading.Lock()})
    with pytest.raises(TypeError, match="module of type Linear that is not part of the"):
        pack((torch.nn.Linear(2, 2),))


class Cache:
    """An object of a class the packer knows nothing about, holding tensors in lists, like a
    Hugging Face ``DynamicCache``."""

    def __init__(self):
        self.keys: list[torch.Tensor] = []
        self.seen = 0

    def update(self, k: torch.Tensor) -> torch.Tensor:
        self.keys.append(k)
        self.seen += k.size(1)
        return torch.cat(self.keys, 1)


def test_objects_travel_with_their_tensors_taken_out():
    cache = Cache()
    cache.update(torch.randn(2, 3, requires_grad=True))
    cache.update(torch.ones(2, 1))
    layer = torch.nn.Linear(2, 2)
    skeleton, tensors = pack({"cache": cache, "layer": layer}, modules={id(layer): "h.0"})
    assert len(tensors) == 2 and tensors[0] is cache.keys[0]
    assert [s.requires_grad for s in slots(skeleton)] == [True, False]
    other = torch.nn.Linear(2, 2)  # the receiver's own instance of module "h.0"
    back = unpack(skeleton, tensors, modules={"h.0": other})
    assert back["layer"] is other and isinstance(back["cache"], Cache)
    assert back["cache"] is not cache and back["cache"].seen == 4
    assert back["cache"].keys[1] is tensors[1]
    # The structure ignores requires_grad and tensor contents, not the object's other state.
    same = pack_parts({"cache": cache, "layer": layer}, modules={id(layer): "h.0"})[0].blob
    assert same == Skeleton.of(skeleton).blob
    cache.seen += 1
    changed = pack_parts({"cache": cache, "layer": layer}, modules={id(layer): "h.0"})[0].blob
    assert changed != Skeleton.of(skeleton).blob
    assert "Cache(keys=list(Tensor, Tensor), seen=5)" in describe(pack_parts(cache)[0])


def test_hugging_face_caches_round_trip():
    transformers = pytest.importorskip("transformers")
    from transformers.cache_utils import DynamicCache, EncoderDecoderCache

    config = transformers.GPT2Config(n_embd=8, n_layer=2, n_head=2, vocab_size=16)
    cache = EncoderDecoderCache(DynamicCache(config=config), DynamicCache(config=config))
    k = torch.randn(1, 2, 3, 4)
    cache.self_attention_cache.update(k, k + 1, 0)
    skeleton, tensors = pack(cache)
    back = unpack(skeleton, tensors)
    assert type(back) is EncoderDecoderCache and back.get_seq_length() == 3
    torch.testing.assert_close(back.self_attention_cache.layers[0].values, k + 1)


def test_reply_refers_to_request_tensors_it_hands_back():
    x, y = torch.randn(2), torch.randn(3)
    sent = {id(x): 0}
    skeleton, tensors = pack((x, y), resolve=lambda t: Sent(sent[id(t)]) if id(t) in sent else t)
    assert len(tensors) == 1 and tensors[0] is y
    mine = torch.randn(2)  # the caller's own tensor at request slot 0
    back = unpack(skeleton, tensors, sent=[mine])
    assert back[0] is mine and back[1] is y


def test_fingerprint_sees_replaced_tensors_and_attributes_only():
    cache = Cache()
    cache.update(torch.zeros(1, 2))
    before = fingerprint(cache)
    cache.keys[0].add_(1)  # data changed in place: not a change of the object's state
    assert fingerprint(cache) == before
    cache.update(torch.zeros(1, 1))
    assert fingerprint(cache) != before
    assert fingerprint(torch.zeros(1)) is None and fingerprint(3) is None


def test_assign_makes_the_callers_object_hold_the_new_state():
    mine, theirs = Cache(), Cache()
    theirs.update(torch.ones(1, 2))
    keep = mine
    assign(mine, theirs)
    assert keep.keys == theirs.keys and keep.seen == 2
    items, new = [1], [1, 2]
    assign(items, new)
    assert items == [1, 2]
    with pytest.raises(TypeError, match="changed an argument of type list into dict"):
        assign([1], {"a": 1})


def test_the_walker_reaches_tensors_inside_objects_it_can_carry():
    from smp.core import tree

    cache = Cache()
    cache.update(torch.ones(1, 2))
    doubled = tree.map_tensors(lambda t: t * 2, {"c": cache, "n": 3}, objects=True)
    assert doubled["n"] == 3 and doubled["c"] is not cache
    torch.testing.assert_close(doubled["c"].keys[0], torch.full((1, 2), 2.0))
    plain = {"n": 3}
    assert tree.map_tensors(lambda t: t, Cache(), objects=True).seen == 0
    assert tree.map_tensors(abs, plain, objects=True) == plain
