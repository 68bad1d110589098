"""The translation functions of SMP v1's ``smp.nn.huggingface.<family>`` modules (not built)."""

from __future__ import annotations

from typing import Any, NoReturn

from smp.core.unbuilt import fail


def translations(family: str, human: str):
    """(to smdistributed, to Hugging Face) for ``family``, with v1's names and arguments."""

    def to_smdistributed(state_dict: dict, max_seq_len: Any = None) -> NoReturn:
        fail(
            f"smp.nn.huggingface.{family}.translate_hf_state_dict_to_smdistributed_{family}",
            f"{human} keys to SMP v1's DistributedTransformerLMHead layout",
        )

    def to_hf(state_dict: dict, max_seq_len: Any = None) -> NoReturn:
        fail(
            f"smp.nn.huggingface.{family}.translate_state_dict_to_hf_{family}",
            f"SMP v1's DistributedTransformerLMHead layout to {human} keys",
        )

    to_smdistributed.__name__ = to_smdistributed.__qualname__ = (
        f"translate_hf_state_dict_to_smdistributed_{family}"
    )
    to_hf.__name__ = to_hf.__qualname__ = f"translate_state_dict_to_hf_{family}"
    return to_smdistributed, to_hf
