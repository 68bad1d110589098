"""smp.nn.huggingface.bert (SMP v1): BERT state dicts to and from v1's distributed layout."""

from smp.nn.huggingface._translations import translations

(
    translate_hf_state_dict_to_smdistributed_bert,
    translate_state_dict_to_hf_bert,
) = translations("bert", "BERT")

__all__ = ["translate_hf_state_dict_to_smdistributed_bert", "translate_state_dict_to_hf_bert"]
