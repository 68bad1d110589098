"""The published numbers the planner is checked against, and the checks (design.md §13.2).

Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models"),
Figure 1: memory per GPU of GPT-3 175B, MT-NLG 530B and a 1T model at tp 8, microbatch 1,
s = 2048, counting 18 bytes per parameter (fp16 weights, fp32 gradients, fp32 masters and Adam
moments, as Megatron) and the activations of the first pipeline rank, which holds the
most: without recomputation, sbh(10 + 24/t + 5as/(ht)) per layer for their layer. 175B and 530B
run the interleaved schedule with 3 chunks per rank, 1T plain 1F1B.

:func:`full_scale_memory` traces :class:`MegatronLayer` (their layer, as one TP rank holds it)
on fake tensors and multiplies it by the layout as the planner's ledger does: the schedule IR's
in-flight count for the first rank and the layers per chunk.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from smp.planner.memory import Ledger, StateBytes, peak_in_flight
from smp.planner.profile import profile_model

__all__ = ["KORTHIKANTI_FIGURE_1", "MegatronLayer", "full_scale_memory"]

# name: (layers, hidden, heads, pipeline stages, chunks per rank, parameters + optimizer state
# GiB, activations GiB without recomputation)
KORTHIKANTI_FIGURE_1 = {
    "175B": (96, 12288, 96, 8, 3, 45.56, 66.84),
    "530B": (105, 20480, 128, 35, 3, 31.64, 114.02),
    "1T": (128, 25600, 160, 64, 1, 32.96, 131.25),
}
_GIB = 1024**3


class _Attention(nn.Module):
    """Megatron's attention for one TP rank of t: QKᵀ, softmax, dropout, ·V, eager."""

    def __init__(self, h: int, a: int, t: int = 1):
        super().__init__()
        self.heads, self.head_dim = a // t, h // a
        self.qkv = nn.Linear(h, 3 * h // t)
        self.proj = nn.Linear(h // t, h)  # row-parallel: its all-reduce saves nothing
        self.drop = nn.Dropout(0.1)

    def forward(self, x_SBH):
        s, b, _ = x_SBH.shape
        qkv = self.qkv(x_SBH).view(s, b, self.heads, 3 * self.head_dim).permute(1, 2, 0, 3)
        q, k, v = qkv.chunk(3, dim=-1)
        scores = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(self.head_dim)
        probs = self.drop(torch.softmax(scores, dim=-1))
        out = torch.matmul(probs, v).permute(2, 0, 1, 3).reshape(s, b, -1)
        return self.proj(out)


class MegatronLayer(nn.Module):
    """A GPT-3 layer as Korthikanti et al. count it, for one TP rank of t (no sequence
    parallelism): layer norms, dropouts and the residual stream replicated, the rest split."""

    def __init__(self, h: int, a: int, t: int = 1):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(h), nn.LayerNorm(h)
        self.attn = _Attention(h, a, t)
        self.fc1, self.fc2 = nn.Linear(h, 4 * h // t), nn.Linear(4 * h // t, h)
        self.drop1, self.drop2 = nn.Dropout(0.1), nn.Dropout(0.1)

    def forward(self, x_SBH):
        x_SBH = x_SBH + self.drop1(self.attn(self.ln1(x_SBH)))
        return x_SBH + self.drop2(self.fc2(nn.functional.gelu(self.fc1(self.ln2(x_SBH)))))


def full_scale_memory() -> list[dict]:
    """Per model of :data:`KORTHIKANTI_FIGURE_1`: the ledger's model states and activations of
    the first rank (GiB), and their errors against the figure."""
    rows = []
    for name, (layers, h, a, p, v, states_gib, act_gib) in KORTHIKANTI_FIGURE_1.items():
        with torch.device("meta"):
            layer = MegatronLayer(h, a, 8).half()
        x = torch.empty(2048, 1, h, dtype=torch.half, device="meta")
        profile = profile_model(layer, (x,), device="cuda")  # nothing allocated
        schedule = "interleaved" if v > 1 else "1f1b"
        ledger = Ledger.of(
            num_parameters=profile.parameter_bytes() / 2 * layers // p,
            activation_bytes=profile.activation_bytes() * layers // (p * v),
            in_flight=peak_in_flight(schedule, p, 2 * p, v)[0],  # m = 2p: the steady state
            states=StateBytes(weight=2, gradient=4, optimizer=12),
        )
        states = (ledger.parameters + ledger.gradients + ledger.optimizer) / _GIB
        rows.append(
            {
                "model": name,
                "states_gib": states,
                "states_error": states / states_gib - 1,
                "activations_gib": ledger.activations / _GIB,
                "activations_error": ledger.activations / _GIB / act_gib - 1,
                "layer_activation_bytes": profile.activation_bytes(),
            }
        )
    return rows
