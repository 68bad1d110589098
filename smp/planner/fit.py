"""Fitting the host's costs of a cluster profile to measured steps (design.md §13.3).

    cluster, report = fit_host_costs(cluster, [(plan, measured_seconds), ...])

Note [The host's costs]
~~~~~~~~~~~~~~~~~~~~~~~
The roofline prices each op's kernel and one dispatch. What it does not see is the host's own
work around them: the Python of each module call and of each torch call, autograd's engine per
node, smp's machinery per microbatch and per step, the optimizer's loop over parameter tensors,
FSDP2's hooks per unit, the pipeline runtime per call between stages. On a CPU rank of a small
model that work is most of the step; on a GPU it is hidden where kernels are longer than the
Python that issues them, and it is the step where they are not. None of it follows from the
model's ops, and it differs by machine and by torch version, so it is fitted, not modelled:
``HostCosts`` has one coefficient per kind of work (seconds per op, per module call, per
microbatch, ...), and the plan counts the work (smp.planner.plan._price).

The fit takes measured steps of a calibration set of layouts, each with the plan it ran, and
finds the coefficients that minimise the sum of squared log-ratios of predicted to measured
step time (a relative error: a 20 ms step weighs as much as a 2 s one). The prediction is not
linear in the coefficients (the pipeline's simulation takes the slowest stage at each step), so
the fit reprices each plan (``Plan.priced_on``) inside a Nelder–Mead search. Each coefficient
is ``unit · x²``: non-negative by construction, with ``unit`` its order of magnitude so the
search moves all of them alike. A coefficient no calibration plan depends on keeps its value
(a set without sharded data parallelism cannot fit ``unit_s``). The accuracy is checked on
other layouts than the fitted ones (benchmarks/planner.py): a fit is only as good as its
held-out error.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Callable, Sequence
from typing import Any

from smp.planner.cluster import Cluster
from smp.planner.plan import Rejected

__all__ = ["fit_host_costs"]

# Each coefficient's order of magnitude on a CPU rank (the search's unit for it); the pipeline
# runtime's cost per call between stages is the cluster's call_overhead_s.
_UNITS = {
    "op_s": 1e-5,
    "backward_op_s": 1e-5,
    "module_call_s": 1e-5,
    "microbatch_s": 1e-3,
    "step_s": 1e-2,
    "parameter_s": 1e-5,
    "unit_s": 1e-4,
    "call_overhead_s": 1e-4,
}


def _with(cluster: Cluster, values: dict[str, float]) -> Cluster:
    host = {k: v for k, v in values.items() if k != "call_overhead_s"}
    changes: dict[str, Any] = {"host": dataclasses.replace(cluster.host, **host)}
    if "call_overhead_s" in values:
        changes["call_overhead_s"] = values["call_overhead_s"]
    return dataclasses.replace(cluster, **changes)


def _current(cluster: Cluster, name: str) -> float:
    return getattr(cluster, name) if name == "call_overhead_s" else getattr(cluster.host, name)


def _nelder_mead(
    f: Callable[[list[float]], float], start: list[float], step: float, iterations: int
) -> tuple[list[float], float]:
    """Minimises ``f`` from ``start`` (the textbook method: reflect, expand, contract, shrink)."""
    n = len(start)
    simplex = [list(start)]
    for i in range(n):
        point = list(start)
        point[i] += step
        simplex.append(point)
    values = [f(p) for p in simplex]
    for _ in range(iterations):
        order = sorted(range(n + 1), key=values.__getitem__)
        simplex = [simplex[i] for i in order]
        values = [values[i] for i in order]
        if values[-1] - values[0] < 1e-12:
            break
        centre = [sum(p[i] for p in simplex[:-1]) / n for i in range(n)]
        worst = simplex[-1]
        reflected = [c + (c - w) for c, w in zip(centre, worst)]
        fr = f(reflected)
        if fr < values[0]:
            expanded = [c + 2 * (c - w) for c, w in zip(centre, worst)]
            fe = f(expanded)
            simplex[-1], values[-1] = (expanded, fe) if fe < fr else (reflected, fr)
        elif fr < values[-2]:
            simplex[-1], values[-1] = reflected, fr
        else:
            contracted = [c + 0.5 * (w - c) for c, w in zip(centre, worst)]
            fc = f(contracted)
            if fc < values[-1]:
                simplex[-1], values[-1] = contracted, fc
            else:  # shrink towards the best
                best = simplex[0]
                simplex = [best] + [
                    [b + 0.5 * (x - b) for b, x in zip(best, p)] for p in simplex[1:]
                ]
                values = [values[0]] + [f(p) for p in simplex[1:]]
    i = min(range(n + 1), key=values.__getitem__)
    return simplex[i], values[i]


def fit_host_costs(
    cluster: Cluster,
    samples: Sequence[tuple[Any, float]],
    fields: Sequence[str] | None = None,
    iterations: int = 2000,
) -> tuple[Cluster, dict[str, Any]]:
    """Fits ``cluster``'s host costs (:class:`~smp.planner.HostCosts` and ``call_overhead_s``)
    to measured steps (Note [The host's costs]).

    Args:
        cluster: the profile the plans were priced on (its other numbers are kept).
        samples: (plan, measured seconds per step) pairs; each plan is one ``smp.plan``
            returned in this process (it reprices itself on the candidate profiles).
        fields: the coefficients to fit (default: all that some plan depends on).
        iterations: the Nelder–Mead search's limit per start.

    Returns:
        The cluster with the fitted costs, and a report: ``coefficients`` (seconds),
        ``fitted`` (the fields fitted), the calibration set's ``median_error`` and
        ``max_error`` (|predicted / measured - 1|) before and after, and ``samples``.

    Raises:
        ValueError: no samples, a non-positive time, an unknown field, or a plan that cannot
            be repriced (copied or unpickled: plan again in this process).
    """
    if not samples:
        raise ValueError("smp.fit_host_costs: no samples to fit")
    bad = [s for _, s in samples if not s > 0]
    if bad:
        raise ValueError(f"smp.fit_host_costs: measured step times must be > 0 s, got {bad}")
    names = list(fields) if fields is not None else list(_UNITS)
    unknown = [n for n in names if n not in _UNITS]
    if unknown:
        raise ValueError(
            f"smp.fit_host_costs: unknown fields {unknown}; the fields are {sorted(_UNITS)}"
        )
    plans = [plan for plan, _ in samples]
    measured = [seconds for _, seconds in samples]

    def predict(values: dict[str, float]) -> list[float]:
        candidate = _with(cluster, values)
        out = []
        for plan in plans:
            got = plan.priced_on(candidate)
            # a profile whose costs make a plan not fit prices it as infinitely slow
            out.append(math.inf if isinstance(got, Rejected) else got.predicted["step_time_s"])
        return out

    def loss(times: list[float]) -> float:
        return sum(
            math.log(t / s) ** 2 if math.isfinite(t) else 1e6 for t, s in zip(times, measured)
        )

    # Fit only what some plan depends on: a coefficient nothing counts keeps its value.
    start = {n: _current(cluster, n) for n in names}
    base = predict(start)
    used = [n for n in names if predict({**start, n: start[n] + _UNITS[n]}) != base]

    def values_of(x: list[float]) -> dict[str, float]:
        return {**start, **{n: _UNITS[n] * v * v for n, v in zip(used, x)}}

    starts = [
        [math.sqrt(start[n] / _UNITS[n]) for n in used],  # where the profile is (its loss)
        [1.0] * len(used),  # each at its order of magnitude
    ]
    best_x, best = starts[0], loss(base)
    if used:
        objective = lambda x: loss(predict(values_of(x)))  # noqa: E731
        for x0 in starts:
            x, value = _nelder_mead(objective, x0, 0.5, iterations)
            # restart from the result: the simplex collapses early on flat directions
            x, value = _nelder_mead(objective, x, 0.25, iterations)
            if value < best:
                best_x, best = x, value
    fitted = values_of(best_x)
    after = predict(fitted)

    def errors(times: list[float]) -> list[float]:
        return [abs(t / s - 1) for t, s in zip(times, measured)]

    report = {
        "coefficients": fitted,
        "fitted": used,
        "samples": len(samples),
        "median_error_before": statistics.median(errors(base)),
        "max_error_before": max(errors(base)),
        "median_error": statistics.median(errors(after)),
        "max_error": max(errors(after)),
    }
    return _with(cluster, fitted), report
