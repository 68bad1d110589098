"""A region call reads no device tensor on the host, and its agreement issues nothing on the TP
group: the agreement's exchange runs on the TP group's host twin (Note [Agreement on the host] in
smp/tp/agreement.py, design.md §6.3).

A training step (forward, backward, optimizer step) of a stack of L, then 2L
``DistributedTransformerLayer`` s, each its own region, at tp = 2 on gloo, with the host twin
``tp_host`` forced to be a gloo group of its own (``smp.state._GLOO_TP_HOST_TWIN``; under NCCL it
always is). While the step runs, the test counts

  (a) the collectives on the TP data group issued from smp/tp/agreement.py (a
      ``TorchDispatchMode`` sees every c10d op, its group and the Python stack that issued it);
  (b) the host reads of device tensors made by smp/tp code: calls of ``Tensor.item``,
      ``.tolist``, ``.cpu``, ``.numpy``, ``.to(cpu)``, ``bool()``, ``int()``, ``float()`` and
      ``index()`` whose caller is a module of smp/tp. On CPU every tensor is a host tensor, so the
      test stands in for the device: a tensor counts unless it shares its storage with a tensor
      that a collective of the host twin took or filled (under NCCL, CPU tensors). Every other
      tensor stands for a device tensor, which is stricter than a GPU: a CPU constant that smp/tp
      built and read would count too.

(a) and (b) are 0 for L and for 2L layers. What this design keeps is one collective on the host
twin per region call (the digest's all-gather: every rank must exchange at every call, see the
Note), measured as L per step for L layers. Where the ranks' sequence lengths differ every region
runs in turn, and the slow path's two more all-gathers (the descriptions' lengths, then their
bytes) go to the twin as well: 3 per region call, still none on the TP group, no device read.

The counters can fail: without a separate twin (the gloo TP group is then its own host group) the
same steps issue the agreement's all-gathers on the TP group and read their results, so (a) and
(b) grow with L (L, and 3L in turn); the tests check that they do, and that the twin moves
exactly those collectives off the TP group.
"""

from __future__ import annotations

import contextlib
import os
import sys

import torch
from torch import nn

SEQ, HIDDEN, LOCAL_BATCH = 8, 32, 2
LAYERS = (2, 4)  # L and 2L
LAYER = dict(
    num_attention_heads=4,
    attention_head_size=8,
    hidden_size=HIDDEN,
    intermediate_size=64,
    attention_dropout_prob=0.0,
    hidden_dropout_prob=0.0,
    causal_mask_size=SEQ,
)

_TP_DIR = None  # smp/tp/, set in the worker


def _in_smp_tp(filename: str) -> bool:
    return filename.startswith(_TP_DIR)


class _Stack(nn.Module):
    """L transformer layers, each an outer distributed module: L regions per forward."""

    def __init__(self, layers: int):
        super().__init__()
        from smp.nn import DistributedTransformerLayer

        self.layers = nn.ModuleList(DistributedTransformerLayer(**LAYER) for _ in range(layers))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


class _Collectives:
    """A dispatch mode that counts the c10d ops on the TP data group and on its host twin, and
    keeps the tensors the twin's ops touched (the host tensors of :class:`_Reads`)."""

    def __init__(self, data, host):
        from torch.utils._python_dispatch import TorchDispatchMode

        self.data, self.host = data, host
        self.by_agreement = self.data_total = self.on_host = 0
        self.host_tensors: dict[int, torch.Tensor] = {}  # storage address -> tensor, kept alive
        counter = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                if func.namespace == "c10d":
                    counter._seen(args)
                return func(*args, **(kwargs or {}))

        self.mode = Mode()

    def _seen(self, args) -> None:
        import torch.distributed as dist

        flat = list(_flatten(args))
        group = next(
            (
                dist.ProcessGroup.unbox(a) if isinstance(a, torch.ScriptObject) else a
                for a in flat
                if isinstance(a, (torch.ScriptObject, dist.ProcessGroup))
            ),
            None,
        )
        if group is self.host and self.host is not self.data:
            self.on_host += 1
            for t in flat:
                if isinstance(t, torch.Tensor):
                    self.host_tensors[t.untyped_storage().data_ptr()] = t
        elif group is self.data:
            self.data_total += 1
            frame = sys._getframe(1)
            while frame is not None:
                if frame.f_code.co_filename == os.path.join(_TP_DIR, "agreement.py"):
                    self.by_agreement += 1
                    break
                frame = frame.f_back


def _flatten(obj):
    if isinstance(obj, (list, tuple)):
        for item in obj:
            yield from _flatten(item)
    else:
        yield obj


class _Reads:
    """Wraps the Tensor methods that read values on the host; records those called from smp/tp
    on a tensor that is not a host twin's (``host_tensors``)."""

    NAMES = (
        "item",
        "tolist",
        "cpu",
        "numpy",
        "to",
        "__bool__",
        "__int__",
        "__float__",
        "__index__",
    )

    def __init__(self, host_tensors: dict[int, torch.Tensor]):
        self.host_tensors = host_tensors
        self.seen: list[str] = []

    @contextlib.contextmanager
    def active(self):
        saved = {name: torch.Tensor.__dict__.get(name) for name in self.NAMES}
        for name in self.NAMES:
            setattr(torch.Tensor, name, self._wrap(name, getattr(torch.Tensor, name)))
        try:
            yield self
        finally:
            for name, original in saved.items():
                if original is None:
                    delattr(torch.Tensor, name)
                else:
                    setattr(torch.Tensor, name, original)

    def _wrap(self, name: str, original):
        reads = self

        def wrapped(tensor, *args, **kwargs):
            caller = sys._getframe(1)
            if (
                _in_smp_tp(caller.f_code.co_filename)
                and reads._reads(name, args, kwargs)
                and tensor.untyped_storage().data_ptr() not in reads.host_tensors
            ):
                where = os.path.relpath(caller.f_code.co_filename, os.path.dirname(_TP_DIR))
                reads.seen.append(f"{name} at {where}:{caller.f_lineno}")
            return original(tensor, *args, **kwargs)

        return wrapped

    @staticmethod
    def _reads(name: str, args: tuple, kwargs: dict) -> bool:
        if name != "to":
            return True
        targets = [*args, kwargs.get("device")]
        return any(str(t) == "cpu" or getattr(t, "type", None) == "cpu" for t in targets)


def _step_counts(twin: bool, lengths_differ: bool = False) -> dict:
    """For L and 2L layers: what one training step issues and reads (the module docstring).
    ``lengths_differ``: TP rank 1's sequences are shorter, so every region runs in turn."""
    global _TP_DIR
    import smp
    import smp.state
    import smp.tp
    from smp.state import get_state
    from smp.tp import region

    _TP_DIR = os.path.dirname(smp.tp.__file__) + os.sep
    smp.state._GLOO_TP_HOST_TWIN = twin
    try:
        smp.init({"tensor_parallel_degree": 2, "timeout_s": 60})
    finally:
        smp.state._GLOO_TP_HOST_TWIN = False
    state = get_state()
    data, host = state.groups["tp"], state.host_group("tp")
    assert (host is not data) == twin, state.groups

    calls = {"agree": 0, "in_turn": 0}
    agree = region._agree

    def counted_agree(*args, **kwargs):
        calls["agree"] += 1
        agreed = agree(*args, **kwargs)
        calls["in_turn"] += agreed is not None
        return agreed

    @smp.step
    def train_step(model, x):
        loss = model(x).square().mean()
        model.backward(loss)
        return loss

    out = {}
    for layers in LAYERS:
        torch.manual_seed(0)
        model = smp.DistributedModel(_Stack(layers))
        optimizer = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
        for step in range(2):  # the second is measured: the first may set things up once
            seq = SEQ - 2 if lengths_differ and smp.tp_rank() == 1 else SEQ
            x = torch.randn(LOCAL_BATCH, seq, HIDDEN, generator=torch.Generator().manual_seed(step))
            collectives = _Collectives(data, host)
            reads = _Reads(collectives.host_tensors)
            calls["agree"] = calls["in_turn"] = 0
            region._agree = counted_agree
            try:
                with collectives.mode, reads.active():
                    optimizer.zero_grad()
                    train_step(model, x)
                    optimizer.step()
            finally:
                region._agree = agree
        out[layers] = {
            "regions": calls["agree"],
            "in_turn": calls["in_turn"],
            "data_by_agreement": collectives.by_agreement,
            "data_total": collectives.data_total,
            "host_twin": collectives.on_host,
            "reads": reads.seen,
        }
    smp.shutdown()
    return out


def _worker(lengths_differ: bool) -> dict:
    return {
        "twin": _step_counts(True, lengths_differ),
        "no_twin": _step_counts(False, lengths_differ),
    }


def test_regions_issue_no_tp_collective_and_no_host_read_for_the_agreement(pools):
    for result in pools.run(2, _worker, False, timeout_s=300):
        twin, plain = result["twin"], result["no_twin"]
        for layers in LAYERS:
            counts = twin[layers]
            assert counts["regions"] == layers and counts["in_turn"] == 0, counts
            # (a) and (b): nothing on the TP group from the agreement, no host read of a device
            # tensor, whatever the depth.
            assert counts["data_by_agreement"] == 0, counts
            assert counts["reads"] == [], counts
            # What stays: one all-gather (the digest) on the host twin per region call.
            assert counts["host_twin"] == layers, counts
            # The twin moves exactly the agreement's collectives off the TP group.
            moved = plain[layers]["data_total"] - counts["data_total"]
            assert moved == plain[layers]["data_by_agreement"], (counts, plain[layers])
            # The counters see the agreement when it runs on the TP group: one all-gather per
            # region call, and the host read of its result.
            assert plain[layers]["data_by_agreement"] == layers, plain
            assert len(plain[layers]["reads"]) == layers, plain
            assert all("agreement.py" in r for r in plain[layers]["reads"]), plain
            assert plain[layers]["host_twin"] == 0, plain


def test_regions_that_run_in_turn_agree_on_the_host_too(pools):
    """Sequence lengths that differ between the TP ranks: the agreement's slow path all-gathers
    the descriptions too (their lengths, then their bytes), on the host twin as well."""
    for result in pools.run(2, _worker, True, timeout_s=300):
        twin, plain = result["twin"], result["no_twin"]
        for layers in LAYERS:
            counts = twin[layers]
            assert counts["regions"] == counts["in_turn"] == layers, counts
            assert counts["data_by_agreement"] == 0, counts
            assert counts["reads"] == [], counts
            # Per region call: the digest, the descriptions' lengths, the descriptions.
            assert counts["host_twin"] == 3 * layers, counts
            assert plain[layers]["data_by_agreement"] == 3 * layers, plain
            assert len(plain[layers]["reads"]) == 3 * layers, plain
