"""The smp configuration: the keys of ``smp.init(config)``, their defaults and their validation.

Pure Python (stdlib only), so it imports without torch and without the ``smp._C`` extension.
Every problem is reported as a ``ValueError`` that names the key, the value given and what is
allowed, e.g. ``smp config: "microbatches" must be an int >= 1, got 0``.
"""

import dataclasses
import difflib
import itertools
import json
import math
import os
from collections.abc import Mapping
from typing import Any

__all__ = ["Config", "build_config", "config_source", "v1_notes", "ENVIRONMENT_VARIABLES"]

# Where smp.init() without a dict finds the job's configuration, first match wins: smp's own
# launcher-neutral variable (a JSON object, or the path of a file holding one), then the one
# the SageMaker launcher sets for SMP v1 scripts (a JSON object).
ENVIRONMENT_VARIABLES = ("SMP_CONFIG", "SM_HP_MP_PARAMETERS")

_ALIASES = {"partitions": "pipeline_parallel_degree"}
_PIPELINES = ("interleaved", "simple", "static")
_SCHEDULES = ("zbh1", "1f1b", "gpipe")  # pipeline "static": generators of the schedule IR
_OPTIMIZE = ("speed", "memory")
_BACKENDS = ("auto", "gloo", "nccl")
_DEVICES = ("auto", "cpu", "cuda")
_NAMED_PLACEMENTS = {"cluster": "DPT", "spread": "TPD"}
_PERMUTATIONS = tuple("".join(p) for p in itertools.permutations("DPT"))


def _fail(key: str, allowed: str, value: Any) -> None:
    raise ValueError(f'smp config: "{key}" must be {allowed}, got {value!r}')


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_int(key: str, value: Any, low: int, high: int | None = None) -> None:
    """Requires ``low <= value`` (and ``value < high`` when given); bools are not ints here."""
    ok = _is_int(value) and value >= low and (high is None or value < high)
    if not ok:
        _fail(key, f"an int >= {low}" if high is None else f"an int in [{low}, {high})", value)


def _check_choice(key: str, value: Any, choices: tuple[str, ...]) -> None:
    if not (isinstance(value, str) and value in choices):
        _fail(key, "one of " + ", ".join(repr(c) for c in choices), value)


@dataclasses.dataclass(frozen=True)
class Config:
    """A validated smp configuration (api.md §1); build it with :func:`build_config`.

    Constructing it directly validates too. ``active_microbatches`` and ``memory_weight`` may be
    given as None and are then resolved to their derived defaults, so they are never None after
    construction.
    """

    pipeline_parallel_degree: int = 1
    """Pipeline stages the model is split over (alias ``partitions``)."""
    tensor_parallel_degree: int = 1
    """Ranks a distributed module is split over."""
    microbatches: int = 1
    """The batch given to a step function is split into this many microbatches."""
    pipeline: str = "interleaved"
    """``"interleaved"``: backward of a ready microbatch first (1F1B-like); ``"simple"``: all
    forwards, then all backwards; ``"static"``: every stage orders its work by its program in
    the schedule ``pipeline_schedule`` (design.md §4.5)."""
    pipeline_schedule: str | None = None
    """With ``pipeline: "static"``: ``"zbh1"`` (default; zero-bubble H1, weight gradients
    apart on the later stages), ``"1f1b"`` or ``"gpipe"``."""
    pipeline_async_calls: bool = True
    """A call of the step function to a module on another stage returns at once with futures
    when the module's output structure is known from an earlier call (design.md §4.3)."""
    active_microbatches: int | None = None
    """Most microbatches in flight at once; None means ``min(pp + 2, microbatches)``."""
    deferred_weight_microbatches: int | None = None
    """Stages other than the first compute a served call's input gradients first and its weight
    gradients when idle (a zero-bubble split, design.md §4.4), for at most this many
    microbatches at once; 0 turns the split off. None means ``min(pp, microbatches)``."""
    optimize: str = "speed"
    """TP layout and partition weighting: ``"speed"`` (Megatron-style) or ``"memory"``."""
    memory_weight: float | None = None
    """Weight of memory against compute in the partition cost, in [0, 1]; None means 0.2 when
    ``optimize == "speed"``, else 0.8."""
    auto_partition: bool = True
    """Let the partitioner place modules; False places them by ``default_partition``."""
    default_partition: int = 0
    """Partition of modules outside any ``smp.partition`` context when not auto-partitioning."""
    placement_strategy: str = "cluster"
    """Rank placement: ``"cluster"`` (= DPT), ``"spread"`` (= TPD), or a permutation of D, P, T
    (right-most letter varies fastest)."""
    ddp: bool = True
    """Data parallelism over the ranks left after pp x tp."""
    overlapping_allreduce: bool = True
    """Reduce gradient buckets during the step's last backward, as they become final (with
    ``DistributedModel(overlapping_allreduce=...)``: both must be True; under pipeline parallelism
    per stage, from the second step on); False reduces them after the step."""
    prescaled_batch: bool = False
    """All ranks of a TP group receive the same batch (Megatron semantics)."""
    shard_optimizer_state: bool = False
    """Shard optimizer state across the data-parallel ranks holding the same parameters."""
    sharded_data_parallel_degree: int = 1
    """Shard parameters, gradients and optimizer state over this many of the data-parallel ranks
    holding the same parameters (FSDP2); it divides their number, and the sharding groups
    replicate one another beyond it (design.md §7.5)."""
    offload_activations: bool = False
    """Move checkpointed activations to host memory, bring them back before backward."""
    activation_loading_horizon: int = 4
    """How many offloaded activations may be resident ahead of their use."""
    fp16: bool = False
    """fp16 mixed precision (excludes ``bf16``)."""
    bf16: bool = False
    """bf16 mixed precision (excludes ``fp16``)."""
    tensor_parallel_seed: int = 0
    """Seed of random ops inside TP modules."""
    delayed_parameter_initialization: bool = False
    """Allocate parameters only on the rank that owns them, after partitioning."""
    skip_tracing: bool = False
    """Partition without the tracing pass (heuristic costs)."""
    backend: str = "auto"
    """``"nccl"`` when CUDA is available, else ``"gloo"``, unless forced to one of them."""
    device: str = "auto"
    """Where each rank computes: ``"auto"`` is ``cuda:LOCAL_RANK`` with NCCL and the CPU with
    gloo; ``"cuda"`` is ``cuda:(LOCAL_RANK % GPUs)`` with either backend (gloo: several ranks
    may share a GPU, which NCCL refuses); ``"cpu"`` needs gloo."""
    timeout_s: float = 300
    """A collective or pipeline message waiting longer than this fails every rank."""

    def __post_init__(self) -> None:
        pp = self.pipeline_parallel_degree
        _check_int("pipeline_parallel_degree", pp, 1)
        _check_int("tensor_parallel_degree", self.tensor_parallel_degree, 1)
        _check_int("microbatches", self.microbatches, 1)
        _check_int("activation_loading_horizon", self.activation_loading_horizon, 1)
        _check_int("sharded_data_parallel_degree", self.sharded_data_parallel_degree, 1)
        _check_int("tensor_parallel_seed", self.tensor_parallel_seed, 0)
        _check_int("default_partition", self.default_partition, 0, pp)
        for f in dataclasses.fields(self):
            if f.type is bool and not isinstance(getattr(self, f.name), bool):
                _fail(f.name, "a bool (True or False)", getattr(self, f.name))
        _check_choice("pipeline", self.pipeline, _PIPELINES)
        schedule = self.pipeline_schedule
        if self.pipeline == "static":
            schedule = "zbh1" if schedule is None else schedule
            _check_choice("pipeline_schedule", schedule, _SCHEDULES)
        elif schedule is not None:
            raise ValueError(
                f'smp config: "pipeline_schedule" ({schedule!r}) orders the "static" pipeline '
                f'only; "pipeline" is {self.pipeline!r}. Set "pipeline": "static" or drop '
                '"pipeline_schedule".'
            )
        object.__setattr__(self, "pipeline_schedule", schedule)
        _check_choice("optimize", self.optimize, _OPTIMIZE)
        _check_choice("backend", self.backend, _BACKENDS)
        _check_choice("device", self.device, _DEVICES)
        if self.device == "cpu" and self.backend == "nccl":
            raise ValueError(
                'smp config: "device" is "cpu" but "backend" is "nccl", which carries CUDA '
                'tensors only; use "backend": "gloo" (or "auto") with the CPU'
            )
        placement = self.placement_strategy
        if not (
            isinstance(placement, str)
            and (placement in _NAMED_PLACEMENTS or placement in _PERMUTATIONS)
        ):
            _fail(
                "placement_strategy",
                '"cluster", "spread" or a permutation of the letters D, P, T (e.g. "PDT")',
                placement,
            )
        timeout = self.timeout_s
        if not (
            isinstance(timeout, int | float)
            and not isinstance(timeout, bool)
            and math.isfinite(timeout)
            and timeout > 0
        ):
            _fail("timeout_s", "a positive finite number of seconds", timeout)

        weight = self.memory_weight
        if weight is None:
            weight = 0.2 if self.optimize == "speed" else 0.8
        elif not (
            isinstance(weight, int | float) and not isinstance(weight, bool) and 0 <= weight <= 1
        ):
            _fail("memory_weight", "a number in [0, 1]", weight)
        object.__setattr__(self, "memory_weight", float(weight))

        active = self.active_microbatches
        if active is None:
            active = min(pp + 2, self.microbatches)
        elif not (_is_int(active) and 1 <= active <= self.microbatches):
            _fail("active_microbatches", f"an int in [1, microbatches={self.microbatches}]", active)
        object.__setattr__(self, "active_microbatches", active)

        deferred = self.deferred_weight_microbatches
        if deferred is None:
            deferred = min(pp, self.microbatches)
        elif not (_is_int(deferred) and 0 <= deferred <= self.microbatches):
            _fail(
                "deferred_weight_microbatches",
                f"an int in [0, microbatches={self.microbatches}]",
                deferred,
            )
        object.__setattr__(self, "deferred_weight_microbatches", deferred)

        if self.fp16 and self.bf16:
            raise ValueError(
                'smp config: "fp16" and "bf16" are mutually exclusive, '
                "got both True; enable at most one"
            )
        if self.sharded_data_parallel_degree > 1:
            self._check_sharded()

    def _check_sharded(self) -> None:
        sdp = self.sharded_data_parallel_degree
        if self.shard_optimizer_state:
            raise ValueError(
                f'smp config: "shard_optimizer_state" and "sharded_data_parallel_degree" ({sdp}) '
                "both shard the optimizer state; sharded data parallelism also shards "
                'parameters and gradients: drop "shard_optimizer_state"'
            )
        if self.pipeline_parallel_degree > 1:
            raise NotImplementedError(
                f'smp config: "sharded_data_parallel_degree" ({sdp}) with '
                f'"pipeline_parallel_degree" ({self.pipeline_parallel_degree}) is not built yet '
                "(as in SMP v1, sharded data parallelism composes with tensor and data "
                'parallelism); use "shard_optimizer_state" with pipeline parallelism, or '
                "pipeline_parallel_degree 1"
            )
        if self.fp16:
            raise NotImplementedError(
                f'smp config: "fp16" with "sharded_data_parallel_degree" ({sdp}) is not built '
                'yet (the loss scaler does not unscale sharded gradients); use "bf16", or fp32'
            )

    @property
    def placement_order(self) -> str:
        """The placement as a permutation of ``"DPT"`` (``"cluster"``/``"spread"`` resolved)."""
        return _NAMED_PLACEMENTS.get(self.placement_strategy, self.placement_strategy)

    def to_dict(self) -> dict[str, Any]:
        """Returns a plain dict with every field (derived defaults resolved)."""
        return dataclasses.asdict(self)


_KEYS = tuple(f.name for f in dataclasses.fields(Config))

# Keys SMP v1 accepts that are not smp keys (docs/guide.md §2, "SMP v1 keys"): key -> (type,
# what smp does instead). smp accepts each, checks its type, and logs the line on rank 0;
# ``_V1_UNBUILT`` are the values that ask for something smp has not built yet (they fail).
_V1_KEYS: dict[str, tuple[type | tuple[type, ...], str]] = {
    "fp16_params": (bool, 'deprecated in v1; read as "fp16"'),  # mapped, not ignored
    "ddp_port": (int, "the rendezvous uses the launcher's MASTER_ADDR and MASTER_PORT"),
    "ddp_dist_backend": (str, 'collectives use "backend": nccl with CUDA, gloo otherwise'),
    "horovod": (bool, "smp has no Horovod: data parallelism runs on torch.distributed"),
    "contiguous": (bool, "TensorFlow only; smp places modules, contiguous pieces of the tree"),
    "deterministic_server": (
        bool,
        "smp's task order is deterministic where it must be (tensor-parallel rank 0 orders "
        "its group's)",
    ),
    "static_mode": (
        bool,
        'calls to other stages skip their round trips once a call repeats ("pipeline_async_calls")',
    ),
    "fast_mode": (
        bool,
        'outputs go straight to the stage that takes them ("pipeline_async_calls")',
    ),
    "checkpoint_attentions": (bool, "activation checkpointing is not built yet"),
    "sdp_reduce_bucket_size": (
        (int, float),
        "FSDP2 reduces each sharded block's gradients in one reduce-scatter",
    ),
    "sdp_param_persistence_threshold": (
        (int, float),
        "every parameter is sharded, small ones included",
    ),
    "sdp_max_live_parameters": (
        (int, float),
        "one sharded block is gathered at a time (FSDP2 prefetches the next)",
    ),
    "sdp_hierarchical_allgather": (bool, "parameters are gathered over the sharding group"),
    "sdp_gradient_clipping": (
        (int, float),
        "call optimizer.clip_grad_norm_(max_norm) in the step instead",
    ),
    "task_level_activation_loading_horizon": (int, "v1-internal; no effect in smp"),
    "_shard_offloaded_activations": (bool, "v1-internal; no effect in smp"),
    "_fp32_grad_accumulation": (bool, "v1-internal; no effect in smp"),
    "_match_weights": (bool, "v1-internal; no effect in smp"),
    "_sharded_data_parallelism_config": ((str, type(None)), "v1-internal; no effect in smp"),
    "herring": (bool, "v1-internal; no effect in smp"),
    "load_partition": (bool, "TensorFlow only (v1-internal)"),
    "partition_file": ((str, type(None)), "TensorFlow only (v1-internal)"),
}
# Values that ask for something not built yet: they fail, naming it, instead of being ignored.
_V1_UNBUILT = {
    "checkpoint_attentions": lambda v: v is True,
}


def v1_notes(user: Mapping[str, Any] | None) -> list[str]:
    """One line per SMP v1 key in ``user`` that smp accepts without using it: what smp does
    instead (logged by ``smp.init`` on rank 0)."""
    notes = []
    for key in user or {}:
        if key == "fp16_params":
            notes.append('smp config: SMP v1 key "fp16_params" is deprecated; read as "fp16"')
        elif key in _V1_KEYS:
            notes.append(
                f'smp config: SMP v1 key "{key}"={user[key]!r} accepted, not used: '
                f"{_V1_KEYS[key][1]}"
            )
    return notes


def _take_v1_keys(user: Mapping[str, Any]) -> dict[str, Any]:
    """``user`` without the SMP v1 keys, ``fp16_params`` read as ``fp16``; checks their types
    and fails on the values that ask for what smp has not built."""
    for key, value in user.items():
        if key not in _V1_KEYS:
            continue
        kind, instead = _V1_KEYS[key]
        kinds = kind if isinstance(kind, tuple) else (kind,)
        if isinstance(value, bool) and bool not in kinds or not isinstance(value, kinds):
            names = " or ".join("None" if k is type(None) else k.__name__ for k in kinds)
            _fail(key, f"a {names} (an SMP v1 key)", value)
        if key in _V1_UNBUILT and _V1_UNBUILT[key](value):
            raise NotImplementedError(
                f'smp config: SMP v1 key "{key}"={value!r}: {instead} in this version of smp; '
                "drop the key or leave it at its default"
            )
    out = {k: v for k, v in user.items() if k not in _V1_KEYS}
    if "fp16_params" in user:
        if "fp16" in user and user["fp16"] != user["fp16_params"]:
            raise ValueError(
                f'smp config: "fp16" ({user["fp16"]!r}) and its deprecated SMP v1 alias '
                f'"fp16_params" ({user["fp16_params"]!r}) must agree; give only "fp16"'
            )
        out["fp16"] = user["fp16_params"]
    return out


def _unknown_key(key: Any) -> ValueError:
    message = f"smp config: unknown key {key!r}"
    if isinstance(key, str):
        close = difflib.get_close_matches(key, _KEYS + tuple(_ALIASES), n=3)
        if close:
            return ValueError(
                message + "; did you mean " + " or ".join(f'"{c}"' for c in close) + "?"
            )
    return ValueError(message + "; known keys: " + ", ".join(_KEYS + tuple(_ALIASES)))


def build_config(user: Mapping[str, Any] | None, world_size: int | None = None) -> Config:
    """Validates a user config dict and returns the resolved :class:`Config`.

    Args:
        user: The dict given to ``smp.init``; None or ``{}`` means all defaults. Not mutated.
        world_size: When given, also checks that the world divides into pp x tp model replicas
            and that data parallelism over the extra ranks is enabled.

    Returns:
        A frozen :class:`Config` with derived defaults resolved.

    SMP v1 keys smp does not use are accepted (their types checked; :func:`v1_notes` says what
    smp does instead); ``fp16_params`` is read as ``fp16``.

    Raises:
        ValueError: For an unknown key, a bad type or value, conflicting keys, or a world size
            the degrees do not fit. The message names the key, the value and what is allowed.
        NotImplementedError: An SMP v1 key set to use something smp has not built yet.
    """
    if user is None:
        user = {}
    if not isinstance(user, Mapping):
        raise ValueError(
            f"smp config: the config must be a dict or None, got {type(user).__name__} {user!r}"
        )
    kwargs: dict[str, Any] = {}
    for key in user:
        if key not in _KEYS and key not in _ALIASES and key not in _V1_KEYS:
            raise _unknown_key(key)
    user = _take_v1_keys(user)
    for alias, name in _ALIASES.items():
        if alias in user and name in user and user[alias] != user[name]:
            raise ValueError(
                f'smp config: "{name}" and its alias "{alias}" must agree, got '
                f"{name}={user[name]!r} and {alias}={user[alias]!r}; "
                "give only one of them"
            )
    for key, value in user.items():
        name = _ALIASES.get(key, key)
        if name not in kwargs or key == name:
            kwargs[name] = value
    config = Config(**kwargs)

    if world_size is not None:
        if not (_is_int(world_size) and world_size >= 1):
            raise ValueError(f"smp config: world size must be an int >= 1, got {world_size!r}")
        pp, tp = config.pipeline_parallel_degree, config.tensor_parallel_degree
        mp = pp * tp
        if world_size % mp:
            raise ValueError(
                f"smp config: world size {world_size} is not divisible by "
                f'"pipeline_parallel_degree" ({pp}) x "tensor_parallel_degree" ({tp}) = {mp}; '
                f"launch a multiple of {mp} processes or change the degrees"
            )
        if world_size > mp and not config.ddp:
            raise ValueError(
                f'smp config: "ddp" must be True when world size {world_size} exceeds '
                f"pipeline_parallel_degree x tensor_parallel_degree = {mp} (data parallelism "
                f"over the extra ranks), got False; set ddp=True or launch {mp} processes"
            )
        sdp, rdp = config.sharded_data_parallel_degree, world_size // mp
        if rdp % sdp:
            raise ValueError(
                f'smp config: "sharded_data_parallel_degree" ({sdp}) must divide the '
                f"data-parallel ranks holding the same parameters (world size {world_size} / "
                f"(pipeline x tensor parallel degree {mp}) = {rdp}); launch a multiple of "
                f"{mp * sdp} processes or pick a divisor of {rdp}"
            )
    return config


def config_source(
    config: Mapping[str, Any] | None, environ: Mapping[str, str] | None = None
) -> tuple[Any, str, list[str]]:
    """The configuration ``smp.init(config)`` uses, where it came from (for the log), and the
    variables of :data:`ENVIRONMENT_VARIABLES` that are set but not used (an explicit dict won).

    An explicit ``config`` (a dict, even ``{}``) wins. Without one, the first of
    :data:`ENVIRONMENT_VARIABLES` that is set and not empty is read: ``SMP_CONFIG`` holds a JSON
    object or the path of a JSON file, ``SM_HP_MP_PARAMETERS`` (set by the SageMaker launcher)
    a JSON object. Without either, every key takes its default.

    Raises:
        ValueError: a variable that is not a JSON object (or a path to one), naming it.
    """
    environ = os.environ if environ is None else environ
    present = [name for name in ENVIRONMENT_VARIABLES if environ.get(name, "").strip()]
    if config is not None:
        return config, "the dict given to smp.init()", present
    if not present:
        unset = " or ".join(ENVIRONMENT_VARIABLES)
        return None, f"defaults (no dict given to smp.init(), {unset} not set)", []
    name = present[0]
    text = environ[name].strip()
    where = f"environment variable {name}"
    if name == "SMP_CONFIG" and not text.startswith("{"):
        try:
            with open(text, encoding="utf-8") as f:
                text = f.read()
        except OSError as exc:
            raise ValueError(
                f"smp config: {name}={environ[name]!r} is neither a JSON object nor a readable "
                f"file ({exc.strerror}); set it to JSON such as "
                "'{\"pipeline_parallel_degree\": 2}' or to the path of a file holding it"
            ) from None
        where = f"file {environ[name].strip()!r} named by {name}"
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(
            f"smp config: {where} is not valid JSON ({exc.msg} at line {exc.lineno} column "
            f"{exc.colno}): {text[:200]!r}"
        ) from None
    if not isinstance(value, dict):
        raise ValueError(
            f"smp config: {where} must hold a JSON object of smp keys, got "
            f"{type(value).__name__} {value!r}"
        )
    return value, where, present[1:]
