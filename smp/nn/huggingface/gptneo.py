"""smp.nn.huggingface.gptneo (SMP v1): GPT-Neo state dicts to and from v1's distributed layout."""

from smp.nn.huggingface._translations import translations

(
    translate_hf_state_dict_to_smdistributed_gptneo,
    translate_state_dict_to_hf_gptneo,
) = translations("gptneo", "GPT-Neo")

__all__ = ["translate_hf_state_dict_to_smdistributed_gptneo", "translate_state_dict_to_hf_gptneo"]
