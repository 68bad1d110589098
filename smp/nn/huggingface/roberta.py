"""smp.nn.huggingface.roberta (SMP v1): RoBERTa state dicts to and from v1's distributed layout."""

from smp.nn.huggingface._translations import translations

(
    translate_hf_state_dict_to_smdistributed_roberta,
    translate_state_dict_to_hf_roberta,
) = translations("roberta", "RoBERTa")

__all__ = ["translate_hf_state_dict_to_smdistributed_roberta", "translate_state_dict_to_hf_roberta"]
