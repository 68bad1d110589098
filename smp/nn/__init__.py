"""smp.nn: distributed (tensor-parallel) modules. Sizes are always global.

See :mod:`smp.nn.modules` for the layouts and batch semantics, and :mod:`smp.nn.functional` for
the communication primitives they are built from.
"""

from smp.nn.functional import vocab_parallel_cross_entropy
from smp.nn.modules import (
    DistributedAttentionLayer,
    DistributedEmbedding,
    DistributedLayerNorm,
    DistributedLinear,
    DistributedModule,
    DistributedTransformer,
    DistributedTransformerLayer,
    DistributedTransformerLMHead,
    DistributedTransformerOutputLayer,
)

__all__ = [
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
