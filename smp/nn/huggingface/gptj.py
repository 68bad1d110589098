"""smp.nn.huggingface.gptj (SMP v1): GPT-J state dicts to and from v1's distributed layout."""

from smp.nn.huggingface._translations import translations

(
    translate_hf_state_dict_to_smdistributed_gptj,
    translate_state_dict_to_hf_gptj,
) = translations("gptj", "GPT-J")

__all__ = ["translate_hf_state_dict_to_smdistributed_gptj", "translate_state_dict_to_hf_gptj"]
