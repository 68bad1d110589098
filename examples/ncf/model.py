"""Neural Collaborative Filtering (NeuMF, He et al. 2017) and synthetic implicit-feedback data.

Plain PyTorch, no smp: ``train.py`` marks the embedding tables for tensor parallelism, and the
tests build the same model as a one-process reference.

NeuMF scores a (user, item) pair with two towers over separate embedding tables:
  - GMF (generalised matrix factorisation): the element-wise product of the user's and the
    item's GMF embeddings;
  - MLP: the concatenation of the user's and the item's MLP embeddings through Linear + ReLU
    layers, each half as wide as the one before;
and a prediction layer over the two towers' outputs concatenated, giving one logit.

Shape suffix legend: B batch (pairs), U users, I items, K latent factors, C candidates per user.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn


class NeuMF(nn.Module):
    """NeuMF: ``forward(users_B, items_B) -> logits_B``.

    Args:
        num_users, num_items: rows of the user and item tables (global sizes).
        gmf_dim: width of the GMF embeddings (and of the GMF tower's output).
        mlp_layers: widths of the MLP tower; the first is the concatenated user + item MLP
            embedding (each table is half of it wide), the last the tower's output.
    """

    def __init__(
        self,
        num_users: int,
        num_items: int,
        gmf_dim: int = 16,
        mlp_layers: tuple[int, ...] = (64, 32, 16),
    ):
        super().__init__()
        if mlp_layers[0] % 2:
            raise ValueError(f"mlp_layers[0] = {mlp_layers[0]} must be even (user + item halves)")
        self.gmf_user = nn.Embedding(num_users, gmf_dim)
        self.gmf_item = nn.Embedding(num_items, gmf_dim)
        self.mlp_user = nn.Embedding(num_users, mlp_layers[0] // 2)
        self.mlp_item = nn.Embedding(num_items, mlp_layers[0] // 2)
        layers: list[nn.Module] = []
        for d_in, d_out in zip(mlp_layers[:-1], mlp_layers[1:]):
            layers += [nn.Linear(d_in, d_out), nn.ReLU()]
        self.mlp = nn.Sequential(*layers)
        self.predict = nn.Linear(gmf_dim + mlp_layers[-1], 1)
        for table in self.embedding_tables():  # the paper's initialisation
            nn.init.normal_(table.weight, std=0.01)

    def embedding_tables(self) -> list[nn.Module]:
        """The four tables: nearly all of the model's parameters."""
        return [self.gmf_user, self.gmf_item, self.mlp_user, self.mlp_item]

    def forward(self, users_B: torch.Tensor, items_B: torch.Tensor) -> torch.Tensor:
        gmf = self.gmf_user(users_B) * self.gmf_item(items_B)
        mlp = self.mlp(torch.cat([self.mlp_user(users_B), self.mlp_item(items_B)], dim=-1))
        return self.predict(torch.cat([gmf, mlp], dim=-1)).squeeze(-1)


# ---- synthetic implicit feedback ----------------------------------------------------------------


@dataclasses.dataclass
class Interactions:
    """Who interacted with what. ``positive_UI``: every interaction (training and held out);
    ``train_users_P`` / ``train_items_P``: the training pairs; ``heldout_U``: one held-out
    positive item per user (leave-one-out); ``candidates_UC``: the held-out item followed by
    ``C - 1`` items the user never interacted with (the evaluation's ranking)."""

    num_users: int
    num_items: int
    positive_UI: torch.Tensor
    train_users_P: torch.Tensor
    train_items_P: torch.Tensor
    heldout_U: torch.Tensor
    candidates_UC: torch.Tensor


def make_interactions(
    num_users: int,
    num_items: int,
    per_user: int = 20,
    factors: int = 4,
    eval_negatives: int = 99,
    strength: float = 4.0,
    seed: int = 0,
) -> Interactions:
    """Users and items with latent factors; each user's ``per_user`` positives are drawn without
    replacement from softmax(affinity) (Gumbel top-k), where affinity is ``strength`` x the
    factors' dot product / sqrt(factors) plus an item popularity bias. One positive per user is
    held out. The same ``seed`` gives the same data in every process."""
    if per_user + eval_negatives > num_items:
        raise ValueError(
            f"{per_user} positives + {eval_negatives} evaluation negatives per user need at "
            f"least that many items, got {num_items}"
        )
    g = torch.Generator().manual_seed(seed)
    users_UK = torch.randn(num_users, factors, generator=g)
    items_IK = torch.randn(num_items, factors, generator=g)
    popularity_I = 0.5 * torch.randn(num_items, generator=g)
    affinity_UI = strength * users_UK @ items_IK.T / factors**0.5 + popularity_I
    gumbel_UI = -torch.log(
        -torch.log(torch.rand(num_users, num_items, generator=g).clamp_min(1e-20))
    )
    chosen_UP = (affinity_UI + gumbel_UI).topk(per_user, dim=1).indices
    positive_UI = torch.zeros(num_users, num_items, dtype=torch.bool)
    positive_UI.scatter_(1, chosen_UP, True)

    # Leave one out: a random one of each user's positives.
    pick_U = torch.randint(0, per_user, (num_users,), generator=g)
    heldout_U = chosen_UP.gather(1, pick_U[:, None]).squeeze(1)
    keep_UP = torch.ones_like(chosen_UP, dtype=torch.bool)
    keep_UP.scatter_(1, pick_U[:, None], False)
    train_items_P = chosen_UP[keep_UP]
    train_users_P = torch.arange(num_users)[:, None].expand_as(chosen_UP)[keep_UP]

    # Evaluation candidates: random items the user never interacted with (positives sort last).
    noise_UI = torch.rand(num_users, num_items, generator=g).masked_fill(positive_UI, 2.0)
    negatives_UN = noise_UI.topk(eval_negatives, dim=1, largest=False).indices
    candidates_UC = torch.cat([heldout_U[:, None], negatives_UN], dim=1)
    return Interactions(
        num_users,
        num_items,
        positive_UI,
        train_users_P,
        train_items_P,
        heldout_U,
        candidates_UC,
    )


def sample_batch(
    data: Interactions, positives: int, negatives: int, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``positives`` training pairs (label 1), each with ``negatives`` items its user never
    interacted with (label 0), shuffled: (users_B, items_B, labels_B), B = positives x (1 +
    negatives)."""
    pick_B = torch.randint(0, len(data.train_users_P), (positives,), generator=gen)
    users, items = data.train_users_P[pick_B], data.train_items_P[pick_B]
    neg_users = users.repeat_interleave(negatives)
    neg_items = torch.randint(0, data.num_items, (len(neg_users),), generator=gen)
    clash = data.positive_UI[neg_users, neg_items]
    while clash.any():  # resample the negatives that are positives
        neg_items[clash] = torch.randint(0, data.num_items, (int(clash.sum()),), generator=gen)
        clash = data.positive_UI[neg_users, neg_items]
    users_B = torch.cat([users, neg_users])
    items_B = torch.cat([items, neg_items])
    labels_B = torch.cat([torch.ones(len(users)), torch.zeros(len(neg_users))])
    order = torch.randperm(len(users_B), generator=gen)
    return users_B[order], items_B[order], labels_B[order]


def hits_at_k(scores_UC: torch.Tensor, k: int = 10) -> torch.Tensor:
    """Per user, whether the held-out item (candidate 0) ranks in the top ``k`` of the ``C``
    candidates (ties count against it)."""
    rank_U = (scores_UC[:, 1:] >= scores_UC[:, :1]).sum(dim=1)
    return rank_U < k
