"""Unit tests of smp/config.py; loaded by path so they run without torch or a built smp._C."""

import copy
import dataclasses
import importlib.util
import itertools
import sys
from pathlib import Path

import pytest

_PATH = Path(__file__).parents[3] / "smp" / "config.py"
_spec = importlib.util.spec_from_file_location("_smp_config_under_test", _PATH)
config_mod = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = config_mod  # dataclasses looks the module up while building Config
_spec.loader.exec_module(config_mod)
Config = config_mod.Config
build_config = config_mod.build_config

ALL_KEYS = {
    "pipeline_parallel_degree",
    "tensor_parallel_degree",
    "microbatches",
    "pipeline",
    "pipeline_schedule",
    "pipeline_async_calls",
    "active_microbatches",
    "deferred_weight_microbatches",
    "optimize",
    "memory_weight",
    "auto_partition",
    "default_partition",
    "placement_strategy",
    "ddp",
    "overlapping_allreduce",
    "prescaled_batch",
    "shard_optimizer_state",
    "offload_activations",
    "activation_loading_horizon",
    "fp16",
    "bf16",
    "tensor_parallel_seed",
    "delayed_parameter_initialization",
    "skip_tracing",
    "backend",
    "device",
    "timeout_s",
    "sharded_data_parallel_degree",
}
BOOL_KEYS = [
    "pipeline_async_calls",
    "auto_partition",
    "ddp",
    "overlapping_allreduce",
    "prescaled_batch",
    "shard_optimizer_state",
    "offload_activations",
    "fp16",
    "bf16",
    "delayed_parameter_initialization",
    "skip_tracing",
]


def expect_error(user, *fragments, world_size=None):
    with pytest.raises(ValueError) as info:
        build_config(user, world_size)
    message = str(info.value)
    assert message.startswith("smp config:"), message
    for fragment in fragments:
        assert fragment in message, (fragment, message)
    return message


# --- defaults ---------------------------------------------------------------------------------


@pytest.mark.parametrize("user", [None, {}])
def test_defaults(user):
    c = build_config(user)
    assert c == Config()
    assert c.to_dict() == {
        "pipeline_parallel_degree": 1,
        "tensor_parallel_degree": 1,
        "microbatches": 1,
        "pipeline": "interleaved",
        "pipeline_schedule": None,
        "pipeline_async_calls": True,
        "active_microbatches": 1,
        "deferred_weight_microbatches": 1,
        "optimize": "speed",
        "memory_weight": 0.2,
        "auto_partition": True,
        "default_partition": 0,
        "placement_strategy": "cluster",
        "ddp": True,
        "overlapping_allreduce": True,
        "prescaled_batch": False,
        "shard_optimizer_state": False,
        "offload_activations": False,
        "sharded_data_parallel_degree": 1,
        "activation_loading_horizon": 4,
        "fp16": False,
        "bf16": False,
        "tensor_parallel_seed": 0,
        "delayed_parameter_initialization": False,
        "skip_tracing": False,
        "backend": "auto",
        "device": "auto",
        "timeout_s": 300,
    }


def test_fields_match_api_keys():
    assert {f.name for f in dataclasses.fields(Config)} == ALL_KEYS
    assert set(build_config(None).to_dict()) == ALL_KEYS


def test_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        build_config(None).microbatches = 4


def test_to_dict_is_plain_copy():
    c = build_config({"microbatches": 3})
    d = c.to_dict()
    assert type(d) is dict
    d["microbatches"] = 99
    assert c.microbatches == 3


@pytest.mark.parametrize(("pp", "mb", "expected"), [(1, 1, 1), (1, 8, 3), (2, 8, 4), (4, 3, 3)])
def test_active_microbatches_default(pp, mb, expected):
    c = build_config({"pipeline_parallel_degree": pp, "microbatches": mb})
    assert c.active_microbatches == expected


@pytest.mark.parametrize(("pp", "mb", "expected"), [(1, 1, 1), (2, 8, 2), (4, 3, 3)])
def test_deferred_weight_microbatches_default(pp, mb, expected):
    c = build_config({"pipeline_parallel_degree": pp, "microbatches": mb})
    assert c.deferred_weight_microbatches == expected


def test_deferred_weight_microbatches_explicit_and_invalid():
    c = build_config({"microbatches": 4, "deferred_weight_microbatches": 0})
    assert c.deferred_weight_microbatches == 0
    for bad in (-1, 5, 1.5, True, "2"):
        expect_error(
            {"microbatches": 4, "deferred_weight_microbatches": bad},
            "deferred_weight_microbatches",
            "[0, microbatches=4]",
        )


def test_active_microbatches_explicit():
    assert build_config({"microbatches": 8, "active_microbatches": 8}).active_microbatches == 8
    assert build_config({"microbatches": 8, "active_microbatches": None}).active_microbatches == 3


@pytest.mark.parametrize(("optimize", "weight"), [("speed", 0.2), ("memory", 0.8)])
def test_memory_weight_default(optimize, weight):
    assert build_config({"optimize": optimize}).memory_weight == weight


@pytest.mark.parametrize("weight", [0, 1, 0.5, 1.0])
def test_memory_weight_explicit(weight):
    c = build_config({"optimize": "memory", "memory_weight": weight})
    assert c.memory_weight == weight and isinstance(c.memory_weight, float)


def test_values_kept():
    user = {
        "pipeline_parallel_degree": 2,
        "tensor_parallel_degree": 4,
        "microbatches": 16,
        "pipeline": "simple",
        "backend": "gloo",
        "timeout_s": 2.5,
        "bf16": True,
        "auto_partition": False,
        "default_partition": 1,
        "tensor_parallel_seed": 7,
    }
    d = build_config(user).to_dict()
    assert {k: d[k] for k in user} == user


# --- alias ------------------------------------------------------------------------------------


def test_alias_partitions():
    assert build_config({"partitions": 4}).pipeline_parallel_degree == 4
    c = build_config({"partitions": 2, "pipeline_parallel_degree": 2})
    assert c.pipeline_parallel_degree == 2
    assert "partitions" not in c.to_dict()


def test_alias_conflict():
    expect_error(
        {"partitions": 2, "pipeline_parallel_degree": 4},
        "pipeline_parallel_degree=4",
        "partitions=2",
    )
    expect_error(
        {"pipeline_parallel_degree": 4, "partitions": 2},
        "pipeline_parallel_degree=4",
        "partitions=2",
    )


def test_alias_validated():
    expect_error({"partitions": 0}, '"pipeline_parallel_degree"', "got 0")


# --- unknown keys -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("typo", "suggestion"),
    [
        ("microbatch", "microbatches"),
        ("pipeline_parallel_degre", "pipeline_parallel_degree"),
        ("tensor_paralel_degree", "tensor_parallel_degree"),
        ("partition", "partitions"),
        ("fp61", "fp16"),
    ],
)
def test_did_you_mean(typo, suggestion):
    expect_error({typo: 1}, repr(typo), "did you mean", f'"{suggestion}"')


def test_unknown_key_lists_known_keys():
    message = expect_error({"zzzzqqq": 1}, "'zzzzqqq'", "known keys")
    assert all(key in message for key in ALL_KEYS | {"partitions"})
    assert "did you mean" not in message


def test_non_string_key():
    expect_error({3: 1}, "unknown key 3", "known keys")


# --- container --------------------------------------------------------------------------------


@pytest.mark.parametrize("user", [[("microbatches", 2)], "microbatches=2", 5])
def test_non_dict_rejected(user):
    expect_error(user, type(user).__name__, repr(user))


def test_input_not_mutated():
    user = {"partitions": 2, "microbatches": 4, "optimize": "memory"}
    before = copy.deepcopy(user)
    build_config(user, world_size=4)
    assert user == before


def test_input_not_mutated_on_error():
    user = {"partitions": 2, "microbatches": 0}
    before = copy.deepcopy(user)
    with pytest.raises(ValueError):
        build_config(user)
    assert user == before


# --- types and ranges -------------------------------------------------------------------------


@pytest.mark.parametrize("key", BOOL_KEYS)
@pytest.mark.parametrize("bad", [0, 1, "True", None])
def test_bool_keys_need_bool(key, bad):
    expect_error({key: bad}, f'"{key}"', "bool", f"got {bad!r}")


@pytest.mark.parametrize(
    "key",
    [
        "pipeline_parallel_degree",
        "tensor_parallel_degree",
        "microbatches",
        "active_microbatches",
        "activation_loading_horizon",
    ],
)
@pytest.mark.parametrize("bad", [0, -1, True, 2.0, "2"])
def test_positive_int_keys(key, bad):
    expect_error({key: bad}, f'"{key}"', "int", f"got {bad!r}")


def test_microbatches_message_format():
    assert (
        expect_error({"microbatches": 0}) == 'smp config: "microbatches" must be an int >= 1, got 0'
    )


@pytest.mark.parametrize("bad", [-1, True, 1.5, "0"])
def test_tensor_parallel_seed(bad):
    expect_error({"tensor_parallel_seed": bad}, '"tensor_parallel_seed"', f"got {bad!r}")


def test_tensor_parallel_seed_large():
    assert build_config({"tensor_parallel_seed": 2**40}).tensor_parallel_seed == 2**40


def test_default_partition_range():
    assert build_config({"partitions": 3, "default_partition": 2}).default_partition == 2
    expect_error(
        {"partitions": 3, "default_partition": 3}, '"default_partition"', "got 3", "[0, 3)"
    )
    expect_error({"default_partition": -1}, '"default_partition"', "got -1")
    expect_error({"default_partition": 1}, '"default_partition"', "got 1", "[0, 1)")
    expect_error({"default_partition": True}, '"default_partition"', "got True")


def test_active_microbatches_above_microbatches():
    expect_error(
        {"microbatches": 4, "active_microbatches": 5},
        '"active_microbatches"',
        "got 5",
        "microbatches=4",
    )


@pytest.mark.parametrize("bad", [-0.1, 1.5, True, "0.5"])
def test_memory_weight_bad(bad):
    expect_error({"memory_weight": bad}, '"memory_weight"', "[0, 1]", f"got {bad!r}")


@pytest.mark.parametrize("good", [1, 0.5, 3600])
def test_timeout_good(good):
    assert build_config({"timeout_s": good}).timeout_s == good


@pytest.mark.parametrize("bad", [0, -5, float("inf"), float("nan"), True, "300", None])
def test_timeout_bad(bad):
    expect_error({"timeout_s": bad}, '"timeout_s"', "positive", f"got {bad!r}")


@pytest.mark.parametrize(
    ("key", "good", "bad"),
    [
        ("pipeline", ["interleaved", "simple", "static"], ["Simple", "1f1b", 1]),
        ("optimize", ["speed", "memory"], ["fast", None]),
        ("backend", ["auto", "gloo", "nccl"], ["mpi", "NCCL"]),
        ("device", ["auto", "cpu", "cuda"], ["gpu", "cuda:0", None]),
    ],
)
def test_enums(key, good, bad):
    for value in good:
        assert getattr(build_config({key: value}), key) == value
    for value in bad:
        message = expect_error({key: value}, f'"{key}"', f"got {value!r}")
        assert all(repr(v) in message for v in good)


def test_cpu_device_needs_gloo():
    assert build_config({"device": "cpu", "backend": "gloo"}).device == "cpu"
    expect_error({"device": "cpu", "backend": "nccl"}, '"device" is "cpu"', '"backend": "gloo"')


def test_pipeline_schedule_orders_the_static_pipeline_only():
    assert build_config({"pipeline": "static"}).pipeline_schedule == "zbh1"
    for schedule in ("zbh1", "1f1b", "gpipe"):
        config = build_config({"pipeline": "static", "pipeline_schedule": schedule})
        assert config.pipeline_schedule == schedule
    expect_error(
        {"pipeline": "static", "pipeline_schedule": "ZB"}, '"pipeline_schedule"', "got 'ZB'"
    )
    expect_error({"pipeline_schedule": "1f1b"}, '"pipeline_schedule"', '"pipeline": "static"')


# --- placement --------------------------------------------------------------------------------


@pytest.mark.parametrize("order", ["".join(p) for p in itertools.permutations("DPT")])
def test_placement_permutations(order):
    c = build_config({"placement_strategy": order})
    assert c.placement_strategy == order and c.placement_order == order


def test_placement_named():
    assert build_config(None).placement_order == "DPT"
    assert build_config({"placement_strategy": "spread"}).placement_order == "TPD"


@pytest.mark.parametrize("bad", ["dpt", "DDP", "DP", "DPTT", "DPX", "", "Cluster", None, 3])
def test_placement_bad(bad):
    expect_error({"placement_strategy": bad}, '"placement_strategy"', "D, P, T", f"got {bad!r}")


# --- cross-key rules --------------------------------------------------------------------------


def test_fp16_and_bf16():
    build_config({"fp16": True})
    build_config({"bf16": True})
    expect_error({"fp16": True, "bf16": True}, '"fp16"', '"bf16"', "True")


def test_auto_partition_false():
    c = build_config({"partitions": 2, "auto_partition": False, "default_partition": 1})
    assert not c.auto_partition and c.default_partition == 1


# --- world size -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("pp", "tp", "world"), [(1, 1, 1), (1, 1, 7), (2, 2, 4), (2, 2, 8), (2, 3, 12)]
)
def test_world_size_ok(pp, tp, world):
    build_config({"pipeline_parallel_degree": pp, "tensor_parallel_degree": tp}, world)


def test_world_size_not_divisible():
    expect_error(
        {"pipeline_parallel_degree": 2, "tensor_parallel_degree": 3},
        "world size 8",
        "pipeline_parallel_degree",
        "(2)",
        "tensor_parallel_degree",
        "(3)",
        "= 6",
        "multiple of 6",
        "change the degrees",
        world_size=8,
    )


def test_world_size_smaller_than_model():
    expect_error({"pipeline_parallel_degree": 4}, "world size 2", "multiple of 4", world_size=2)


def test_ddp_false_needs_exact_world():
    build_config({"partitions": 2, "ddp": False}, world_size=2)
    expect_error(
        {"partitions": 2, "ddp": False}, '"ddp"', "world size 4", "got False", world_size=4
    )


@pytest.mark.parametrize("bad", [0, -2, True, 2.0, "4"])
def test_world_size_bad(bad):
    expect_error(None, "world size", f"got {bad!r}", world_size=bad)


# ---- where smp.init() finds the configuration ----------------------------------------------------


def test_an_explicit_dict_wins_over_the_environment():
    from smp.config import config_source

    env = {"SM_HP_MP_PARAMETERS": '{"partitions": 2}', "SMP_CONFIG": '{"microbatches": 2}'}
    config, source, unused = config_source({"microbatches": 4}, env)
    assert config == {"microbatches": 4} and source == "the dict given to smp.init()"
    assert unused == ["SMP_CONFIG", "SM_HP_MP_PARAMETERS"]
    assert config_source({}, {})[0] == {}


def test_smp_config_then_the_sagemaker_variable_then_defaults(tmp_path):
    from smp.config import config_source

    env = {"SM_HP_MP_PARAMETERS": '{"partitions": 2, "microbatches": 4}'}
    config, source, unused = config_source(None, env)
    assert config == {"partitions": 2, "microbatches": 4}
    assert source == "environment variable SM_HP_MP_PARAMETERS" and unused == []
    env["SMP_CONFIG"] = ' {"microbatches": 8} '
    config, source, unused = config_source(None, env)
    assert config == {"microbatches": 8} and unused == ["SM_HP_MP_PARAMETERS"]
    path = tmp_path / "smp.json"
    path.write_text('{"pipeline_parallel_degree": 2}')
    config, source, _ = config_source(None, {"SMP_CONFIG": str(path)})
    assert config == {"pipeline_parallel_degree": 2} and str(path) in source
    config, source, _ = config_source(None, {"SMP_CONFIG": "  "})
    assert config is None and source.startswith("defaults")


@pytest.mark.parametrize(
    "env,words",
    [
        ({"SM_HP_MP_PARAMETERS": "{partitions: 2}"}, ["SM_HP_MP_PARAMETERS", "not valid JSON"]),
        ({"SM_HP_MP_PARAMETERS": "[2]"}, ["must hold a JSON object", "list [2]"]),
        ({"SMP_CONFIG": "/no/such/file.json"}, ["SMP_CONFIG='/no/such/file.json'", "readable"]),
    ],
)
def test_a_bad_variable_is_named(env, words):
    from smp.config import config_source

    with pytest.raises(ValueError) as info:
        config_source(None, env)
    for word in words:
        assert word in str(info.value), (word, str(info.value))


# ---- SMP v1 keys ---------------------------------------------------------------------------------

# Every key SMP v1 accepts that is not an smp key, with its v1 default (docs/guide.md §2).
V1_ONLY = {
    "fp16_params": False,
    "ddp_port": 29760,
    "ddp_dist_backend": "auto",
    "horovod": False,
    "contiguous": True,
    "deterministic_server": False,
    "static_mode": False,
    "fast_mode": False,
    "checkpoint_attentions": False,
    "sdp_reduce_bucket_size": 5e8,
    "sdp_param_persistence_threshold": 1e6,
    "sdp_max_live_parameters": 1e9,
    "sdp_hierarchical_allgather": True,
    "sdp_gradient_clipping": 1.0,
    "task_level_activation_loading_horizon": 4,
    "_shard_offloaded_activations": True,
    "_fp32_grad_accumulation": False,
    "_match_weights": False,
    "_sharded_data_parallelism_config": None,
    "herring": False,
    "load_partition": False,
    "partition_file": None,
}


@pytest.mark.parametrize("key,value", sorted(V1_ONLY.items()))
def test_every_smp_v1_key_is_accepted_and_says_what_smp_does(key, value):
    from smp.config import v1_notes

    config = build_config({"partitions": 2, "microbatches": 2, key: value})
    assert config.pipeline_parallel_degree == 2
    (note,) = v1_notes({key: value})
    assert f'"{key}"' in note


def test_the_keys_of_a_v1_gpt2_script_are_accepted():
    """The smp_options of SMP v1's train_gpt_simple.py example, as SageMaker passes them."""
    v1 = {
        "ddp": True, "tensor_parallel_degree": 1, "pipeline_parallel_degree": 2,
        "microbatches": 4, "placement_strategy": "cluster", "optimize": "speed",
        "prescaled_batch": False, "fp16_params": False, "shard_optimizer_state": False,
        "offload_activations": False, "delayed_parameter_initialization": False,
        "activation_loading_horizon": 4, "skip_tracing": False, "static_mode": False,
        "fast_mode": False, "sharded_data_parallel_degree": 1, "sdp_reduce_bucket_size": 5e8,
        "sdp_param_persistence_threshold": 1e6, "sdp_max_live_parameters": 1e9,
        "sdp_hierarchical_allgather": True, "sdp_gradient_clipping": 1.0, "auto_partition": True,
        "default_partition": 0, "bf16": False,
    }  # fmt: skip
    config = build_config(v1, world_size=4)
    assert (config.pipeline_parallel_degree, config.fp16) == (2, False)


def test_fp16_params_is_read_as_fp16():
    assert build_config({"fp16_params": True}).fp16 is True
    assert build_config({"fp16_params": True, "fp16": True}).fp16 is True
    with pytest.raises(ValueError, match='"fp16_params" \\(False\\) must agree'):
        build_config({"fp16": True, "fp16_params": False})


@pytest.mark.parametrize(
    "user,words",
    [
        ({"checkpoint_attentions": True}, "activation checkpointing is not built yet"),
    ],
)
def test_v1_keys_that_ask_for_what_is_not_built_fail(user, words):
    with pytest.raises(NotImplementedError, match=words):
        build_config(user)


def test_sharded_data_parallelism_checks():
    build_config({"sharded_data_parallel_degree": 2}, world_size=4)
    build_config({"sharded_data_parallel_degree": 2, "tensor_parallel_degree": 2}, world_size=8)
    expect_error({"sharded_data_parallel_degree": 0}, '"sharded_data_parallel_degree"', "0")
    expect_error(
        {"sharded_data_parallel_degree": 4, "tensor_parallel_degree": 2},
        '"sharded_data_parallel_degree" (4) must divide',
        "= 2",
        world_size=4,
    )
    expect_error(
        {"sharded_data_parallel_degree": 2, "shard_optimizer_state": True},
        'drop "shard_optimizer_state"',
    )
    for other, words in (
        ({"pipeline_parallel_degree": 2}, "pipeline_parallel_degree"),
        ({"fp16": True}, '"fp16" with "sharded_data_parallel_degree" \\(2\\) is not built'),
    ):
        with pytest.raises(NotImplementedError, match=words):
            build_config({"sharded_data_parallel_degree": 2, **other})


@pytest.mark.parametrize(
    "user", [{"horovod": "yes"}, {"ddp_port": 1.5}, {"sdp_gradient_clipping": True}]
)
def test_v1_keys_are_type_checked(user):
    (key,) = user
    with pytest.raises(ValueError, match=f'"{key}" must be a'):
        build_config(user)
