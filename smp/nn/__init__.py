"""smp.nn: distributed (tensor-parallel) modules. Sizes are always global.

See :mod:`smp.tp.modules` for the batch semantics, :mod:`smp.tp.transformer` for the transformer
layouts, and :mod:`smp.tp.functional` for the communication primitives they are built from.
"""

import torch

from smp.core.unbuilt import placeholder
from smp.nn import huggingface
from smp.tp.functional import vocab_parallel_cross_entropy
from smp.tp.modules import (
    DistributedEmbedding,
    DistributedLayerNorm,
    DistributedLinear,
    DistributedModule,
)
from smp.tp.transformer import (
    DistributedAttentionLayer,
    DistributedTransformer,
    DistributedTransformerLayer,
    DistributedTransformerLMHead,
    DistributedTransformerOutputLayer,
)


class FusedLayerNorm(torch.nn.LayerNorm):
    """SMP v1's (and apex's) FusedLayerNorm: ``torch.nn.LayerNorm`` with the same arguments
    (``normalized_shape, eps=1e-5, elementwise_affine=True``); torch's kernel is used."""

    def __init__(self, normalized_shape, eps: float = 1e-5, elementwise_affine: bool = True, **kw):
        super().__init__(normalized_shape, eps=eps, elementwise_affine=elementwise_affine, **kw)


FlashAttentionLayer = placeholder(
    "smp.nn.FlashAttentionLayer", "a flash-attention layer for SMP v1's distributed transformer"
)

__all__ = [
    "huggingface",
    "FusedLayerNorm",
    "FlashAttentionLayer",
    "DistributedModule",
    "DistributedLinear",
    "DistributedEmbedding",
    "DistributedLayerNorm",
    "DistributedAttentionLayer",
    "DistributedTransformerOutputLayer",
    "DistributedTransformerLayer",
    "DistributedTransformer",
    "DistributedTransformerLMHead",
    "vocab_parallel_cross_entropy",
]
