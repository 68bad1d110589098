"""The partition plan: which stage owns each module (api.md §6).

The decision itself is made by the C++ core (``smp._C.partition``, include/smp/partition.h);
this module gathers what the core needs from a real ``nn.Module`` and its trace
(smp.partitioning.trace):

1. **Nodes**: modules sharing a parameter (transitively) become one node, attached at the lowest
   common ancestor of its members; a subtree that was never called is folded into its parent (it
   is placed with the parent and its parameters count there). Children are ordered by first call.
2. **Pins** (smp.partitioning.trace) are constraints of the core's algorithm.
3. **Crossings**: the bytes a cut would send, priced against compute (:class:`CrossingCosts`).

``plan_partition`` runs all of this in one process, so a user can try pp = 2/4/8 before launching.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import torch
from torch import nn

from smp import _C
from smp.config import build_config
from smp.memory import activations
from smp.partitioning.trace import ModuleTrace, _pin_of, trace_modules

__all__ = ["plan_partition", "PartitionPlan", "CrossingCosts", "StageLink", "build_plan"]

# ---- building the core's node tree -------------------------------------------------------------


def _own_parameters(module: nn.Module) -> list[nn.Parameter]:
    return [p for p in module._parameters.values() if p is not None]


class _UnionFind:
    def __init__(self, items):
        self.parent = {i: i for i in items}

    def find(self, x):
        while self.parent[x] != x:
            self.parent[x] = self.parent[self.parent[x]]
            x = self.parent[x]
        return x

    def union(self, a, b):
        ra, rb = self.find(a), self.find(b)
        if ra != rb:
            self.parent[ra] = rb


def _atomic(module: nn.Module) -> bool:
    """Whether ``module``'s forward must run whole on one stage: a tensor-parallel region
    (``_smp_atomic``) or a checkpointed module (its recompute runs in its owner's backward)."""
    return bool(getattr(module, "_smp_atomic", False)) or activations.is_checkpointed(module)


def _is_chain(module: nn.Module, children: list[nn.Module]) -> bool:
    """A chain of similar blocks: a ModuleList/Sequential, or three or more children of one type
    with equal parameter counts."""
    if len(children) < 2:
        return False
    if isinstance(module, (nn.ModuleList, nn.Sequential)):
        return True
    if len(children) < 3:
        return False
    first = children[0]
    size = sum(p.numel() for p in first.parameters())
    return all(
        type(c) is type(first) and sum(p.numel() for p in c.parameters()) == size for c in children
    )


@dataclasses.dataclass
class _Node:
    name: str  # representative path
    members: list[str]  # module paths merged into this node
    parent: int
    compute: float
    param_bytes: float
    activation_bytes: float
    pin: int
    chain: bool


def _build_nodes(
    module: nn.Module,
    traces: dict[str, ModuleTrace] | None,
    use_time: bool,
    default_pin: int | None,
) -> tuple[list[_Node], dict[str, int]]:
    """The core's node list (parents first, siblings in first-call order) and {path: node index}."""
    modules = dict(module.named_modules())
    paths = list(modules)
    children_of: dict[str, list[str]] = {p: [] for p in paths}
    parent_of: dict[str, str | None] = {"": None}
    for path in paths:
        for child_name, _ in modules[path].named_children():
            child_path = f"{path}.{child_name}" if path else child_name
            if child_path in modules and child_path not in parent_of:
                parent_of[child_path] = path
                children_of[path].append(child_path)

    # Resolved pins: a module's own pin, else its parent's (innermost wins).
    pins: dict[str, int] = {}
    for path in paths:  # named_modules is pre-order: parents first
        own = _pin_of(modules[path])
        inherited = pins.get(parent_of[path]) if parent_of[path] is not None else None
        pin = own if own is not None else inherited
        if pin is None:
            pin = default_pin
        if pin is not None:
            pins[path] = pin

    # First-call order of a subtree (min over it); None if nothing in it ran.
    order: dict[str, float | None] = {}
    position = {path: i for i, path in enumerate(paths)}
    for path in reversed(paths):
        own = traces[path].first_call if traces else position[path]
        candidates = [o for o in [own, *(order[c] for c in children_of[path])] if o is not None]
        order[path] = min(candidates) if candidates else None
    order[""] = -1

    # Never-called subtrees fold into their nearest called ancestor, and everything inside an
    # atomic module (a tensor-parallel region, or a checkpointed module: their forward must
    # run whole on one stage) into that module.
    home: dict[str, str] = {}
    inside_atomic: dict[str, bool] = {}
    for path in paths:
        parent = parent_of[path]
        if parent is None:
            home[path] = path
        elif order[path] is None or inside_atomic[parent]:
            home[path] = home[parent]
        else:
            home[path] = path
        inside_atomic[path] = (parent is not None and inside_atomic[parent]) or _atomic(
            modules[path]
        )

    # Shared parameters merge their owners (transitively).
    uf = _UnionFind([p for p in paths if home[p] == p])
    owner_of_param: dict[int, str] = {}
    for path in paths:
        for param in _own_parameters(modules[path]):
            owner = home[path]
            if id(param) in owner_of_param:
                uf.union(owner_of_param[id(param)], owner)
            else:
                owner_of_param[id(param)] = owner

    def cost_of(path: str) -> tuple[float, float]:
        if traces is None:
            return 1.0, 0.0  # skip_tracing: module counts stand for compute
        record = traces[path]
        return (record.seconds if use_time else record.flops), float(record.output_bytes)

    groups: dict[str, list[str]] = {}
    for path in paths:
        groups.setdefault(uf.find(home[path]), []).append(path)

    # Attach each merged node at the lowest common ancestor of its members' parents.
    def ancestors(path: str) -> list[str]:
        chain = []
        p: str | None = path
        while p is not None:
            chain.append(p)
            p = parent_of[p]
        return chain

    def representative(path: str) -> str:
        return uf.find(home[path])

    # A merged node hangs below the lowest common ancestor of its members (outside the group).
    root_rep = representative("")
    node_parent: dict[str, str | None] = {root_rep: None}
    for rep, members in groups.items():
        if rep == root_rep:
            continue
        common: list[str] | None = None
        for head in (m for m in members if home[m] == m):
            up = ancestors(parent_of[head]) if parent_of[head] is not None else [""]
            common = up if common is None else [a for a in common if a in set(up)]
        anchor = next((a for a in common or [] if representative(a) != rep), "")
        node_parent[rep] = representative(anchor)

    # Order: parents before children, siblings by first call (pre-order walk).
    node_children: dict[str, list[str]] = {rep: [] for rep in groups}
    for rep, parent in node_parent.items():
        if parent is not None:
            node_children[parent].append(rep)
    for reps in node_children.values():
        reps.sort(key=lambda r: (min(order[m] for m in groups[r] if order[m] is not None), r))

    # Merges across subtrees can, in contrived models, make a group hang below its own
    # descendant; anything the walk from the root cannot reach is attached to the root.
    reachable, frontier = {root_rep}, [root_rep]
    while frontier:
        for child in node_children[frontier.pop()]:
            if child not in reachable:
                reachable.add(child)
                frontier.append(child)
    for rep in groups:
        if rep not in reachable:
            node_children[node_parent[rep]].remove(rep)
            node_children[root_rep].append(rep)

    nodes: list[_Node] = []
    index_of: dict[str, int] = {}
    walk = [(root_rep, -1)]
    while walk:
        rep, parent_index = walk.pop()
        members = groups[rep]
        compute = activation = 0.0
        param_bytes = 0.0
        seen_params: set[int] = set()
        for member in members:
            c, a = cost_of(member)
            compute += c
            activation += a
            for param in _own_parameters(modules[member]):
                if id(param) not in seen_params:
                    seen_params.add(id(param))
                    param_bytes += param.numel() * param.element_size()
        member_pins = {pins[m] for m in members if m in pins}
        head = min((m for m in members if home[m] == m), key=lambda m: (m.count("."), m))
        pin = pins.get(head, next(iter(member_pins)) if member_pins else -1)
        child_modules = [modules[c] for c in children_of[head] if home[c] == c]
        index_of[rep] = len(nodes)
        nodes.append(
            _Node(
                name=" + ".join(
                    m or "<root>" for m in sorted(members, key=position.__getitem__)[:4]
                ),
                members=members,
                parent=parent_index,
                compute=compute,
                param_bytes=param_bytes,
                activation_bytes=activation,
                pin=pin,
                chain=_is_chain(modules[head], child_modules),
            )
        )
        for child in reversed(node_children[rep]):
            walk.append((child, index_of[rep]))
    node_of_path = {path: index_of[representative(path)] for path in paths}
    return nodes, node_of_path


def _core_nodes(nodes: list, pins: list[int]) -> list[_C.PartitionNode]:
    """The core's nodes for ``nodes``, node i pinned to ``pins[i]`` (-1: free)."""
    return [
        _C.PartitionNode(
            name=n.name,
            parent=n.parent,
            compute=n.compute,
            param_bytes=n.param_bytes,
            activation_bytes=n.activation_bytes,
            pin=pin,
            chain=n.chain,
        )
        for n, pin in zip(nodes, pins)
    ]


def _core_calls(
    traces: dict[str, ModuleTrace] | None, node_of_path: dict[str, int]
) -> list[_C.PartitionCall]:
    """The core's calls between nodes (caller -1: the step function), from the traced callers;
    calls inside one node drop out."""
    if traces is None:
        return []
    edges: dict[tuple[int, int], list[float]] = {}
    for path, record in traces.items():
        callee = node_of_path[path]
        for caller_path, call in record.callers.items():
            caller = -1 if caller_path is None else node_of_path[caller_path]
            if caller == callee:
                continue
            sums = edges.setdefault((caller, callee), [0.0, 0.0, 0.0])
            sums[0] += call.calls
            sums[1] += call.input_bytes + call.output_bytes
            sums[2] += call.input_grad_bytes + call.output_grad_bytes
    return [
        _C.PartitionCall(
            caller=caller,
            callee=callee,
            calls=calls,
            forward_bytes=forward_bytes,
            backward_bytes=backward_bytes,
        )
        for (caller, callee), (calls, forward_bytes, backward_bytes) in sorted(edges.items())
    ]


# ---- crossings ----------------------------------------------------------------------------------

# Forward FLOP rates that turn traced FLOPs into seconds, to weigh crossings against compute.
# CPU: measured on the development machine with one thread (unmodified HF Llama, hidden 256-1024,
# 4 x 64-128 tokens: 69-74 GFLOP/s); a stage with more threads computes faster, so its crossings
# weigh more than priced here (pass CrossingCosts(flops_per_second=...) to say so).
# Accelerators: assumed, not measured (no GPU on the development machine): 100 TFLOP/s.
_CPU_FLOPS_PER_SECOND = 7e10
_ACCELERATOR_FLOPS_PER_SECOND = 1e14


@dataclasses.dataclass(frozen=True)
class CrossingCosts:
    """What a call between stages costs, for the partitioner (design.md §3).

    A call to a module on another stage is a crossing: a round trip in forward (arguments out,
    outputs back) and another in backward (their gradients). The latency and bandwidth are
    measured on the development machine (benchmarks/README.md, design.md §3): a synchronous
    round trip of smp's runtime over gloo (a call whose output is read at once) took
    1.2-1.6 ms, and gloo moved 16-64 MiB tensors between two processes at 1.6-2.8 GB/s.

    Attributes:
        latency_s: seconds per round trip.
        bandwidth: bytes per second between two stages.
        flops_per_second: turns traced FLOPs into seconds; None: 70 GFLOP/s for a model on the
            CPU, 100 TFLOP/s on an accelerator (a model on the meta device counts as on the
            accelerator when CUDA is available). Unused with measured times.
        balance_tolerance: how far above the best whole-module balance a plan's largest stage
            cost may go to save crossings.
        priced: False reports crossings without letting them steer the plan.
    """

    latency_s: float = 1.5e-3
    bandwidth: float = 2e9
    flops_per_second: float | None = None
    balance_tolerance: float = 0.1
    priced: bool = True


def _seconds_per_compute(
    module: nn.Module, costs: CrossingCosts, traced: bool, use_time: bool
) -> float:
    if not costs.priced or not traced:
        return 0.0
    if use_time:
        return 1.0
    rate = costs.flops_per_second
    if rate is None:
        tensor = next(iter(module.parameters()), None)
        if tensor is None:
            tensor = next(iter(module.buffers()), None)
        device = "cpu" if tensor is None else tensor.device.type
        if device == "meta":  # not placed yet: it will run on the accelerator if there is one
            device = "cuda" if torch.cuda.is_available() else "cpu"
        rate = _CPU_FLOPS_PER_SECOND if device == "cpu" else _ACCELERATOR_FLOPS_PER_SECOND
    if not rate > 0:
        raise ValueError(f"CrossingCosts.flops_per_second must be > 0, got {rate!r}")
    return 1.0 / rate


# ---- the plan -----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class StageLink:
    """The crossings of a plan between two stages, per microbatch.

    Attributes:
        stages: (first, second), first < second.
        calls: crossing calls; each is a round trip in forward and another in backward.
        forward_bytes: arguments out and outputs back, in forward.
        backward_bytes: their gradients, in backward.
        seconds: estimated time of these crossings, forward + backward.
    """

    stages: tuple[int, int]
    calls: float
    forward_bytes: float
    backward_bytes: float
    seconds: float


class PartitionPlan:
    """Where every module runs, and what each stage holds.

    Attributes:
        num_stages: the pipeline degree the plan is for.
        assignment: {module path: stage} for every module ("" is the root module).
        stage_cost: normalised cost per stage (sums to 1).
        stage_param_bytes, stage_activation_bytes, stage_compute: per-stage sums.
        imbalance: max / mean of stage_cost (1.0 is perfect balance).
        stage_crossing_cost: per stage, the cost of the crossings it takes part in, on the scale
            of stage_cost (0 when crossings are unpriced).
        max_stage_load: the largest stage_cost + stage_crossing_cost, which the plan minimises.
        links: a :class:`StageLink` per pair of stages with crossings between them.
        crossings_priced: whether crossings steered the plan (see :class:`CrossingCosts`).
    """

    def __init__(
        self,
        module: nn.Module,
        nodes: list[_Node],
        node_of_path,
        core_plan,
        cost_unit,
        crossings_priced: bool = False,
    ):
        self.num_stages = len(core_plan.stage_cost)
        self.assignment = {path: core_plan.stage[i] for path, i in node_of_path.items()}
        self.stage_cost = list(core_plan.stage_cost)
        self.stage_param_bytes = list(core_plan.stage_param_bytes)
        self.stage_activation_bytes = list(core_plan.stage_activation_bytes)
        self.stage_compute = list(core_plan.stage_compute)
        self.imbalance = float(core_plan.imbalance)
        self.stage_crossing_cost = list(core_plan.stage_crossing_cost)
        self.max_stage_load = float(core_plan.max_stage_load)
        self.links = [
            StageLink(
                stages=(link.first_stage, link.second_stage),
                calls=link.calls,
                forward_bytes=link.forward_bytes,
                backward_bytes=link.backward_bytes,
                seconds=link.seconds,
            )
            for link in core_plan.links
        ]
        self.crossings_priced = crossings_priced
        self.cost_unit = cost_unit
        # The core's nodes in execution (pre-)order, for analysis and benchmarks.
        self.node_names = [n.name for n in nodes]
        self.node_costs = list(core_plan.node_cost)
        self.node_stages = list(core_plan.stage)
        self.node_param_bytes = [n.param_bytes for n in nodes]
        self._children = {
            path: [f"{path}.{n}" if path else n for n, _ in m.named_children()]
            for path, m in module.named_modules()
        }
        self._node_of_path = dict(node_of_path)

    def stage_of(self, path: str) -> int:
        return self.assignment[path]

    def _whole_on(self, path: str, stage: int, memo: dict) -> bool:
        key = (path, stage)
        if key not in memo:
            memo[key] = self.assignment.get(path) == stage and all(
                self._whole_on(c, stage, memo)
                for c in self._children.get(path, [])
                if c in self.assignment
            )
        return memo[key]

    def stage_modules(self, stage: int) -> list[str]:
        """The modules of ``stage`` as whole subtrees, runs of numbered siblings collapsed
        (``h.0–h.5``); a module that runs here but has submodules elsewhere is marked (own)."""
        memo: dict = {}
        items: list[str] = []

        def visit(path: str) -> None:
            if self._whole_on(path, stage, memo):
                items.append(path or "<whole model>")
                return
            # A module split across stages is listed where its own work runs, if it has any.
            node = self._node_of_path.get(path)
            if self.assignment.get(path) == stage and self.node_costs[node] >= 1e-3:
                items.append(f"{path or '<root>'} (own)")
            for child in self._children.get(path, []):
                if child in self.assignment:
                    visit(child)

        visit("")
        return _collapse_numbered(items)

    def module_costs(self) -> dict[str, float]:
        """{module path: the module's own share of the model's cost (its submodules excluded)}."""
        return {path: self.node_costs[node] for path, node in self._node_of_path.items()}

    def report(self) -> str:
        """A table per stage (cost, crossing cost, compute share, parameter and activation bytes,
        modules), then the crossings per pair of stages, per microbatch."""
        total_compute = sum(self.stage_compute) or 1.0
        load = "priced" if self.crossings_priced else "not priced"
        lines = [
            f"smp partition: {self.num_stages} stages, imbalance {self.imbalance:.3f} "
            f"(max/mean cost), largest stage load {self.max_stage_load:.3f} "
            f"(cost + crossings, {load})",
            f"{'stage':>5}  {'cost':>6}  {'cross':>6}  {'compute':>7}  {'params':>10}  "
            f"{'activations':>11}  modules",
        ]
        for s in range(self.num_stages):
            modules = ", ".join(self.stage_modules(s)) or "-"
            lines.append(
                f"{s:>5}  {self.stage_cost[s]:>6.3f}  {self.stage_crossing_cost[s]:>6.3f}  "
                f"{self.stage_compute[s] / total_compute:>6.1%}  "
                f"{_human_bytes(self.stage_param_bytes[s]):>10}  "
                f"{_human_bytes(self.stage_activation_bytes[s]):>11}  {modules}"
            )
        if not self.links:
            lines.append("crossings per microbatch: none")
            return "\n".join(lines)
        lines.append(
            "crossings per microbatch (calls to a module on another stage; each is a round trip "
            "in forward and another in backward):"
        )
        for link in self.links:
            first, second = link.stages
            lines.append(
                f"  stages {first}-{second}: {link.calls:g} calls, forward "
                f"{_human_bytes(link.forward_bytes)}, backward "
                f"{_human_bytes(link.backward_bytes)}, ~{link.seconds * 1e3:.2f} ms"
            )
        return "\n".join(lines)

    def __repr__(self) -> str:
        return self.report()


def _human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


_NUMBERED = re.compile(r"^(.*\.)?(\d+)$")


def _collapse_numbered(items: list[str]) -> list[str]:
    """["h.0", "h.1", "h.2", "ln_f"] -> ["h.0–h.2", "ln_f"]."""
    out: list[str] = []
    run: list[tuple[str, int]] = []

    def flush():
        if len(run) >= 3:
            out.append(f"{run[0][0]}{run[0][1]}–{run[-1][0]}{run[-1][1]}")
        else:
            out.extend(f"{p}{i}" for p, i in run)
        run.clear()

    for item in items:
        match = _NUMBERED.match(item)
        if match:
            prefix, index = match.group(1) or "", int(match.group(2))
            if run and run[-1][0] == prefix and run[-1][1] + 1 == index:
                run.append((prefix, index))
                continue
            flush()
            run.append((prefix, index))
            continue
        flush()
        out.append(item)
    flush()
    return out


def build_plan(
    module: nn.Module,
    num_stages: int,
    traces: dict[str, ModuleTrace] | None,
    memory_weight: float,
    auto_partition: bool = True,
    default_partition: int = 0,
    use_time: bool = False,
    *,
    crossing_costs: CrossingCosts | None = None,
) -> PartitionPlan:
    """Turns traces (or None for skip_tracing) into a plan with the core's partitioner.

    ``crossing_costs`` prices calls between stages (default: :class:`CrossingCosts`()); without
    traces there are no calls to price.

    Raises:
        ValueError: a pin outside [0, num_stages), or fewer placeable modules than stages.
    """
    for path, submodule in module.named_modules():
        pin = _pin_of(submodule)
        if pin is not None and pin >= num_stages:
            raise ValueError(
                f"smp: module '{path or '<root>'}' is placed on stage {pin}, but "
                f"pipeline_parallel_degree is {num_stages}; use a stage in [0, {num_stages})"
            )
    if num_stages > 1 and _atomic(module):
        raise ValueError(
            f"smp: the whole model ({type(module).__name__}) is activation-checkpointed, and "
            f"a checkpointed module lies whole on one stage, but pipeline_parallel_degree is "
            f"{num_stages}; checkpoint its layers instead (e.g. "
            "smp.set_activation_checkpointing on each transformer layer)"
        )
    nodes, node_of_path = _build_nodes(
        module, traces, use_time, None if auto_partition else default_partition
    )
    core_nodes = _core_nodes(nodes, [n.pin for n in nodes])
    costs = crossing_costs or CrossingCosts()
    seconds_per_compute = _seconds_per_compute(module, costs, traces is not None, use_time)
    options = _C.PartitionOptions(
        num_stages=num_stages,
        memory_weight=memory_weight,
        seconds_per_compute=seconds_per_compute,
        crossing_latency=costs.latency_s,
        bandwidth=costs.bandwidth,
        balance_tolerance=costs.balance_tolerance,
    )
    core_plan = _C.partition(core_nodes, options, _core_calls(traces, node_of_path))
    unit = "module count" if traces is None else ("seconds" if use_time else "FLOPs")
    return PartitionPlan(
        module, nodes, node_of_path, core_plan, unit, crossings_priced=seconds_per_compute > 0
    )


def plan_partition(
    module: nn.Module,
    example_inputs: Any,
    pipeline_parallel_degree: int = 2,
    *,
    trace_execution_times: bool = False,
    crossing_costs: CrossingCosts | None = None,
    **config: Any,
) -> PartitionPlan:
    """Computes the partition smp would use, in this process, without launching anything.

    Args:
        module: the model (not wrapped).
        example_inputs: one microbatch: a tensor, a tuple of positional arguments, or a dict of
            keyword arguments.
        pipeline_parallel_degree: the number of stages to plan for.
        trace_execution_times: use measured times instead of FLOPs for compute.
        crossing_costs: what a call between stages costs (:class:`CrossingCosts`; the default
            is what smp uses).
        **config: other smp config keys that shape the plan: memory_weight, optimize,
            auto_partition, default_partition, skip_tracing.

    Returns:
        A :class:`PartitionPlan`; ``plan.report()`` is the table ``model.partition_report()`` shows.

    Example:
        plan = smp.plan_partition(GPT(cfg), torch.zeros(1, 128, dtype=torch.long), 4)
        print(plan.report())
    """
    cfg = build_config({"pipeline_parallel_degree": pipeline_parallel_degree, **config})
    traces = None
    if not cfg.skip_tracing:
        if isinstance(example_inputs, dict):
            run = lambda: module(**example_inputs)  # noqa: E731
        elif isinstance(example_inputs, (tuple, list)):
            run = lambda: module(*example_inputs)  # noqa: E731
        else:
            run = lambda: module(example_inputs)  # noqa: E731
        traces = trace_modules(module, run, trace_execution_times)
    return build_plan(
        module,
        cfg.pipeline_parallel_degree,
        traces,
        cfg.memory_weight,
        cfg.auto_partition,
        cfg.default_partition,
        use_time=trace_execution_times,
        crossing_costs=crossing_costs,
    )
