"""smp.nn.huggingface (SMP v1): state-dict translation between Hugging Face models and smp's
distributed transformer layers."""

from smp.nn.huggingface import gpt2

__all__ = ["gpt2"]
