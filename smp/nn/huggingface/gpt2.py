"""smp.nn.huggingface.gpt2 (SMP v1): GPT-2 state dicts to and from v1's distributed layout."""

from smp.nn.huggingface._translations import translations

(
    translate_hf_state_dict_to_smdistributed_gpt2,
    translate_state_dict_to_hf_gpt2,
) = translations("gpt2", "GPT-2")

# The name of SMP v1's earlier releases, which its 2022 GPT-2 scripts import.
translate_hf_state_dict_to_smdistributed = translate_hf_state_dict_to_smdistributed_gpt2

__all__ = [
    "translate_hf_state_dict_to_smdistributed_gpt2",
    "translate_hf_state_dict_to_smdistributed",
    "translate_state_dict_to_hf_gpt2",
]
