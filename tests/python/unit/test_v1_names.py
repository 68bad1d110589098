"""SMP v1's names exist in smp: those built work, those not built yet import and fail only when
used, with a message saying what is missing."""

from __future__ import annotations

import importlib

import pytest
import torch

import smp

V1_NAMES = [
    "smp.init", "smp.step", "smp.DistributedModel", "smp.DistributedOptimizer",
    "smp.partition", "smp.set_partition", "smp.is_tracing", "smp.delay_param_initialization",
    "smp.tensor_parallelism", "smp.set_tensor_parallelism", "smp.model_creation",
    "smp.tp_register", "smp.tp_register_with_module",
    "smp.get_world_group", "smp.get_pp_group", "smp.get_tp_group", "smp.get_dp_group",
    "smp.get_rdp_group", "smp.get_mp_group",
    "smp.barrier", "smp.pp_barrier", "smp.tp_barrier", "smp.dp_barrier", "smp.rdp_barrier",
    "smp.mp_barrier", "smp.broadcast", "smp.send", "smp.recv_from", "smp.allgather",
    "smp.rank", "smp.size", "smp.local_rank", "smp.local_size", "smp.pp_rank", "smp.pp_size",
    "smp.tp_rank", "smp.tp_size", "smp.dp_rank", "smp.dp_size", "smp.rdp_rank", "smp.rdp_size",
    "smp.mp_rank", "smp.mp_size", "smp.WORLD", "smp.PP_GROUP", "smp.TP_GROUP", "smp.DP_GROUP",
    "smp.RDP_GROUP", "smp.MP_GROUP", "smp.amp.GradScaler", "smp.optimizers.FusedLamb",
    "smp.optimizers.FusedLAMB", "smp.optimizers.FusedNovoGrad", "smp.nn.FusedLayerNorm",
    "smp.nn.FlashAttentionLayer", "smp.nn.DistributedLinear", "smp.nn.DistributedEmbedding",
    "smp.nn.DistributedLayerNorm", "smp.nn.DistributedTransformer",
    "smp.nn.DistributedTransformerLayer", "smp.nn.DistributedTransformerLMHead",
    "smp.nn.huggingface.gpt2.translate_hf_state_dict_to_smdistributed_gpt2",
    "smp.nn.huggingface.gpt2.translate_state_dict_to_hf_gpt2", "smp.__version__",
    "smp.save", "smp.load", "smp.save_checkpoint", "smp.resume_from_checkpoint",
    "smp.set_activation_checkpointing", "smp.checkpoint", "smp.checkpoint_sequential",
    "smp.num_microbatches", "smp.utils.rmsg", "smp.utils.get_distribution_axis",
    "smp.state_mod.state", "smp.test.torch.utils.dump_model", "smp.test.torch.utils.verify",
    "smp.nn.huggingface.gpt2.translate_hf_state_dict_to_smdistributed",
]  # fmt: skip


def _resolve(path: str):
    """The object at ``path``, importing modules as a script's ``from a.b import c`` would."""
    parts = path.split(".")
    value = importlib.import_module(parts[0])
    for i, part in enumerate(parts[1:], start=1):
        if not hasattr(value, part):
            importlib.import_module(".".join(parts[: i + 1]))
        value = getattr(value, part)
    return value


@pytest.mark.parametrize("path", V1_NAMES)
def test_the_v1_name_exists(path):
    assert _resolve(path) is not None


@pytest.mark.parametrize(
    "use,words",
    [
        (lambda: smp.optimizers.FusedLamb([torch.zeros(1)]), "LAMB"),
        (lambda: smp.optimizers.FusedNovoGrad([torch.zeros(1)]), "NovoGrad"),
        (lambda: smp.nn.FlashAttentionLayer(), "flash-attention"),
        (lambda: smp.nn.huggingface.gpt2.translate_state_dict_to_hf_gpt2({}), "GPT-2 keys"),
    ],
)
def test_what_is_not_built_fails_when_used_and_says_what(use, words):
    with pytest.raises(NotImplementedError, match="not built yet") as info:
        use()
    assert words in str(info.value)


def test_fused_layer_norm_is_layer_norm():
    torch.manual_seed(0)
    x = torch.randn(3, 8)
    fused, plain = smp.nn.FusedLayerNorm(8, eps=1e-6), torch.nn.LayerNorm(8, eps=1e-6)
    torch.testing.assert_close(fused(x), plain(x), rtol=0, atol=0)
    with smp.delay_param_initialization(enabled=False):
        assert not smp.is_tracing()


def test_the_v1_parent_package_reaches_smp_and_its_version():
    from smp.compat import smdistributed

    assert smdistributed.modelparallel.torch is smp
    assert smdistributed.modelparallel.__version__ == smp.__version__


def test_v1_internal_helpers_that_scripts_import():
    from smp.state_mod import state
    from smp.utils import get_distribution_axis, rmsg

    weight = torch.nn.Parameter(torch.zeros(2))
    assert get_distribution_axis(weight) is None
    weight._smp_tp_split = (1, 1)
    assert get_distribution_axis(weight) == 1
    smp.init({})
    try:
        assert state.cfg is smp.state.cfg and state.cfg.fp16 is False
        assert rmsg("hello").endswith("] hello") and rmsg("hello").startswith("[0:")
    finally:
        smp.shutdown()
