"""Small models and deterministic data shared by the Python tests."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from model import GPT, GPTConfig, lm_loss  # examples/gpt, put on sys.path by conftest
from torch import nn


class MLP(nn.Module):
    def __init__(self, d_in: int = 12, d_hidden: int = 32, d_out: int = 5):
        super().__init__()
        self.fc1 = nn.Linear(d_in, d_hidden)
        self.fc2 = nn.Linear(d_hidden, d_hidden)
        self.head = nn.Linear(d_hidden, d_out)

    def forward(self, x):
        return self.head(torch.tanh(self.fc2(torch.relu(self.fc1(x)))))


def tiny_gpt_config() -> GPTConfig:
    return GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32, dropout=0.0)


def build_model(name: str) -> nn.Module:
    if name == "mlp":
        return MLP()
    if name == "gpt":
        return GPT(tiny_gpt_config())
    raise ValueError(name)


def make_batch(name: str, batch_size: int, step: int, seed: int = 1234):
    """The global batch of ``step``: (inputs, targets), identical on every rank."""
    g = torch.Generator().manual_seed(seed * 1000 + step)
    if name == "mlp":
        return torch.randn(batch_size, 12, generator=g), torch.randint(
            0, 5, (batch_size,), generator=g
        )
    cfg = tiny_gpt_config()
    tokens = torch.randint(0, cfg.vocab_size, (batch_size, cfg.block_size + 1), generator=g)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def loss_fn(name: str, output, target):
    if name == "mlp":
        return F.cross_entropy(output, target)
    return lm_loss(output, target)
