"""Arguments a module on another stage does not read stay with the caller (Note [Arguments
fetched when read] in smp.pipeline.calls): once learned they do not travel, and whatever was
learned, a kept argument that is read (with a gradient, through a reference from a later call,
changed in place, or after the caller changed its own tensor) gives what one process computes.
"""

from __future__ import annotations

import torch
from models import exact_steps
from torch import nn

WIDE = 512  # a cache entry is (rows, 16 * WIDE) floats: 128 KiB for a microbatch of 4 rows


class KeptBlock(nn.Module):
    """Reads ``h`` and the cache's last entry, appends its own (as a Hugging Face decoder layer
    reads and appends its own keys and values); what else it reads depends on ``variant`` (a
    class attribute, so the argument structure stays the same)."""

    variant = 0

    def __init__(self, index: int):
        super().__init__()
        self.index = index
        self.fc = nn.Linear(16, 16)

    def forward(self, h, cache, wide, wide2):
        y = torch.tanh(self.fc(h + cache[-1][:, :16]))
        v, i = KeptBlock.variant, self.index
        if v == 4 and i == 0:  # `wide`, kept: the caller changes its own right after the call
            y = y + wide[:, :16]
        if v == 1 and i == 2:  # stage 0's first cache entry (requires grad), by reference
            y = y * cache[0][:, 16:32]
        if v == 3 and i == 1:  # `wide2`, by reference, changed in place: written back
            with torch.no_grad():
                wide2.add_(1.0)
        if v == 2 and i == 1:
            y = y - wide[:, 32:48]
        if v == 5 and i == 0:  # kept for a read outside this call (an error)
            KeptBlock.stash = cache[0]
        if v == 5 and i == 3:
            y = y + KeptBlock.stash[:, :16]
        cache.append(y.repeat(1, WIDE))
        return y


class Kept(nn.Module):
    """``a`` and ``head`` on stage 0, four blocks on stage 1, each given the same cache list
    (two entries made on stage 0) and two wide tensors that do not require grad."""

    def __init__(self):
        super().__init__()
        self.a, self.head = nn.Linear(8, 16), nn.Linear(16, 3)
        self.blocks = nn.ModuleList(KeptBlock(i) for i in range(4))
        self.variant = 0

    def forward(self, x):
        h = self.a(x)
        cache = [torch.tanh(h).repeat(1, WIDE), (0.5 * h).repeat(1, WIDE)]
        wide = torch.sigmoid(x.detach()).repeat(1, 4 * WIDE)
        wide2 = torch.cos(x.detach()).repeat(1, 4 * WIDE)
        out = h
        for i, block in enumerate(self.blocks):
            out = block(out, cache, wide=wide, wide2=wide2)  # (positional ones count as read)
            if self.variant == 4 and i == 0:
                with torch.no_grad():
                    wide.mul_(2.0)  # after block 0's call: it read the value from before
        return self.head(out + wide[:, :16] + wide2[:, :16] + cache[0][:, :16])


def _kept_worker(keep: bool, variants: list, blocks: list, checkpointed: bool = False):
    import smp
    from smp.pipeline import protocol, runtime
    from smp.pipeline.sender import Sender

    smp.init({"pipeline_parallel_degree": 2, "microbatches": 2, "timeout_s": 60})
    runtime.PipelineRuntime.keep_unread = keep
    counts = {"request_bytes": 0, "fetches": 0}
    send = Sender.send

    def counting_send(self, peer, header, tensors, wait=False):
        if header[0] == protocol.REQUEST and header[3] == protocol._FETCH:
            counts["fetches"] += header[8] == protocol._ARGUMENT
        elif header[0] == protocol.REQUEST:
            counts["request_bytes"] += sum(t.numel() * t.element_size() for t in tensors[1:])
        return send(self, peer, header, tensors, wait)

    def place(module):
        smp.set_partition(module, 0)
        for name, stage in [("a", 0), ("head", 0), ("blocks", 1)]:
            smp.set_partition(getattr(module, name), stage)
        if checkpointed:  # the blocks run again in backward, on their arguments
            for block in module.blocks:
                smp.set_activation_checkpointing(block)

    def before_step(step, module):
        KeptBlock.variant = blocks[step]

    def after_step(step):
        out = dict(counts)
        counts.update(request_bytes=0, fetches=0)
        return out

    Sender.send = counting_send
    try:
        return exact_steps(smp, Kept, place, variants, 3, 2, before_step, after_step)
    finally:
        Sender.send = send
        runtime.PipelineRuntime.keep_unread = True
        KeptBlock.variant = 0


def test_unread_arguments_stay_and_kept_ones_read_are_exact(pools):
    """Step 0 learns what stage 1 reads; step 1 sends none of what it does not (stage 0's first
    cache entry, ``wide``, ``wide2``: 640 KiB per microbatch) and fetches nothing. Then a kept
    tensor is read by the call it was sent with after the caller changed its own (step 2), by
    later calls that took it by reference, with its gradient (step 3) and changed in place
    under no_grad (step 4): every step's loss and gradients match one process."""
    variants = [0, 0, 4, 1, 3, 2, 0]
    # Requests go from stage 0, FETCHes from stage 1: each step's counts of both.
    kept, sent = (
        [
            {k: a[k] + b[k] for k in a}
            for a, b in zip(*pools.run(2, _kept_worker, keep, variants, variants))
        ]
        for keep in (True, False)
    )
    m, entry = 2, 4 * 16 * WIDE * 4  # microbatches; bytes of a cache entry (a wide: 2)
    assert [s["fetches"] for s in sent] == [0] * len(variants), sent
    assert kept[1]["fetches"] == 0, kept
    assert sent[1]["request_bytes"] - kept[1]["request_bytes"] == m * 5 * entry  # 640 KiB
    # A kept tensor read is fetched, by each microbatch whose call was made before the first
    # FETCH reached stage 0 (steps 3 and 4 also run again: their calls' replies and gradients
    # went otherwise); from then on it goes with its call.
    fetches = [k["fetches"] for k in kept]
    assert fetches[0] > 0 and 1 <= fetches[2] <= m and min(fetches[3:5]) >= 1, fetches
    assert fetches[5:] == [0, 0] and kept[5:] == sent[5:], (kept, sent)


def test_kept_arguments_of_checkpointed_blocks(pools):
    """The blocks checkpointed: a recomputation reads what its forward read (fetched then),
    and the steps that read kept tensors stay exact. (Not variant 3: a checkpointed module may
    not change its input in place, kept or not.)"""
    variants = [0, 0, 4, 1, 2, 0]
    pools.run(2, _kept_worker, True, variants, variants, True)


def test_a_kept_argument_read_outside_its_call_fails_on_every_rank(pools):
    """A module that keeps an argument it did not read and reads it in a later call: the
    placeholder names the argument and the fix, and the step fails on both stages (one process
    would have read it; smp refuses rather than guess)."""
    results = pools.run(2, _kept_worker, True, [0, 0, None, 0], [0, 0, 5, 0])
    for rank, result in enumerate(results):
        assert "was first read outside that call's forward" in result[2], (rank, result[2])
