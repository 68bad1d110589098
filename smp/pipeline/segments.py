"""Backward across pipeline boundaries without blocking inside autograd (design.md §4).

A worker's forward on one rank is a sequence of *intervals* separated by its remote calls. Values
from remote calls, and the inputs of a served call, enter the local graph as fresh leaves
(*boundary leaves*). Autograd nodes carry an increasing per-thread sequence number, so
:func:`mark` taken when an interval starts tells which nodes it created.

:func:`run_segment` runs the backward of one interval: one ``torch.autograd.grad`` call from the
interval's roots (tensors or gradient edges, with their gradients) whose inputs are

- the gradient edges into earlier intervals' nodes (autograd stops there without running them),
- the boundary leaves reached (their gradients are sent to the other side of the boundary), and
- the parameters reached (their gradients are accumulated into ``.grad`` as autograd would).

The caller sums gradients arriving at the same edge (from later intervals of this worker and from
remote replies) and runs an earlier interval once all of them are in, so a tensor with both local
and remote consumers has its upstream graph run exactly once, with the full gradient.

One exception: when an interval uses an earlier value and another derived from it (``x`` and
``ln(x)``), autograd must run the earlier nodes between them to reach ``x``'s producer. The
segment then runs those nodes with its own share (keeping their saved tensors), and their own
interval runs them again with the rest; gradients add up because backward is linear in the
incoming gradient.

Zero-bubble split (``split_weights``, design.md §4.4): a segment with no earlier intervals may
compute its boundary leaves' gradients first and its parameters' later. The *input half* is
the ``torch.autograd.grad`` call above without the parameters, so autograd skips every
weight-gradient product; it keeps the graph and records, with a pre-hook, the gradient reaching
each *intermediate*: a node on a path to a boundary leaf with an edge towards parameters
only. The *weight half* (:class:`WeightGrads`) later runs one ``torch.autograd.grad`` per
intermediate, from that node with the recorded gradient to its parameters. A parameter reached
from several intermediates (a weight used twice), or from an output that does not depend on a
boundary leaf, is computed in the input half as before: from one intermediate autograd only
walks towards parameters, from two it would run the path between them again.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch.autograd.graph import GradientEdge

from smp import _C

try:  # the engine call under torch.autograd.grad, without its checks (see _grad)
    from torch.autograd.graph import _engine_run_backward
except ImportError:  # pragma: no cover - torch without it: the public call
    _engine_run_backward = None

__all__ = [
    "mark",
    "EdgeKey",
    "SegmentResult",
    "Uses",
    "WeightGrads",
    "run_segment",
    "edge_of",
    "accumulate",
]

EdgeKey = tuple[int, int]  # (id of the autograd node, output number)


def mark() -> int:
    """The autograd sequence number the next node created by this thread will get.

    Sequence numbers are per thread and only node construction advances them, so two marks
    are equal exactly when no node was created between them. Read from torch's counter
    (``smp._C.next_sequence_nr``); building a probe node for it, as this did before, cost a few
    microseconds per mark, and the pipeline marks at every interval and large module.
    """
    return _C.next_sequence_nr()


def edge_of(tensor: torch.Tensor) -> GradientEdge:
    """The gradient edge into ``tensor``'s producer (or its accumulator, for a leaf)."""
    return torch.autograd.graph.get_gradient_edge(tensor)


def _grad(
    outputs: Sequence[torch.Tensor | GradientEdge],
    inputs: Sequence[torch.Tensor | GradientEdge],
    grads: Sequence[torch.Tensor],
    retain_graph: bool = False,
) -> tuple[torch.Tensor | None, ...]:
    """``torch.autograd.grad(outputs, inputs, grads, allow_unused=True, retain_graph=...)``.

    Calls the engine as that function does, without its Python around the call: argument
    normalisation, ``__torch_function__`` checks, and ``_make_grads``, which for every output
    builds its input metadata and compares shapes symbolically. The runtime makes one of these
    calls per segment and, where weight gradients are split, one per weight group (§4.4); alone,
    one call to a Linear's weight and bias takes 30-34 us this way against 46-49 us. Every
    root that is a gradient edge has a gradient autograd computed for it; ``run_segment`` checks
    the shapes of those given for tensors, which may come from the user's ``model.backward``.
    """
    if _engine_run_backward is None:  # pragma: no cover
        return torch.autograd.grad(
            outputs, inputs, grads, allow_unused=True, retain_graph=retain_graph
        )
    return _engine_run_backward(
        tuple(outputs),
        tuple(grads),
        retain_graph,
        False,
        tuple(inputs),
        True,
        accumulate_grad=False,
    )


def _key(edge: GradientEdge) -> EdgeKey:
    return (id(edge.node), edge.output_nr)


@dataclasses.dataclass
class SegmentResult:
    """What one interval's backward produced.

    Attributes:
        edge_grads: {edge key: (edge, gradient)} for edges into earlier intervals.
        leaf_grads: {id(boundary leaf): gradient} for the boundary leaves reached.
        weights: the weight half still to run (``split_weights``), or None.
    """

    edge_grads: dict[EdgeKey, tuple[GradientEdge, torch.Tensor]]
    leaf_grads: dict[int, torch.Tensor]
    weights: WeightGrads | None = None


class WeightGrads:
    """The weight half of a split segment: accumulates its parameters' gradients when run.

    Holds the segment's graph (and so its saved tensors) until :meth:`run`, which frees them.
    """

    def __init__(self, groups: list[tuple[Any, dict[int, torch.Tensor]]]):
        self._groups = groups  # (intermediate node, {id: parameter}); gradients set by the hooks
        self._grads: dict[int, tuple] = {}

    def _record(self, node) -> Callable[[tuple], None]:
        def hook(grad_outputs: tuple) -> None:
            self._grads[id(node)] = grad_outputs

        return hook

    def run(self) -> None:
        groups, self._groups = self._groups, []
        grads, self._grads = self._grads, {}
        for node, params in groups:
            given = grads.get(id(node))
            if given is None:
                continue  # no gradient reached it
            roots = [(GradientEdge(node, i), g) for i, g in enumerate(given) if g is not None]
            if not roots:
                continue
            targets = list(params.values())
            accumulate(targets, _grad([e for e, _ in roots], targets, [g for _, g in roots]))


class Uses:
    """Where each leaf and parameter of one worker's graph is first used: the oldest sequence
    number among the nodes that take it, over every node reachable from the roots walked so far.

    A path from an earlier interval's node to a leaf or parameter passes through a node that
    takes it and is older than the interval, so an interval need not look below its earlier
    intervals for a leaf or parameter first used in it (the common case). One per worker: its
    segments share the walk, so the graph below them is walked once, not once per segment.
    Holds the nodes walked (their ids must stay theirs) until the worker drops it.
    """

    def __init__(self) -> None:
        self._nodes: dict[int, Any] = {}
        self._first: dict[int, int] = {}

    def walk(self, roots: Sequence[GradientEdge]) -> None:
        """Indexes the nodes reachable from ``roots`` not walked before."""
        stack = []
        for root in roots:
            node = root.node
            if node is not None and id(node) not in self._nodes and not hasattr(node, "variable"):
                self._nodes[id(node)] = node
                stack.append(node)
        while stack:
            node = stack.pop()
            sequence_nr = node._sequence_nr()
            for nxt, _ in node.next_functions:
                if nxt is None:
                    continue
                variable = getattr(nxt, "variable", None)
                if variable is not None:
                    key = id(variable)
                    self._first[key] = min(self._first.get(key, sequence_nr), sequence_nr)
                elif id(nxt) not in self._nodes:
                    self._nodes[id(nxt)] = nxt
                    stack.append(nxt)

    def used_before(self, variable_id: int, start: int) -> bool:
        """Whether a node older than ``start`` takes the variable (True when not known)."""
        return self._first.get(variable_id, -1) < start


def _walk(
    roots: Sequence[GradientEdge], start: int, boundary_ids: set[int], absorbed: dict[int, Any]
) -> tuple[list[GradientEdge], list[torch.Tensor], list[torch.Tensor]]:
    """Nodes of this interval (and the ``absorbed`` earlier ones) reachable from ``roots``:
    returns (edges into earlier intervals, boundary leaves reached, parameters reached)."""
    stops: dict[EdgeKey, GradientEdge] = {}
    leaves: dict[int, torch.Tensor] = {}
    params: dict[int, torch.Tensor] = {}
    seen: set[int] = set()
    stack = []

    def consider(node, output_nr: int) -> None:
        if node is None:
            return
        variable = getattr(node, "variable", None)
        if variable is not None:  # AccumulateGrad: a leaf that requires grad
            (leaves if id(variable) in boundary_ids else params)[id(variable)] = variable
            return
        if node._sequence_nr() < start and id(node) not in absorbed:
            edge = GradientEdge(node, output_nr)
            stops[_key(edge)] = edge
            return
        if id(node) not in seen:
            seen.add(id(node))
            stack.append(node)

    for root in roots:
        consider(root.node, root.output_nr)
    while stack:
        node = stack.pop()
        for next_node, output_nr in node.next_functions:
            consider(next_node, output_nr)
    return list(stops.values()), list(leaves.values()), list(params.values())


def _on_paths(stops: list[GradientEdge], inputs: set[int]) -> dict[int, Any]:
    """The nodes (by id; the values keep them, and so their ids, alive) on a path from one
    stop's node to another's, or to a leaf or parameter among the segment's ``inputs`` (ids of
    the variables), that stop's node included, the target not. Autograd runs those to reach the
    target, so the segment runs them, and their own interval runs them again later with its
    gradients (backward is linear in the incoming gradient)."""
    targets = {id(e.node) for e in stops}
    if not targets or (len(targets) < 2 and not inputs):
        return {}
    # A node's inputs are older than it (sequence numbers), so a path from a stop to another
    # only visits nodes not older than the oldest stop. A path to a leaf may go further down.
    floor = min(e.node._sequence_nr() for e in stops)
    nodes: dict[int, Any] = {}
    stack = [e.node for e in stops]
    while stack:
        node = stack.pop()
        if id(node) in nodes:
            continue
        nodes[id(node)] = node
        for nxt, _ in node.next_functions:
            if nxt is None:
                continue
            variable = getattr(nxt, "variable", None)
            if variable is not None:
                if id(variable) in inputs:
                    targets.add(id(nxt))
            elif inputs or nxt._sequence_nr() >= floor:
                stack.append(nxt)
    reaches: dict[int, bool] = {}
    for node in sorted(nodes.values(), key=lambda n: n._sequence_nr()):
        reaches[id(node)] = any(
            nxt is not None and (id(nxt) in targets or reaches.get(id(nxt), False))
            for nxt, _ in node.next_functions
        )
    return {key: nodes[key] for key, value in reaches.items() if value}


def _weight_groups(
    edges: Sequence[GradientEdge], boundary_ids: set[int]
) -> list[tuple[Any, dict[int, torch.Tensor]]]:
    """The split of a segment without earlier intervals (module docstring): [(intermediate,
    {id: parameter} computed from it)], each parameter in one group at most; parameters in no
    group stay in the input half."""
    # Post-order over the nodes (children first), without recursion.
    order: list[Any] = []
    seen: set[int] = set()
    for edge in edges:
        root = edge.node
        if root is None or id(root) in seen or getattr(root, "variable", None) is not None:
            continue
        seen.add(id(root))
        stack = [(root, iter(root.next_functions))]
        while stack:
            node, children = stack[-1]
            for child, _ in children:
                if child is None or id(child) in seen or hasattr(child, "variable"):
                    continue
                seen.add(id(child))
                stack.append((child, iter(child.next_functions)))
                break
            else:
                stack.pop()
                order.append(node)
    reaches: dict[int, bool] = {}  # leads to a boundary leaf
    below: dict[int, dict[int, torch.Tensor]] = {}  # parameters behind its non-reaching edges
    for node in order:
        leads, params = False, {}
        for child, _ in node.next_functions:
            if child is None:
                continue
            variable = getattr(child, "variable", None)
            if variable is not None:
                if id(variable) in boundary_ids:
                    leads = True
                else:
                    params[id(variable)] = variable
            elif reaches[id(child)]:
                leads = True
            else:
                params.update(below[id(child)])
        reaches[id(node)], below[id(node)] = leads, params
    uses: dict[int, int] = {}
    for node in order:
        if reaches[id(node)]:
            for key in below[id(node)]:
                uses[key] = uses.get(key, 0) + 1
    for edge in edges:  # outputs that depend on parameters only: their parameters stay
        node = edge.node
        variable = getattr(node, "variable", None)
        if variable is not None:
            uses[id(variable)] = 2
        elif node is not None and not reaches[id(node)]:
            for key in below[id(node)]:
                uses[key] = 2
    groups = []
    for node in order:
        if reaches[id(node)]:
            params = {k: p for k, p in below[id(node)].items() if uses[k] == 1}
            if params:
                groups.append((node, params))
    return groups


def accumulate(
    params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor | None], first: int = 0
) -> None:
    """Adds each gradient (``grads[first + i]`` is ``params[i]``'s) into its parameter's
    ``.grad``, as autograd's accumulator would, and then runs the parameter's
    post-accumulate-grad hooks as it would: those a user registered, and the overlapped gradient
    reduction's (smp/dp/reduction.py), see every accumulation of a pipelined stage as they would
    without the pipeline.

    A parameter's first gradient becomes its ``.grad`` as it is when ``grads`` is the tuple the
    engine returned and nothing else holds that gradient (``smp._C.sole_gradient``: no other
    reference, view or owner), as autograd's accumulator takes it; otherwise it is copied, since
    a later accumulation adds into ``.grad`` in place. The test runs on the tuple's item before
    anything here refers to it."""
    owned = isinstance(grads, tuple)
    for i, param in enumerate(params, first):
        if grads[i] is None:
            continue
        if param.grad is None:
            if owned and _C.sole_gradient(grads, i):
                param.grad = grads[i]
            else:
                param.grad = grads[i].detach().clone(memory_format=torch.contiguous_format)
        else:
            param.grad.add_(grads[i])
        hooks = getattr(param, "_post_accumulate_grad_hooks", None)  # torch's own registry
        if hooks:
            for hook in list(hooks.values()):
                hook(param)


def run_segment(
    roots: Sequence[torch.Tensor | GradientEdge],
    grads: Sequence[torch.Tensor],
    start: int,
    boundary_leaves: Iterable[torch.Tensor] = (),
    split_weights: bool = False,
    uses: Uses | None = None,
) -> SegmentResult:
    """Backward of one interval (see the module docstring).

    Args:
        roots: the interval's outputs whose gradients are known: tensors (e.g. the loss, or a
            served call's outputs) or gradient edges collected by later intervals.
        grads: one gradient per root.
        start: :func:`mark` taken when the interval started.
        boundary_leaves: fresh leaves standing for values from the other side of a boundary.
        split_weights: when the segment reaches no earlier interval, leave the gradients of
            the parameters that can wait to the returned :class:`WeightGrads` (module
            docstring).
        uses: the worker's :class:`Uses`, shared by its segments; without one, every segment
            with an earlier interval walks the whole graph below it.

    Returns:
        A :class:`SegmentResult`. Parameter gradients are accumulated into ``.grad`` (those of
        ``result.weights`` when it runs).
    """
    # Roots that cannot carry a gradient (integer outputs, values that need none) are skipped.
    keep = [i for i, r in enumerate(roots) if isinstance(r, GradientEdge) or r.requires_grad]
    for i in keep:
        # What torch.autograd.grad checks, for gradients that may come from the user's code
        # (model.backward's grad_tensors); _grad does not check, and the engine would sum a
        # gradient broadcast over a larger shape.
        if isinstance(roots[i], torch.Tensor) and grads[i].shape != roots[i].shape:
            raise RuntimeError(
                f"Mismatch in shape: grad_output[{i}] has a shape of {grads[i].shape} and "
                f"output[{i}] has a shape of {roots[i].shape}."
            )
    edges = [r if isinstance(r, GradientEdge) else edge_of(r) for r in (roots[i] for i in keep)]
    grads = [grads[i] for i in keep]
    boundary_ids = {id(t) for t in boundary_leaves}
    absorbed: dict[int, Any] = {}
    while True:  # each round absorbs at least one node more; the graph is finite
        stops, leaves, params = _walk(edges, start, boundary_ids, absorbed)
        reached = {id(t) for t in (*leaves, *params)}
        if uses is not None and stops:  # only those an earlier interval takes too
            uses.walk(edges)  # returns at once where an earlier segment walked
            reached = {key for key in reached if uses.used_before(key, start)}
        more = {k: v for k, v in _on_paths(stops, reached).items() if k not in absorbed}
        if not more:
            break
        absorbed.update(more)
    weights, handles = None, []
    if split_weights and not stops and leaves and params:
        groups = _weight_groups(edges, boundary_ids)
        if groups:
            later = {k for _, group in groups for k in group}
            params = [p for p in params if id(p) not in later]
            weights = WeightGrads(groups)
            handles = [node.register_prehook(weights._record(node)) for node, _ in groups]
    inputs = [*stops, *leaves, *params]
    if not inputs:
        return SegmentResult({}, {})
    try:
        # Absorbed earlier nodes run again in their own interval, the weight half's nodes in
        # it: keep what they saved.
        results = _grad(edges, inputs, grads, retain_graph=bool(absorbed) or weights is not None)
    finally:
        for handle in handles:
            handle.remove()
    n_stops, n_leaves = len(stops), len(leaves)
    accumulate(params, results, n_stops + n_leaves)
    edge_grads = {_key(e): (e, g) for e, g in zip(stops, results[:n_stops]) if g is not None}
    leaf_grads = {
        id(t): g for t, g in zip(leaves, results[n_stops : n_stops + n_leaves]) if g is not None
    }
    return SegmentResult(edge_grads, leaf_grads, weights)
