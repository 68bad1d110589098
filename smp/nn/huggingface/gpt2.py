"""smp.nn.huggingface.gpt2 (SMP v1): GPT-2 state dicts to and from smp's distributed transformer.

smp splits an unmodified Hugging Face GPT-2 in place (``smp.tensor_parallelism()`` around it), so
its state dict keeps Hugging Face's keys and these translations are the identity there; for
v1's ``DistributedTransformerLMHead`` layout they are not built yet.
"""

from __future__ import annotations

from typing import Any

from smp._unbuilt import fail

__all__ = [
    "translate_hf_state_dict_to_smdistributed_gpt2",
    "translate_state_dict_to_hf_gpt2",
]


def translate_hf_state_dict_to_smdistributed_gpt2(state_dict: dict, max_seq_len: Any = None):
    fail(
        "smp.nn.huggingface.gpt2.translate_hf_state_dict_to_smdistributed_gpt2",
        "GPT-2 keys to SMP v1's DistributedTransformerLMHead layout",
    )


def translate_state_dict_to_hf_gpt2(state_dict: dict, max_seq_len: Any = None):
    fail(
        "smp.nn.huggingface.gpt2.translate_state_dict_to_hf_gpt2",
        "SMP v1's DistributedTransformerLMHead layout to GPT-2 keys",
    )
