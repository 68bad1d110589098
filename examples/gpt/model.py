"""A small GPT (decoder-only transformer), written from scratch in plain torch.

Used by the smp GPT example (``train.py``) and by the project's tests as the "small GPT"
(``from model import GPT, GPTConfig, lm_loss``). Importing this module has no side effects.

The model is deterministic given its inputs and parameters: attention uses explicit math with a
registered causal-mask buffer rather than a fused kernel, so every process computes the same
numbers for the same inputs.

Shape suffix legend (one letter per dimension):
    B: batch size            T: sequence length (T <= block_size)
    C: embedding width (n_embd)   H: number of heads   D: head width (C // H)
    V: vocabulary size       F: MLP hidden width (4 * C)   S: attended-to (key) positions
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class GPTConfig:
    vocab_size: int = 256  # byte-level
    block_size: int = 128  # longest sequence the model accepts
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    dropout: float = 0.0
    bias: bool = True  # bias in Linear and LayerNorm layers


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        if cfg.n_embd % cfg.n_head != 0:
            raise ValueError(f"n_embd ({cfg.n_embd}) must be divisible by n_head ({cfg.n_head})")
        self.n_head = cfg.n_head
        self.n_embd = cfg.n_embd
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.bias)  # fused q, k, v
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.attn_dropout = nn.Dropout(cfg.dropout)
        self.resid_dropout = nn.Dropout(cfg.dropout)
        # True where a query position may attend to a key position (lower triangle).
        mask_TS = torch.tril(torch.ones(cfg.block_size, cfg.block_size, dtype=torch.bool))
        self.register_buffer(
            "mask_TS", mask_TS.view(1, 1, cfg.block_size, cfg.block_size), persistent=False
        )

    def forward(self, x_BTC: torch.Tensor) -> torch.Tensor:
        B, T, _ = x_BTC.shape
        D = self.n_embd // self.n_head
        # Heads as -1 and q, k, v as thirds: the same code runs when tensor parallelism gives
        # this rank a slice of the heads (see train.py).
        q_BTC, k_BTC, v_BTC = self.c_attn(x_BTC).chunk(3, dim=2)
        q_BHTD = q_BTC.view(B, T, -1, D).transpose(1, 2)
        k_BHSD = k_BTC.view(B, T, -1, D).transpose(1, 2)
        v_BHSD = v_BTC.view(B, T, -1, D).transpose(1, 2)

        scores_BHTS = (q_BHTD @ k_BHSD.transpose(-2, -1)) * (1.0 / math.sqrt(D))
        scores_BHTS = scores_BHTS.masked_fill(~self.mask_TS[:, :, :T, :T], float("-inf"))
        att_BHTS = self.attn_dropout(F.softmax(scores_BHTS, dim=-1))
        y_BHTD = att_BHTS @ v_BHSD
        y_BTC = y_BHTD.transpose(1, 2).contiguous().view(B, T, -1)
        return self.resid_dropout(self.c_proj(y_BTC))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=cfg.bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x_BTC: torch.Tensor) -> torch.Tensor:
        h_BTF = self.gelu(self.c_fc(x_BTC))
        return self.dropout(self.c_proj(h_BTF))


class Block(nn.Module):
    """Pre-LayerNorm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.mlp = MLP(cfg)

    def forward(self, x_BTC: torch.Tensor) -> torch.Tensor:
        x_BTC = x_BTC + self.attn(self.ln_1(x_BTC))
        x_BTC = x_BTC + self.mlp(self.ln_2(x_BTC))
        return x_BTC


# How tensor parallelism splits a Block (``smp.tp_register_plan(Block, **BLOCK_TP_PLAN)``): Q, K,
# V (fused, as thirds) and MLP-in become column shards, the two output projections row shards,
# and each rank's attention takes its share of the heads. The block's own forward keeps running.
BLOCK_TP_PLAN = dict(
    column=["attn.c_attn", "mlp.c_fc"],
    row=["attn.c_proj", "mlp.c_proj"],
    fused={"attn.c_attn": 3},
    heads=[("attn", "n_head")],
)


class GPT(nn.Module):
    """GPT-2 style language model. ``forward(idx_BT)`` returns ``logits_BTV``.

    ``lm_head.weight`` is tied to (is the same Parameter as) ``wte.weight``.
    """

    def __init__(self, cfg: GPTConfig | None = None):
        super().__init__()
        cfg = cfg if cfg is not None else GPTConfig()
        self.config = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)
        self.h = nn.ModuleList([Block(cfg) for _ in range(cfg.n_layer)])
        self.ln_f = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # weight tying

        # GPT-2 initialisation: N(0, 0.02) everywhere, zero biases, and the projections that
        # write into the residual stream scaled by 1/sqrt(2 * n_layer).
        self.apply(self._init_weights)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def num_parameters(self) -> int:
        """Distinct parameters (the tied embedding counted once)."""
        return sum(p.numel() for p in self.parameters())

    def forward(self, idx_BT: torch.Tensor) -> torch.Tensor:
        seq_len = idx_BT.size(1)
        if seq_len > self.config.block_size:
            raise ValueError(
                f"sequence length {seq_len} exceeds block_size {self.config.block_size}"
            )
        pos_T = torch.arange(seq_len, dtype=torch.long, device=idx_BT.device)
        x_BTC = self.drop(self.wte(idx_BT) + self.wpe(pos_T))
        for block in self.h:
            x_BTC = block(x_BTC)
        x_BTC = self.ln_f(x_BTC)
        logits_BTV = self.lm_head(x_BTC)
        return logits_BTV


def lm_loss(logits_BTV: torch.Tensor, targets_BT: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over all B*T tokens."""
    V = logits_BTV.size(-1)
    return F.cross_entropy(logits_BTV.reshape(-1, V), targets_BT.reshape(-1))
