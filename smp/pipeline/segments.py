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
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch.autograd.graph import GradientEdge

__all__ = ["mark", "EdgeKey", "SegmentResult", "run_segment", "edge_of"]

EdgeKey = tuple[int, int]  # (id of the autograd node, output number)


def mark() -> int:
    """The autograd sequence number the next node created by this thread will get (or above).

    Costs one tiny autograd node. Only meaningful with grad mode on.
    """
    with torch.enable_grad():
        probe = torch.zeros((), requires_grad=True).clone()
    return probe.grad_fn._sequence_nr() + 1


def edge_of(tensor: torch.Tensor) -> GradientEdge:
    """The gradient edge into ``tensor``'s producer (or its accumulator, for a leaf)."""
    return torch.autograd.graph.get_gradient_edge(tensor)


def _key(edge: GradientEdge) -> EdgeKey:
    return (id(edge.node), edge.output_nr)


@dataclasses.dataclass
class SegmentResult:
    """What one interval's backward produced.

    Attributes:
        edge_grads: {edge key: (edge, gradient)} for edges into earlier intervals.
        leaf_grads: {id(boundary leaf): gradient} for the boundary leaves reached.
    """

    edge_grads: dict[EdgeKey, tuple[GradientEdge, torch.Tensor]]
    leaf_grads: dict[int, torch.Tensor]


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


def run_segment(
    roots: Sequence[torch.Tensor | GradientEdge],
    grads: Sequence[torch.Tensor],
    start: int,
    boundary_leaves: Iterable[torch.Tensor] = (),
) -> SegmentResult:
    """Backward of one interval (see the module docstring).

    Args:
        roots: the interval's outputs whose gradients are known: tensors (e.g. the loss, or a
            served call's outputs) or gradient edges collected by later intervals.
        grads: one gradient per root.
        start: :func:`mark` taken when the interval started.
        boundary_leaves: fresh leaves standing for values from the other side of a boundary.

    Returns:
        A :class:`SegmentResult`. Parameter gradients are accumulated into ``.grad``.
    """
    # Roots that cannot carry a gradient (integer outputs, values that need none) are skipped.
    keep = [i for i, r in enumerate(roots) if isinstance(r, GradientEdge) or r.requires_grad]
    edges = [r if isinstance(r, GradientEdge) else edge_of(r) for r in (roots[i] for i in keep)]
    grads = [grads[i] for i in keep]
    boundary_ids = {id(t) for t in boundary_leaves}
    absorbed: dict[int, Any] = {}
    while True:  # each round absorbs at least one node more; the graph is finite
        stops, leaves, params = _walk(edges, start, boundary_ids, absorbed)
        reached = {id(t) for t in (*leaves, *params)}
        more = {k: v for k, v in _on_paths(stops, reached).items() if k not in absorbed}
        if not more:
            break
        absorbed.update(more)
    inputs = [*stops, *leaves, *params]
    if not inputs:
        return SegmentResult({}, {})
    # Absorbed earlier nodes run again in their own interval: keep what they saved.
    results = torch.autograd.grad(
        edges, inputs, grads, allow_unused=True, retain_graph=bool(absorbed)
    )
    n_stops, n_leaves = len(stops), len(leaves)
    for param, grad in zip(params, results[n_stops + n_leaves :]):
        if grad is None:
            continue
        if param.grad is None:
            param.grad = grad.detach().clone(memory_format=torch.contiguous_format)
        else:
            param.grad.add_(grad)
    edge_grads = {_key(e): (e, g) for e, g in zip(stops, results[:n_stops]) if g is not None}
    leaf_grads = {
        id(t): g for t, g in zip(leaves, results[n_stops : n_stops + n_leaves]) if g is not None
    }
    return SegmentResult(edge_grads, leaf_grads)
