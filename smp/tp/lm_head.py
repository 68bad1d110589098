"""Vocab-parallel output heads for Hugging Face causal language models (design.md §6.5).

A causal LM's output projection (``lm_head``, [vocab, hidden]) is usually its largest matrix and
its logits ([batch, sequence, vocab]) its largest activation. When the head is marked for tensor
parallelism (``with smp.tensor_parallelism():`` around the model), smp splits it along the
vocabulary — each TP rank holds ``vocab / n`` rows — and keeps the logits split:

  - :class:`VocabParallelHead` computes this rank's vocabulary columns of the logits for the
    group's batch (the "core batch": every TP rank's samples, or the shared batch with
    ``prescaled_batch``), never gathering them;
  - with ``labels``, the model's loss is :func:`causal_lm_loss`: Hugging Face's causal-LM loss
    (labels shifted inside, ``-100`` ignored, mean over counted tokens or a sum divided by
    ``num_items_in_batch``) computed with the vocab-parallel cross-entropy, so the full logits
    never exist; the output's ``logits`` is then None (asking for them would gather the largest
    activation of the model);
  - without ``labels``, the output's ``logits`` are the full logits of this rank's samples
    (gathered over the vocabulary), as in one process.

A head tied to the input embedding (GPT-2, OPT, and any ``tie_word_embeddings`` model) shares
one parameter with the vocab-parallel input embedding: both split the vocabulary the same way,
so each rank holds one shard of the tied matrix.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from smp.memory import delayed
from smp.tp import functional as tpf
from smp.tp.agreement import DivergentArgumentsError, _exchange
from smp.tp.modules import DistributedEmbedding, DistributedModule
from smp.tp.region import _region_scope, batch_is_shared, in_region
from smp.tp.registry import _MARK
from smp.tp.subclasses import computes_linear, own_forward, with_parameters

__all__ = ["VocabParallelHead", "causal_lm_loss", "full_logits", "distribute_lm_head"]


class VocabParallelHead(DistributedModule):
    """An output projection split along the vocabulary.
    Reference: ``nn.Linear(in_features, out_features, bias=False)`` with
    ``out_features`` the vocabulary.

    ``forward(hidden)`` returns this rank's ``out_features / n`` columns of the logits of the
    TP group's tokens: every position of every sample is one row, each rank's tokens padded to
    the longest rank's count ``T`` and stacked in rank order, [n·T, V/n] (with
    ``prescaled_batch``, this rank's tokens only, which the group shares). So the ranks may
    bring batches of different sizes and lengths. :func:`causal_lm_loss` and
    :func:`full_logits` take it from there.

    Args:
        weight: a parameter already holding this rank's rows (the tied input embedding's), or
        full_weight: the whole [out_features, in_features] matrix to take this rank's rows from.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        group: dist.ProcessGroup | None = None,
        weight: nn.Parameter | None = None,
        full_weight: torch.Tensor | None = None,
    ):
        super().__init__(group)
        self._check_divisible("out_features (the vocabulary)", out_features)
        self.in_features, self.out_features = in_features, out_features
        self.vocab_start = self.tp_rank * (out_features // self.tp_size)
        if weight is not None:
            self.weight = weight
        else:
            if full_weight is None:
                raise ValueError("VocabParallelHead needs weight or full_weight")
            self.weight = self._shard(full_weight.detach().clone(), 0)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        group = self.tp_group
        tokens = hidden.reshape(-1, hidden.size(-1))
        if _batch_semantics(self.tp_size):
            tokens = tpf.gather_from_region(_pad_rows(tokens, _longest(tokens, group)), 0, group)
        with _region_scope():
            return F.linear(tpf.copy_to_region(tokens, group), self.weight)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"split=vocabulary, tp={self.tp_size}"
        )


def _longest(rows: torch.Tensor, group: dist.ProcessGroup) -> int:
    """The largest row count of ``rows`` over the TP group (one all-gather of an integer)."""
    if tpf._local_only:  # every rank is this one (tracing, planning): nothing to learn
        return rows.size(0)
    return int(_exchange(group, torch.tensor([rows.size(0)], dtype=torch.int64)).max())


def _pad_rows(rows: torch.Tensor, count: int, value: float = 0) -> torch.Tensor:
    """``rows`` with rows of ``value`` appended up to ``count`` along dim 0."""
    if rows.size(0) == count:
        return rows
    pad = [0, 0] * (rows.dim() - 1) + [0, count - rows.size(0)]
    return F.pad(rows, pad, value=value)


def _batch_semantics(tp_size: int) -> bool:
    """Whether the head's core batch is the group's samples gathered (smp's default)."""
    return tp_size > 1 and not batch_is_shared() and not in_region()


def _group_and_size() -> tuple[dist.ProcessGroup, int]:
    group = tpf.tp_group(None)
    return group, group.size()


def causal_lm_loss(
    vocab_size: int,
    logits: torch.Tensor,
    labels: torch.Tensor,
    num_items_in_batch: torch.Tensor | int | None = None,
    ignore_index: int = -100,
    shift_labels: torch.Tensor | None = None,
    **_: Any,
) -> torch.Tensor:
    """Hugging Face's causal-LM loss from vocab-split logits of the core batch
    (:class:`VocabParallelHead`), for this rank's samples: the same value and gradients as
    ``ForCausalLMLoss`` on the full logits of this rank's samples."""
    group, n = _group_and_size()
    if logits.size(-1) * n != vocab_size:
        raise ValueError(
            f"smp: causal_lm_loss got vocab_size={vocab_size}, but the logits hold "
            f"{logits.size(-1)} columns per rank of a tensor-parallel group of {n} "
            f"({logits.size(-1) * n} in all): pass the width of the split output head"
        )
    if shift_labels is None:
        labels = F.pad(labels, (0, 1), value=ignore_index)
        shift_labels = labels[..., 1:].contiguous()
    shift_labels = shift_labels.to(logits.device)
    targets = shift_labels.reshape(-1)  # one per token, in the head's order
    mine = targets.size(0)
    if _batch_semantics(n):  # every rank's tokens, each padded to the head's row count
        targets = _pad_rows(targets, logits.size(0) // n, ignore_index)
        targets = tpf.gather_from_region(targets, 0, group)
    vocab_start = group.rank() * (vocab_size // n)
    with _region_scope():
        per_token = tpf.vocab_parallel_cross_entropy(
            logits, targets, vocab_start, group, ignore_index
        )
    if _batch_semantics(n):
        per_token = tpf.scatter_to_region(per_token, 0, group)[:mine]
    total = per_token.sum()
    if num_items_in_batch is None:
        return total / (shift_labels != ignore_index).sum()
    if torch.is_tensor(num_items_in_batch):
        num_items_in_batch = num_items_in_batch.to(total.device)
    return total / num_items_in_batch


def full_logits(split: torch.Tensor, batch: int) -> torch.Tensor:
    """The whole logits [batch, ..., V] of this rank's samples from :class:`VocabParallelHead`'s
    output, when every rank brought the same number of tokens (checked by the caller)."""
    group, n = _group_and_size()
    out = tpf.gather_from_region(split, -1, group)
    if _batch_semantics(n):
        out = tpf.scatter_to_region(out, 0, group)
    return out.view(batch, -1, out.size(-1))


_lm_classes: dict[type, type] = {}


def _vocab_parallel_lm_class(cls: type) -> type:
    """A subclass of a Hugging Face causal LM class whose outputs hold what the caller expects of
    the vocab-split head: no logits when the loss was computed from them, full logits else."""
    if cls in _lm_classes:
        return _lm_classes[cls]
    signature = inspect.signature(cls.forward)

    def forward(self, *args, **kwargs):
        bound = signature.bind_partial(self, *args, **kwargs).arguments
        labels = bound.get("labels")
        batch = _agree_on_batch(self, labels, bound)
        out = cls.forward(self, *args, **kwargs)
        if isinstance(out, tuple):  # return_dict=False: (loss, logits, ...) or (logits, ...)
            index = 1 if labels is not None else 0
            value = None if labels is not None else full_logits(out[index], batch)
            return (*out[:index], value, *out[index + 1 :])
        out["logits"] = None if labels is not None else full_logits(out["logits"], batch)
        return out

    sub = type(cls.__name__, (cls,), {"forward": forward, "_smp_vocab_parallel_head": True})
    _lm_classes[cls] = sub
    return sub


def _agree_on_batch(root: nn.Module, labels, arguments: dict) -> int:
    """Returns this rank's batch size. The vocab-split head computes every TP rank's tokens
    together, and the loss runs only when labels are given: so the ranks must all give labels
    or all not, and without labels (full logits handed back) bring the same shapes. One
    all-gather of 3 integers per forward (labels given, batch size, sequence length); a
    difference raises on every rank, naming each rank's value, before any collective of the
    head. Not with ``prescaled_batch`` (the ranks share the batch)."""
    shaped = labels
    if shaped is None:
        for key in ("input_ids", "inputs_embeds"):
            if torch.is_tensor(arguments.get(key)):
                shaped = arguments[key]
                break
    dims = [int(d) for d in shaped.shape[:2]] if torch.is_tensor(shaped) else [0, 0]
    dims += [0] * (2 - len(dims))
    group, n = _group_and_size()
    if not _batch_semantics(n) or tpf._local_only:  # local_only: every rank is this one
        return dims[0]
    mine = torch.tensor([int(labels is not None), *dims], dtype=torch.int64)
    everyone = _exchange(group, mine).view(n, -1)
    given = everyone[:, 0]
    # With labels the token counts may differ (the head pads them); without, the shapes may not.
    differ = bool((given != given[0]).any())
    if not differ and not int(given[0]):
        differ = bool((everyone[:, 1:] != everyone[0, 1:]).any())
    if differ:
        seen = "; ".join(
            f"rank {r}: labels {'given' if int(v[0]) else 'not given'}, shape "
            f"({int(v[1])}, {int(v[2])})"
            for r, v in enumerate(everyone)
        )
        raise DivergentArgumentsError(
            f"smp: {type(root).__name__} has a vocab-parallel output head, which computes the "
            f"tokens of every tensor-parallel rank together: the ranks must all give labels or "
            f"all not, and without labels (full logits) pass inputs of one shape ({seen}). Give "
            "every rank labels, or pad every rank's batch to one shape, or set prescaled_batch "
            "so that the ranks share one batch"
        )
    return dims[0]


def _marked(module: nn.Module) -> bool:
    return isinstance(getattr(module, _MARK, None), dict)


def _path_of(root: nn.Module, module: nn.Module) -> str | None:
    for path, m in root.named_modules():
        if m is module:
            return path
    return None


def distribute_lm_head(root: nn.Module, group: dist.ProcessGroup) -> tuple[list[str], str | None]:
    """Splits a marked Hugging Face causal LM's output head (and, when tied to it, the input
    embedding) along the vocabulary. Returns (paths replaced, why not when it was not done and
    the head was marked). Applies to models whose forward computes the loss with Hugging Face's
    ``ForCausalLMLoss`` through ``self.loss_function`` (every causal LM of transformers 5) and
    whose head is a bias-free ``nn.Linear`` (or a subclass that computes what it computes).

    The split is the head's own width, ``out_features``, which the loss uses too: a pruned head
    (Apertus' ``output_vocab_size``) is narrower than ``config.vocab_size``. A tied input
    embedding whose class has its own forward (Gemma's, scaled by sqrt(hidden)) keeps that
    forward when it gets its rows only from ``nn.Embedding``'s (:func:`_keeps_lookup`); such
    classes the generic registry keeps whole, and so does this path when the check fails."""
    get_output = getattr(root, "get_output_embeddings", None)
    if not callable(get_output) or not type(root).__module__.startswith("transformers"):
        return [], None
    head = get_output()
    if not isinstance(head, nn.Linear) or not _marked(head):
        return [], None
    from transformers.loss.loss_utils import ForCausalLMLoss

    if getattr(root, "loss_type", None) not in (None, "ForCausalLM") or not _loss_via_hook(root):
        return [], None
    if getattr(root, "loss_function", None) is not ForCausalLMLoss:
        return [], None
    if head.bias is not None:
        return [], "its bias is not supported by the vocab-parallel head"
    if not computes_linear(head):
        return [], (
            f"its class {own_forward(head, nn.Linear).__qualname__} defines its own forward, "
            "which does not compute nn.Linear's function"
        )
    n = group.size()
    vocab, hidden = head.out_features, head.in_features
    if vocab % n:
        return [], (
            f"the vocabulary ({vocab}) is not divisible by the tensor-parallel degree {n}; pad "
            "the vocabulary (resize_token_embeddings) to a multiple of it"
        )
    head_path = _path_of(root, head)
    embedding = root.get_input_embeddings()
    tied = isinstance(embedding, nn.Embedding) and embedding.weight is head.weight
    sharing = _sharing(root, head.weight, (head, embedding) if tied else (head,))
    if sharing is not None:
        # Splitting the head alone would give it a copy, and the other module's uses of the
        # matrix would no longer train the head's.
        return [], f"its weight is shared with {sharing}, which is not its input embedding"
    replaced = []
    if tied:
        if not _marked(embedding):
            return [], "it is tied to the input embedding, which is not marked; mark both"
        if embedding.max_norm is not None or embedding.sparse or embedding.scale_grad_by_freq:
            return [], "its tied input embedding uses max_norm, sparse or scale_grad_by_freq"
        kept = None
        if own_forward(embedding, nn.Embedding) is not None:
            kept = _kept_lookup_class(type(embedding))
            if kept is None or not _keeps_lookup(embedding, vocab // n):
                return [], (
                    f"its tied input embedding's class {type(embedding).__qualname__} has its own "
                    "forward, which does not get its rows from nn.Embedding's forward alone"
                )
        with delayed.converting(embedding, n, group.rank()) as out:
            new_embedding = DistributedEmbedding(
                embedding.num_embeddings,
                embedding.embedding_dim,
                padding_idx=embedding.padding_idx,
                group=group,
                full_weight=embedding.weight.detach().clone(),
            )
            if kept is not None:  # the embedding itself, its forward kept, its rows split
                new_embedding = _split_in_place(embedding, new_embedding, kept)
            out["new"] = new_embedding
        new_embedding.train(embedding.training)
        embedding_path = _path_of(root, embedding)
        root.set_submodule(embedding_path, new_embedding)
        replaced.append(embedding_path)
        new_head = VocabParallelHead(hidden, vocab, group, weight=new_embedding.weight)
    else:
        with delayed.converting(head, n, group.rank()) as out:
            new_head = out["new"] = VocabParallelHead(hidden, vocab, group, full_weight=head.weight)
    new_head.train(head.training)
    root.set_submodule(head_path, new_head)
    replaced.append(head_path)
    root.__class__ = _vocab_parallel_lm_class(type(root))
    # The head's width, not config.vocab_size: the split and the loss must agree (a pruned
    # head is narrower than the vocabulary).
    root.loss_function = functools.partial(causal_lm_loss_kw, vocab)
    return replaced, None


def _sharing(root: nn.Module, weight: nn.Parameter, allowed: tuple) -> str | None:
    """The path of a module other than ``allowed`` that holds ``weight``, if any."""
    for path, module in root.named_modules(remove_duplicate=False):
        mine = any(module is a for a in allowed)
        if not mine and any(p is weight for p in module.parameters(recurse=False)):
            return path or "<root>"
    return None


class _VocabParallelRows(DistributedEmbedding, nn.Embedding):
    """What ``super().forward`` of a kept embedding subclass reaches in place of
    ``nn.Embedding.forward``: :class:`DistributedEmbedding`'s (its MRO puts it first)."""


class _ProbeRows(nn.Embedding):
    """:func:`_keeps_lookup`'s stand-in for ``nn.Embedding.forward``: rows of another matrix."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return F.embedding(input, self.__dict__["_smp_probe_rows"], self.padding_idx)


_kept_classes: dict[tuple[type, type], type | None] = {}


def _kept_lookup_class(cls: type, base: type = _VocabParallelRows) -> type | None:
    """``cls`` with ``base`` between it and ``nn.Embedding`` in its MRO (None when Python cannot
    order it so): ``cls``'s own forward runs, and its ``super().forward`` is ``base``'s."""
    key = (cls, base)
    if key not in _kept_classes:
        try:
            _kept_classes[key] = type(cls.__name__, (cls, base), {"_smp_kept_forward": True})
        except TypeError:
            _kept_classes[key] = None
    return _kept_classes[key]


def _keeps_lookup(embedding: nn.Embedding, rows_per_rank: int) -> bool:
    """Whether ``embedding``'s own forward reads its rows only through ``nn.Embedding``'s, so
    that with that lookup made vocab-parallel (:class:`_VocabParallelRows`) it computes what it
    computed. Decided by running it: given random rows R, the class's forward must return the
    same values when ``nn.Embedding.forward`` hands it R's rows while its own ``weight`` is a
    random stand-in of a shard's shape (a forward that reads ``weight`` itself then differs or
    fails) as it returns with R as its weight. On every id of the vocabulary, in the weight's
    dtype and device, with a generator of its own (torch's are left as they were). Gemma's
    forward (``super().forward(ids) * embed_scale``) passes; OPT's learned positions (which
    take a mask, not ids) and a lookup of ``self.weight`` by hand do not."""
    cls = type(embedding)
    probe_cls = _kept_lookup_class(cls, _ProbeRows)
    if probe_cls is None:
        return False
    like = embedding.weight
    g = torch.Generator().manual_seed(0)
    size, dim = embedding.num_embeddings, embedding.embedding_dim
    rows = torch.randn(size, dim, generator=g).to(like.device, like.dtype)
    stand_in = torch.randn(rows_per_rank, dim, generator=g).to(like.device, like.dtype)
    ids = torch.arange(size, device=like.device).view(2, -1)
    reference = with_parameters(embedding, cls, weight=rows)
    probe = with_parameters(embedding, probe_cls, weight=stand_in)
    probe.__dict__["_smp_probe_rows"] = rows
    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        try:
            out = cls.forward(probe, ids)
            expected = cls.forward(reference, ids)
        except Exception:  # noqa: BLE001 - any failure means "not a lookup we can split"
            return False
    return (
        torch.is_tensor(out)
        and torch.is_tensor(expected)
        and out.dtype == expected.dtype
        and out.shape == expected.shape
        and torch.equal(out, expected)
    )


def _split_in_place(
    embedding: nn.Embedding, split: DistributedEmbedding, kept: type
) -> nn.Embedding:
    """``embedding`` itself, of class ``kept``, holding ``split``'s shard and TP state: its own
    attributes and buffers (Gemma's ``embed_scale``) stay, its forward runs as before and its
    ``super().forward`` is ``split``'s vocab-parallel lookup."""
    embedding.__class__ = kept
    for key in ("tp_group", "tp_size", "tp_rank", "vocab_start"):
        embedding.__dict__[key] = split.__dict__[key]
    embedding.weight = split.weight
    return embedding


_loss_signature: inspect.Signature | None = None
# ForCausalLMLoss's parameters that causal_lm_loss computes as Hugging Face does.
_LOSS_PARAMETERS = ("logits", "labels", "vocab_size", "num_items_in_batch", "ignore_index",
                    "shift_labels")  # fmt: skip


def causal_lm_loss_kw(vocab: int, *args, **kwargs):
    """:func:`causal_lm_loss` called the way Hugging Face models call ``self.loss_function``:
    the arguments are bound by the installed ``ForCausalLMLoss``'s own signature, so
    ``vocab_size`` may come by keyword (Llama) or by position (Mixtral, Gemma 2/3, Qwen2-MoE,
    Jamba, ...: ``self.loss_function(logits, labels, self.vocab_size, **kwargs)``), as may
    ``num_items_in_batch`` after it. ``vocab`` is the split head's width: a model passing
    another vocabulary size would have Hugging Face reshape its logits into rows of that size
    (an error or wrong rows), so that raises. A parameter of ``ForCausalLMLoss`` that
    :func:`causal_lm_loss` does not know (a later transformers' addition) raises when given."""
    global _loss_signature
    if _loss_signature is None:
        from transformers.loss.loss_utils import ForCausalLMLoss

        _loss_signature = inspect.signature(ForCausalLMLoss)
    bound = _loss_signature.bind(*args, **kwargs)
    known: dict[str, Any] = {}
    for name, value in bound.arguments.items():
        kind = _loss_signature.parameters[name].kind
        if kind is inspect.Parameter.VAR_KEYWORD:
            known.update(value)  # passed on and ignored by Hugging Face's loss too
        elif name in _LOSS_PARAMETERS:
            known[name] = value
        elif value is not _loss_signature.parameters[name].default:
            raise TypeError(
                f"smp's vocab-parallel causal-LM loss does not implement ForCausalLMLoss's "
                f"argument {name}={value!r}; leave the output head whole (unmark it) to use it"
            )
    given = known.pop("vocab_size")
    if int(given) != vocab:
        raise ValueError(
            f"smp: the model passes vocab_size={given} to its loss, but its output head (split "
            f"along the vocabulary) has {vocab} outputs; Hugging Face's loss would reshape the "
            f"logits into rows of {given}. Pass the head's width (lm_head.out_features)"
        )
    return causal_lm_loss(vocab, known.pop("logits"), known.pop("labels"), **known)


def _loss_via_hook(root: nn.Module) -> bool:
    """Whether the model's forward computes its loss through ``self.loss_function`` (HF causal
    LMs do; T5 and the masked LMs call ``CrossEntropyLoss`` themselves)."""
    try:
        return "self.loss_function(" in inspect.getsource(type(root).forward)
    except (OSError, TypeError):
        return False
