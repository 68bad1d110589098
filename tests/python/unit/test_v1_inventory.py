"""Inventory of SMP v1's documented PyTorch API: every name, parameter and config key exists in smp.

One table, ``ROWS``, of ``(qualified_name, kind, documented_params)``, written by hand from the
last SMP v1 documentation, and one parametrized test over it. ``smdistributed.modelparallel.torch``
is spelled ``smp`` throughout (v1 scripts ``import smdistributed.modelparallel.torch as smp``).

Sources (nothing is fetched at test time):

- ``aws/sagemaker-python-sdk`` at commit ``f08be97eb494f99ba807969ee8e748a582f9833e`` (2023-12-19),
  the parent of ``3d1b50ab4a4d`` ("SMP v2 doc updates"), which deleted the v1 pages. That
  snapshot is the newest v1 documentation ("Version 1.11.0, 1.13.0, 1.14.0, 1.15.0 (Latest)"):

  - ``doc/api/training/smp_versions/latest/smd_model_parallel_common_api.rst``
    (last changed in ``85972382537acb1acbb1b578eead2fd224cd3de2``)      -> [common]
  - ``doc/api/training/smp_versions/latest/smd_model_parallel_pytorch.rst``
    (last changed in ``bd4489a7e248a3cc8d621094387d17cb6d65a90d``)      -> [pytorch]
  - ``doc/api/training/smp_versions/latest/smd_model_parallel_pytorch_tensor_parallel.rst``
    (last changed in ``0eade552af2ef8d4af91e8dcd800d253cd896c87``)      -> [tp]
  - ``doc/api/training/smd_model_parallel_general.rst`` (configuration parameters)
    (last changed in ``3b4525700598a3a82b4432f1ccb1506d3b9bd8b8``)      -> [general]

  The archived v1.1.0 .. v1.10.0 pages of the same snapshot document no name the latest pages
  lack.
- ``awsdocs/amazon-sagemaker-developer-guide`` (SMP v1 developer guide), last versions before the
  repository dropped them: ``doc_source/model-parallel-extended-features-pytorch-hugging-face.md``
  at ``9e8dd3d3894736e87b21f34455c43ed7e7c2f181`` (the ``smp.nn.huggingface`` helpers) and the
  other ``doc_source/model-parallel*.md`` pages at ``e83cf46c424dffe5fb34291451b83adebc024e24``
  (the ``bf16`` and ``ddp_dist_backend`` keys, ``optimizer.clip_master_grads``,
  ``optimizer.optimizer``, ``smp.state.cfg.fp16``, ``smp.patches.checkpoint``)  -> [guide]
- Names that no page above documents but that SMP v1 scripts use (AWS's own examples in
  ``aws/amazon-sagemaker-examples``, training/distributed_training/pytorch/model_parallel) and
  that smp's own v1 list (test_v1_names.py) carries                            -> [extra]

Kinds:

- ``module``: ``import <name>`` works (v1 scripts ``from <module> import ...``).
- ``callable``: the name exists and is callable (function, decorator, context manager or class);
  ``inspect.signature`` accepts every documented parameter.
- ``class``: as ``callable``, and the name is a class.
- ``method``: ``Owner.name`` exists (on the class, or on an instance for instance attributes),
  is callable, and accepts the documented parameters (``self`` not counted).
- ``attribute``: the name exists (looked up again after ``smp.init`` and on an instance when
  it is an instance attribute).
- ``config``: ``documented_params`` is a config dict: ``smp.config.build_config`` accepts it
  without raising, and keeps the value of every key that is an smp key.

Parameters: ``"name"`` must be a parameter of that name (positional-or-keyword or keyword-only);
``"*name"`` needs a ``*args`` and ``"**name"`` a ``**kwargs`` parameter. A ``**kwargs`` stands in
for a named parameter only where ``ABSORBED_BY_KWARGS`` says why, or where ``FORWARDED_TO``
names the callable the ``**kwargs`` go to (which must then accept the name itself).

Names that v1 documents and smp exposes as a placeholder that raises ``NotImplementedError``
when used (``smp.core.unbuilt``) count as existing: their ``*args, **kwargs`` accept every
documented parameter until they are built, and then the real signature is checked. Methods of a
placeholder class pass for the same reason.

Deliberately not rows: TensorFlow-only API (``StepOutput.merge``/``accumulate``, ``tf.function``
arguments of ``smp.step``); ``smp.nn.DistributedSubmodule`` and ``smp.nn.Transformer`` (the pages
call the first hypothetical, the second a name that exists nowhere else);
``smp.delayed_parameter_initialization`` (a misspelling of ``delay_param_initialization`` in
[pytorch]); the ``mpi`` options of the estimator (not smp config).
"""

from __future__ import annotations

import importlib
import inspect
import itertools
import math
from typing import Any

import pytest
import torch

import smp
from smp.config import Config, build_config

# ----------------------------------------------------------------------------------------------
# The table
# ----------------------------------------------------------------------------------------------


def _plain(kind: str, *names: str) -> list[tuple[str, str, tuple[str, ...]]]:
    """Rows without documented parameters."""
    return [(name, kind, ()) for name in names]


_TRANSFORMER_LAYER_ARGS = (  # [tp] DistributedTransformerLayer(...) and its Arguments list
    "num_attention_heads",
    "attention_head_size",
    "hidden_size",
    "intermediate_size",
    "attention_dropout_prob",
    "hidden_dropout_prob",
    "activation",
    "layernorm_epsilon",
    "initializer_range",
    "use_normal_initialization",
    "causal_mask_size",
    "add_cross_attention",
    "pre_layernorm",
    "post_layernorm",
)

API_ROWS: list[tuple[str, str, tuple[str, ...]]] = [
    # --- [common] The Library's Core APIs ---------------------------------------------------
    ("smp.init", "callable", ()),  # .. function:: smp.init( )
    # .. function:: @smp.step(non_split_inputs, input_split_axes, [*args, **kwargs]);
    # PyTorch-only parameter: detach_outputs (bool, default True)
    ("smp.step", "callable", ("non_split_inputs", "input_split_axes", "detach_outputs")),
    ("smp.StepOutput", "class", ()),
    ("smp.StepOutput.outputs", "attribute", ()),  # .. data:: StepOutput.outputs
    ("smp.StepOutput.reduce_mean", "method", ()),
    ("smp.StepOutput.reduce_sum", "method", ()),
    ("smp.StepOutput.concat", "method", ()),
    ("smp.StepOutput.stack", "method", ()),
    # --- [common] MPI Basics ----------------------------------------------------------------
    *_plain(
        "callable",
        "smp.rank",
        "smp.size",
        "smp.get_world_process_group",
        "smp.local_rank",
        "smp.local_size",
        "smp.get_mp_group",
        "smp.get_dp_group",
        "smp.tp_rank",
        "smp.tp_size",
        "smp.get_tp_process_group",
        "smp.pp_rank",
        "smp.pp_size",
        "smp.get_pp_process_group",
        "smp.rdp_rank",
        "smp.rdp_size",
        "smp.get_rdp_process_group",
        "smp.mp_rank",
        "smp.mp_size",
        "smp.get_mp_process_group",
        "smp.dp_rank",
        "smp.dp_size",
        "smp.get_dp_process_group",
    ),
    # --- [common] Communication API ---------------------------------------------------------
    *_plain(
        "attribute",
        "smp.CommGroup",
        "smp.CommGroup.WORLD",
        "smp.CommGroup.MP_GROUP",
        "smp.CommGroup.DP_GROUP",
        "smp.CommGroup.TP_GROUP",
        "smp.CommGroup.PP_GROUP",
        "smp.CommGroup.RDP_GROUP",
        "smp.WORLD",
        "smp.MP_GROUP",
        "smp.DP_GROUP",
        "smp.RankType",
        "smp.RankType.WORLD_RANK",
        "smp.RankType.MP_RANK",
        "smp.RankType.DP_RANK",
    ),
    ("smp.broadcast", "callable", ("obj", "group")),  # smp.broadcast(obj, group)
    ("smp.send", "callable", ("obj", "dest_rank", "rank_type")),  # smp.send(obj, dest_rank, ...)
    ("smp.recv_from", "callable", ("src_rank", "rank_type")),  # smp.recv_from(src_rank, ...)
    ("smp.allgather", "callable", ("obj", "group")),  # smp.allgather(obj, group)
    ("smp.barrier", "callable", ("group",)),  # smp.barrier(group=smp.WORLD)
    ("smp.dp_barrier", "callable", ()),
    ("smp.mp_barrier", "callable", ()),
    # --- [pytorch] smdistributed.modelparallel.torch.DistributedModel -----------------------
    (
        "smp.DistributedModel",
        "class",
        (
            "module",
            "trace_device",  # "cpu" or "gpu", default "gpu"
            "trace_execution_times",  # default False
            "overlapping_allreduce",  # default True
            "backward_passes_per_step",  # default 1
            "average_grads_across_microbatches",  # default True
            "bucket_cap_mb",  # default 25
            "trace_memory_usage",  # default False
            "broadcast_buffers",  # default True
            "gradient_as_bucket_view",  # default False
        ),
    ),
    ("smp.DistributedModel.partitioned", "attribute", ()),  # **Properties**
    ("smp.DistributedModel.module", "attribute", ()),  # `model.module.submodule` in [pytorch]
    ("smp.DistributedModel.backward", "method", ("tensors", "grad_tensors")),
    ("smp.DistributedModel.local_buffers", "method", ()),
    ("smp.DistributedModel.local_named_buffers", "method", ()),
    ("smp.DistributedModel.local_parameters", "method", ()),
    ("smp.DistributedModel.local_named_parameters", "method", ()),
    ("smp.DistributedModel.local_modules", "method", ()),
    ("smp.DistributedModel.local_named_modules", "method", ()),
    ("smp.DistributedModel.local_state_dict", "method", ()),
    ("smp.DistributedModel.state_dict", "method", ()),
    ("smp.DistributedModel.load_state_dict", "method", ()),
    ("smp.DistributedModel.register_post_partition_hook", "method", ("hook",)),
    ("smp.DistributedModel.cpu", "method", ()),
    ("smp.DistributedModel.join", "method", ()),
    ("smp.DistributedModel.register_comm_hook", "method", ("state", "callable")),
    # Additional Methods of DistributedModel for Tensor Parallelism
    ("smp.DistributedModel.distributed_modules", "method", ()),
    ("smp.DistributedModel.is_distributed_parameter", "method", ("param",)),
    ("smp.DistributedModel.is_distributed_buffer", "method", ("buf",)),
    ("smp.DistributedModel.is_scaled_batch_parameter", "method", ("param",)),
    ("smp.DistributedModel.is_scaled_batch_buffer", "method", ("buf",)),
    ("smp.DistributedModel.default_reducer_named_parameters", "method", ()),
    ("smp.DistributedModel.scaled_batch_reducer_named_parameters", "method", ()),
    # --- [pytorch] smdistributed.modelparallel.torch.DistributedOptimizer -------------------
    # DistributedOptimizer(optimizer, static_loss_scale=1.0, dynamic_loss_scale=False,
    # **dynamic_loss_args); its example passes dynamic_loss_args={...} by name.
    (
        "smp.DistributedOptimizer",
        "class",
        ("optimizer", "static_loss_scale", "dynamic_loss_scale", "dynamic_loss_args"),
    ),
    ("smp.DistributedOptimizer.state_dict", "method", ()),
    ("smp.DistributedOptimizer.load_state_dict", "method", ()),
    ("smp.DistributedOptimizer.local_state_dict", "method", ()),
    # [guide] FP16 training: optimizer.clip_master_grads(max_norm); optimizer.optimizer for
    # an LR scheduler when smp.state.cfg.fp16
    ("smp.DistributedOptimizer.clip_master_grads", "method", ("max_norm",)),
    ("smp.DistributedOptimizer.optimizer", "attribute", ()),
    ("smp.state.cfg.fp16", "attribute", ()),
    # --- [pytorch] smdistributed.modelparallel.torch.nn.FlashAttentionLayer -----------------
    (
        "smp.nn.FlashAttentionLayer",
        "class",
        (
            "attention_dropout_prob",
            "attention_head_size",
            "scale_attention_scores",
            "scale_attn_by_layer_idx",
            "layer_idx",
            "scale",
            "triton_flash_attention",
            "use_alibi",
        ),
    ),
    ("smp.nn.FlashAttentionLayer.forward", "method", ("qkv", "attn_mask", "causal")),
    # --- [pytorch] Context Managers and Util Functions --------------------------------------
    # model_creation(tensor_parallelism=False, dtype=None, **tensor_parallel_config)
    (
        "smp.model_creation",
        "callable",
        ("tensor_parallelism", "dtype", "**tensor_parallel_config"),
    ),
    ("smp.partition", "callable", ("index",)),  # partition(index)
    # .. data:: amp.GradScaler: replaces torch.cuda.amp.GradScaler "and provides the same
    # functionality", so torch's documented constructor arguments
    (
        "smp.amp.GradScaler",
        "class",
        ("init_scale", "growth_factor", "backoff_factor", "growth_interval", "enabled"),
    ),
    ("smp.delay_param_initialization", "callable", ("enabled",)),  # (enabled=True)
    ("smp.is_initialized", "callable", ()),
    ("smp.is_tracing", "callable", ()),
    # .. data:: nn.FusedLayerNorm: replaces apex FusedLayerNorm, "the same functionality"
    ("smp.nn.FusedLayerNorm", "class", ("normalized_shape", "eps", "elementwise_affine")),
    ("smp.optimizers.FusedNovoGrad", "class", ()),  # replaces apex FusedNovoGrad
    ("smp.optimizers.FusedLamb", "class", ()),  # replaces apex FusedLAMB
    # --- [pytorch] APIs for Saving and Loading ----------------------------------------------
    # save(obj, f, partial=True, pickel_module=picklemodule, pickle_protocol=2, ); the signature
    # line misspells pickle_module, the Parameters list spells it right
    ("smp.save", "callable", ("obj", "f", "partial", "pickle_module", "pickle_protocol")),
    # load(f, map_location, pickle_module, pickle_load_args, partial=True); pickle_load_args are
    # "Optional keyword arguments passed to pickle_module.load()" (torch.load's **kwargs)
    (
        "smp.load",
        "callable",
        ("f", "map_location", "pickle_module", "**pickle_load_args", "partial"),
    ),
    (
        "smp.save_checkpoint",
        "callable",
        (
            "path",
            "tag",
            "partial",
            "model",
            "optimizer",
            "user_content",
            "translate_if_full",
            "num_kept_partial_checkpoints",
        ),
    ),
    (
        "smp.resume_from_checkpoint",
        "callable",
        (
            "path",
            "tag",
            "partial",
            "strict",
            "load_optimizer",
            "load_sharded_optimizer_state",
            "translate_function",
        ),
    ),
    # --- [tp] Registering Tensor Parallelism Distributed Modules ----------------------------
    (
        "smp.tp_register",
        "callable",
        ("dist_module", "init_hook", "forward_hook", "return_hook"),
    ),
    (
        "smp.tp_register_with_module",
        "callable",
        ("module_cls", "dist_module", "init_hook", "forward_hook", "return_hook"),
    ),
    # --- [tp] Tensor Parallelism Module APIs ------------------------------------------------
    ("smp.nn", "module", ()),
    ("smp.nn.DistributedModule", "class", ()),  # the base class tp_register takes
    ("smp.nn.DistributedLinear", "class", ("in_features", "out_features")),
    (
        "smp.nn.DistributedTransformerLMHead",
        "class",
        (
            "num_layers",
            "num_attention_heads",
            "attention_head_size",
            "hidden_size",
            "intermediate_size",
            "vocab_size",
            "num_positions",
            "attention_dropout_prob",
            "hidden_dropout_prob",
            "activation",
            "layernorm_epsilon",
            "num_token_types",
            "causal_mask_size",
            "add_cross_attention",
            "add_lm_head",
            "initializer_range",
            "use_normal_initialization",
            "pre_layernorm",
            "post_layernorm",
        ),
    ),
    ("smp.nn.DistributedTransformerLMHead.forward", "method", ("inputs",)),
    ("smp.nn.DistributedTransformer", "class", ("num_layers", *_TRANSFORMER_LAYER_ARGS)),
    # "For the other arguments and methods, refer to DistributedTransformerLayer"
    ("smp.nn.DistributedTransformer.forward", "method", ("inputs",)),
    # the Arguments list adds use_alibi (default False) and alibi_bias_max (default 8), v1.15.0
    (
        "smp.nn.DistributedTransformerLayer",
        "class",
        (*_TRANSFORMER_LAYER_ARGS, "use_alibi", "alibi_bias_max"),
    ),
    ("smp.nn.DistributedTransformerLayer.forward", "method", ("inputs",)),
    (
        "smp.nn.DistributedAttentionLayer",
        "class",
        (
            "num_attention_heads",
            "attention_head_size",
            "hidden_size",
            "attention_dropout_prob",
            "hidden_dropout_prob",
            "layernorm_epsilon",
            "initializer_range",
            "use_normal_initialization",
            "cross_attention",
            "causal_mask_size",
            "pre_layernorm",
            "post_layernorm",
        ),
    ),
    ("smp.nn.DistributedAttentionLayer.forward", "method", ("inputs",)),
    (
        "smp.nn.DistributedTransformerOutputLayer",
        "class",
        (
            "hidden_size",
            "intermediate_size",
            "hidden_dropout_prob",
            "activation",
            "layernorm_epsilon",
            "initializer_range",
            "use_normal_initialization",
            "pre_layernorm",
            "post_layernorm",
            "fp32_residual_addition",
        ),
    ),
    (
        "smp.nn.DistributedEmbedding",
        "class",
        (
            "num_embeddings",
            "embedding_dim",
            "padding_idx",
            "max_norm",
            "norm_type",
            "scale_grad_by_freq",
            "sparse",
            "_weight",
            "initializer_range",
            "_skip_allgather",
            "_skip_scatter_and_merge",
        ),
    ),
    # --- [tp] Enabling Tensor Parallelism ---------------------------------------------------
    # tensor_parallelism(enabled=True, **kwargs); kwargs (v1.7.0+): fused_softmax (default
    # True), fused_bias_gelu (default False)
    (
        "smp.tensor_parallelism",
        "callable",
        ("enabled", "**kwargs", "fused_softmax", "fused_bias_gelu"),
    ),
    ("smp.set_tensor_parallelism", "callable", ("module", "enabled", "**kwargs")),
    # --- [tp] Activation Checkpointing APIs -------------------------------------------------
    ("smp.patches.checkpoint", "module", ()),  # [guide]: from ...torch.patches.checkpoint import
    (
        "smp.patches.checkpoint.checkpoint",
        "callable",
        ("module", "*args", "preserve_rng_state"),
    ),
    (
        "smp.patches.checkpoint.checkpoint_sequential",
        "callable",
        ("sequential_module", "input", "strategy", "preserve_rng_state", "pack_args_as_tuple"),
    ),
    (
        "smp.set_activation_checkpointing",
        "callable",
        ("module", "preserve_rng_state", "pack_args_as_tuple", "strategy"),
    ),
    # --- [guide] Support for Hugging Face Transformer Models --------------------------------
    *[
        (f"smp.nn.huggingface.{model}", "module", ())
        for model in ("gpt2", "bert", "roberta", "gptj", "gptneo")
    ],
    *[
        (
            f"smp.nn.huggingface.{model}.translate_state_dict_to_hf_{model}",
            "callable",
            ("state_dict", "max_seq_len"),  # (state_dict, max_seq_len=None)
        )
        for model in ("gpt2", "bert", "roberta", "gptj", "gptneo")
    ],
    *[
        (
            f"smp.nn.huggingface.{model}.translate_hf_state_dict_to_smdistributed_{model}",
            "callable",
            ("state_dict",),
        )
        # gptj: the guide writes translate_hf_gptj_state_dict_to_smdistributed_gptj; v1 (and
        # AWS's GPT-J examples, which import it) spell it like the others
        for model in ("gpt2", "bert", "roberta", "gptj", "gptneo")
    ],
    # --- [extra] used by v1 scripts, not documented on the pages above ----------------------
    ("smp.set_partition", "callable", ()),
    ("smp.nn.DistributedLayerNorm", "class", ()),
    *_plain(
        "callable",
        "smp.get_world_group",
        "smp.get_tp_group",
        "smp.get_pp_group",
        "smp.get_rdp_group",
        "smp.tp_barrier",
        "smp.pp_barrier",
        "smp.rdp_barrier",
    ),
    *_plain("module", "smp.amp", "smp.optimizers", "smp.nn.huggingface"),
]

# A **kwargs that takes a documented name, and why that is the documented interface.
ABSORBED_BY_KWARGS: dict[tuple[str, str], str] = {
    ("smp.tensor_parallelism", "fused_softmax"): "[tp] documents it as one of the **kwargs",
    ("smp.tensor_parallelism", "fused_bias_gelu"): "[tp] documents it as one of the **kwargs",
}
# A **kwargs that passes documented names on: the target must accept each of them by name.
FORWARDED_TO: dict[str, str] = {
    "smp.nn.DistributedTransformer": "smp.nn.DistributedTransformerLayer",
}

# [general] "Parameters for smdistributed" (Common, TensorFlow-specific and PyTorch-specific
# tables) and [guide] (bf16, ddp_dist_backend): one row per documented value; the first key of
# each dict is the one under test, the others are what the documentation requires with it.
_BOOL_KEYS = (
    "auto_partition",  # default True; False needs default_partition
    "contiguous",  # TensorFlow-specific, default True
    "horovod",  # TensorFlow-specific, default False
    "ddp",  # default False
    "deterministic_server",  # >= v1.3, default False
    "offload_activations",  # >= v1.6, default False
    "fp16",  # >= v1.10, default False
    "fp16_params",  # >= v1.6, default False
    "shard_optimizer_state",  # >= v1.6, default False
    "prescaled_batch",  # >= v1.6, default False
    "skip_tracing",  # >= v1.6, default False
    "sdp_hierarchical_allgather",  # >= v1.11, default True
    "bf16",  # [guide], >= v1.11 with sharded data parallelism
)
_PLACEMENTS = ("cluster", "spread", *("".join(p) for p in itertools.permutations("DPT")))

CONFIG_ROWS: list[tuple[str, str, dict[str, Any]]] = [
    ("partitions", "config", {"partitions": 2}),  # required; int
    ("pipeline_parallel_degree", "config", {"pipeline_parallel_degree": 2}),  # PyTorch >= v1.6
    ("microbatches", "config", {"microbatches": 1}),  # int, default 1
    ("microbatches", "config", {"microbatches": 4}),
    *[("pipeline", "config", {"pipeline": v}) for v in ("interleaved", "simple")],
    *[("optimize", "config", {"optimize": v}) for v in ("memory", "speed")],
    *[("placement_strategy", "config", {"placement_strategy": v}) for v in _PLACEMENTS],
    *[
        (key, "config", {key: value} | ({"default_partition": 0} if not value else {}))
        if key == "auto_partition"
        else (key, "config", {key: value})
        for key in _BOOL_KEYS
        for value in (True, False)
    ],
    ("default_partition", "config", {"default_partition": 0, "auto_partition": False}),
    # float [0.0, 1.0]; default 0.2 if optimize is "speed", else 0.8
    ("memory_weight", "config", {"memory_weight": 0.8, "optimize": "memory"}),
    ("memory_weight", "config", {"memory_weight": 0.2, "optimize": "speed"}),
    ("memory_weight", "config", {"memory_weight": 0.0}),
    ("memory_weight", "config", {"memory_weight": 1.0}),
    # >= v1.3, int, default partitions + 2
    (
        "active_microbatches",
        "config",
        {"active_microbatches": 4, "partitions": 2, "microbatches": 4},
    ),
    ("activation_loading_horizon", "config", {"activation_loading_horizon": 4}),  # >= v1.6
    ("tensor_parallel_degree", "config", {"tensor_parallel_degree": 1}),  # >= v1.6, default 1
    # "If tensor_parallel_degree is greater than 1, then ddp must be set to True"
    ("tensor_parallel_degree", "config", {"tensor_parallel_degree": 2, "ddp": True}),
    ("sharded_data_parallel_degree", "config", {"sharded_data_parallel_degree": 1}),  # >= v1.11
    ("sdp_reduce_bucket_size", "config", {"sdp_reduce_bucket_size": 5e8}),  # int, 5e8
    ("sdp_param_persistence_threshold", "config", {"sdp_param_persistence_threshold": 1e6}),
    ("sdp_max_live_parameters", "config", {"sdp_max_live_parameters": 1e9}),
    ("sdp_gradient_clipping", "config", {"sdp_gradient_clipping": 1.0}),  # float, 1.0
    # [guide] >= v1.13: "auto" (default) or "nccl"
    *[("ddp_dist_backend", "config", {"ddp_dist_backend": v}) for v in ("auto", "nccl")],
]

ROWS: list[tuple[str, str, Any]] = [*API_ROWS, *CONFIG_ROWS]


def _row_id(row: tuple[str, str, Any]) -> str:
    name, kind, params = row
    if kind == "config":
        extra = "".join(f",{k}={v}" for k, v in list(params.items())[1:])
        return f"config:{name}={params[name]}{extra}"
    return f"{kind}:{name}"


# ----------------------------------------------------------------------------------------------
# Looking names up
# ----------------------------------------------------------------------------------------------


class Missing(LookupError):
    pass


def _resolve(qualified: str) -> Any:
    """``smp.a.b.c`` by attribute access, importing submodules that are not attributes yet."""
    parts = qualified.split(".")
    value: Any = importlib.import_module(parts[0])
    path = parts[0]
    for part in parts[1:]:
        path = f"{path}.{part}"
        if hasattr(value, part):
            value = getattr(value, part)
            continue
        if inspect.ismodule(value):
            try:
                value = importlib.import_module(path)
                continue
            except ModuleNotFoundError as exc:
                if exc.name != path:
                    raise
        raise Missing(f"{path} does not exist")
    return value


def _is_placeholder(value: Any) -> bool:
    """A name smp exposes but has not built yet: it raises NotImplementedError when used."""
    if isinstance(value, type):
        return getattr(value.__init__, "__module__", None) == "smp.core.unbuilt"
    return getattr(value, "__module__", None) == "smp.core.unbuilt"


@pytest.fixture(scope="module")
def instances():
    """smp initialised as a world of one, and an instance of each class whose documented
    attributes live on instances."""
    smp.init({})
    try:
        model = smp.DistributedModel(torch.nn.Linear(2, 2))
        optimizer = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
        yield {
            "smp.DistributedModel": model,
            "smp.DistributedOptimizer": optimizer,
            "smp.StepOutput": smp.StepOutput([torch.zeros(1), torch.ones(1)]),
        }
    finally:
        smp.shutdown()


def _member(owner_name: str, name: str, request) -> tuple[Any, Any, bool]:
    """(owner, member, bound): the member from the class, else from an instance."""
    owner = _resolve(owner_name)
    if hasattr(owner, name):
        return owner, getattr(owner, name), False
    instance = request.getfixturevalue("instances").get(owner_name)
    if instance is not None and hasattr(instance, name):
        return owner, getattr(instance, name), True
    raise Missing(f"{owner_name}.{name} does not exist (neither on the class nor an instance)")


# ----------------------------------------------------------------------------------------------
# Checking parameters
# ----------------------------------------------------------------------------------------------

_NAMED = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)


def _parameters(value: Any, drop_self: bool) -> list[inspect.Parameter]:
    params = list(inspect.signature(value).parameters.values())
    return params[1:] if drop_self and params else params


def _why_not(name: str, params: list[inspect.Parameter], doc: str) -> str | None:
    """Why ``params`` does not accept the documented parameter ``doc``; None when it does."""
    kinds = {p.kind for p in params}
    if doc.startswith("**"):
        return None if inspect.Parameter.VAR_KEYWORD in kinds else "no **kwargs parameter"
    if doc.startswith("*"):
        return None if inspect.Parameter.VAR_POSITIONAL in kinds else "no *args parameter"
    if any(p.name == doc and p.kind in _NAMED for p in params):
        return None
    if inspect.Parameter.VAR_KEYWORD not in kinds:
        return "no such parameter"
    if (name, doc) in ABSORBED_BY_KWARGS:
        return None
    if name in FORWARDED_TO:
        target = FORWARDED_TO[name]
        if any(p.name == doc and p.kind in _NAMED for p in _parameters(_resolve(target), False)):
            return None
        return f"not a parameter of {target}, which gets the **kwargs"
    return "only an unexplained **kwargs could take it"


def _unaccepted(name: str, params: list[inspect.Parameter], documented) -> list[str]:
    """The documented parameters ``params`` does not accept, each with why."""
    reasons = {doc: _why_not(name, params, doc) for doc in documented}
    return [f"{doc} ({why})" for doc, why in reasons.items() if why is not None]


def _check_params(name: str, value: Any, documented, drop_self: bool) -> None:
    if not documented or _is_placeholder(value):
        return  # a placeholder's (*args, **kwargs) takes everything until it is built
    try:
        params = _parameters(value, drop_self)
    except (TypeError, ValueError) as exc:
        pytest.fail(f"{name}: no inspectable signature ({exc}); documented: {list(documented)}")
    missing = _unaccepted(name, params, documented)
    have = ", ".join(str(p) for p in params)
    assert not missing, f"{name}({have}) does not accept documented parameter(s): {missing}"


# ----------------------------------------------------------------------------------------------
# The test
# ----------------------------------------------------------------------------------------------


def _check_config(user: dict[str, Any]) -> None:
    config = build_config(dict(user))  # must not raise
    fields = set(Config.__dataclass_fields__)
    aliases = {"partitions": "pipeline_parallel_degree", "fp16_params": "fp16"}
    for given, value in user.items():
        field = aliases.get(given, given)
        if field in fields:
            kept = getattr(config, field)
            same = math.isclose(kept, value) if isinstance(value, float) else kept == value
            assert same, f'config "{given}"={value!r} was accepted but became {field}={kept!r}'


@pytest.mark.parametrize("row", ROWS, ids=_row_id)
def test_the_v1_documented_api_exists(row, request):
    name, kind, documented = row
    if kind == "config":
        _check_config(documented)
        return
    if kind == "module":
        module = importlib.import_module(name)  # `from <name> import ...` must work
        assert inspect.ismodule(module)
        return
    if kind in ("method", "attribute") and name.count(".") >= 2:
        owner_name, _, member = name.rpartition(".")
        try:
            owner = _resolve(owner_name)
        except Missing:
            owner = None
        if isinstance(owner, type) and _is_placeholder(owner):
            return  # a placeholder class: its methods come when it is built
        if isinstance(owner, type):
            owner, value, bound = _member(owner_name, member, request)
            if kind == "method":
                assert callable(value), f"{name} is not callable"
                static = inspect.getattr_static(owner, member, None)
                drop_self = not bound and not isinstance(static, staticmethod | classmethod)
                _check_params(name, value, documented, drop_self)
            return
    try:
        value = _resolve(name)
    except Missing:
        if kind != "attribute":
            raise
        request.getfixturevalue("instances")  # e.g. smp.state.cfg: set up by smp.init
        value = _resolve(name)
    if kind == "attribute":
        return
    assert callable(value), f"{name} is not callable"
    if kind == "class":
        assert isinstance(value, type), f"{name} is not a class"
    _check_params(name, value, documented, drop_self=False)


def test_the_table_has_no_duplicate_rows():
    ids = [_row_id(row) for row in ROWS]
    assert len(ids) == len(set(ids)), sorted(i for i in ids if ids.count(i) > 1)
