"""smp.nn.huggingface (SMP v1): state-dict translation between Hugging Face models and SMP v1's
distributed transformer layout, one module per family (v1's names).

smp splits an unmodified Hugging Face model in place (``smp.tensor_parallelism()`` around it), so
its state dict keeps Hugging Face's keys and needs no translation; the translations to and from
v1's ``DistributedTransformerLMHead`` layout are not built yet: they import and fail when called.
"""

from smp.nn.huggingface import bert, gpt2, gptj, gptneo, roberta

__all__ = ["bert", "gpt2", "gptj", "gptneo", "roberta"]
