"""The host's costs (smp/planner/fit.py, Note [The host's costs]; design.md §13.3): each
coefficient prices the work it names, a plan reprices itself on another profile, and the fit
recovers the costs that made a set of step times."""

from __future__ import annotations

import dataclasses
import pickle

import pytest
from models import build_model, lm_loss, make_batch

from smp.planner import HostCosts, fit_host_costs, get_cluster
from smp.planner.plan import plan

CPU = get_cluster("h100", num_devices=4)


def _plans(cluster=CPU):
    model = build_model("gpt")
    x, y = make_batch("gpt", 2, 0)
    return plan(
        model, (x,), cluster, 16, num_devices=4, run=lambda m, ids: lm_loss(m(ids), y),
        max_plans=1000,
    )  # fmt: skip


def _key(p):
    return (repr(sorted(p.config.items())), tuple(p.checkpointing))


def test_a_plan_repriced_on_its_own_profile_is_itself_and_pickles_without_its_inputs():
    plans = _plans()
    for p in plans.plans[:50]:
        again = p.priced_on(CPU)
        assert again.predicted == p.predicted and again.config == p.config
    copy = pickle.loads(pickle.dumps(plans[0]))
    assert copy.predicted == plans[0].predicted
    with pytest.raises(ValueError, match="plan again"):
        copy.priced_on(CPU)


def test_each_host_cost_adds_the_work_it_names():
    plans = {_key(p): p for p in _plans().plans}
    by_pp = {}
    for p in plans.values():
        by_pp.setdefault(p.config["pipeline_parallel_degree"], p)
    single = next(
        p for p in plans.values()
        if p.config["pipeline_parallel_degree"] == 1 and not p.checkpointing
        and p.predicted["data_parallel_degree"] == 4 and p.config["microbatches"] == 2
        and "sharded_data_parallel_degree" not in p.config
    )  # fmt: skip
    base = single.predicted["step_time_s"]

    def step(**host):
        return single.priced_on(dataclasses.replace(CPU, host=HostCosts(**host))).predicted[
            "step_time_s"
        ]

    m = single.config["microbatches"]
    # per step, once; per microbatch, m times (no pipeline: one stage)
    assert step(step_s=0.01) == pytest.approx(base + 0.01)
    assert step(microbatch_s=0.01) == pytest.approx(base + m * 0.01)
    # per parameter tensor: the GPT's tensors, once per step
    tensors = sum(1 for _ in build_model("gpt").parameters())
    assert step(parameter_s=1e-3) == pytest.approx(base + tensors * 1e-3)
    # per module call and per op: m forwards of the whole model; the backward's per op
    calls = step(module_call_s=1e-3) - base
    assert calls / (m * 1e-3) == pytest.approx(round(calls / (m * 1e-3)))
    assert round(calls / (m * 1e-3)) >= sum(1 for _ in build_model("gpt").modules()) - 1
    assert step(op_s=1e-4) - base == pytest.approx(step(backward_op_s=1e-4) - base)
    # FSDP2's units only where data parallelism shards
    assert step(unit_s=1.0) == pytest.approx(base)
    sharded = next(p for p in plans.values() if p.config.get("sharded_data_parallel_degree", 1) > 1)
    with_units = sharded.priced_on(dataclasses.replace(CPU, host=HostCosts(unit_s=1e-3)))
    extra = with_units.predicted["step_time_s"] - sharded.predicted["step_time_s"]
    assert extra > 0 and extra / (sharded.config["microbatches"] * 1e-3) == pytest.approx(
        round(extra / (sharded.config["microbatches"] * 1e-3))
    )


def test_negative_or_missing_costs_are_refused_by_name():
    with pytest.raises(ValueError, match="op_s"):
        HostCosts(op_s=-1e-6)
    with pytest.raises(ValueError, match="step_s"):
        HostCosts(step_s=float("nan"))
    plans = _plans()
    with pytest.raises(ValueError, match="no samples"):
        fit_host_costs(CPU, [])
    with pytest.raises(ValueError, match="> 0"):
        fit_host_costs(CPU, [(plans[0], 0.0)])
    with pytest.raises(ValueError, match="unknown fields.*op_s"):
        fit_host_costs(CPU, [(plans[0], 1.0)], fields=["ops"])


def test_the_fit_recovers_the_costs_that_made_the_step_times():
    plans = _plans().plans
    # a spread: pipelines and not, checkpointing, microbatch counts
    spread = {}
    for p in plans:
        c = p.config
        spread.setdefault(
            (c["pipeline_parallel_degree"], c.get("pipeline_schedule"), bool(p.checkpointing),
             c["microbatches"]), p,
        )  # fmt: skip
    chosen = list(spread.values())[:16]
    truth = dataclasses.replace(
        CPU,
        call_overhead_s=400e-6,
        host=HostCosts(
            op_s=6e-6,
            backward_op_s=12e-6,
            module_call_s=20e-6,
            microbatch_s=2e-3,
            step_s=15e-3,
            parameter_s=30e-6,
        ),  # fmt: skip
    )
    measured = [(p, p.priced_on(truth).predicted["step_time_s"]) for p in chosen]
    fitted, report = fit_host_costs(CPU, measured, iterations=800)
    assert report["median_error_before"] > 0.2  # the profile without host costs is far off
    assert report["median_error"] < 0.01 and report["max_error"] < 0.03
    assert "unit_s" not in report["fitted"]  # nothing here shards: it keeps its value
    assert fitted.host.unit_s == CPU.host.unit_s
    for p, seconds in measured:
        assert p.priced_on(fitted).predicted["step_time_s"] == pytest.approx(seconds, rel=0.03)
    # the rest of the profile is kept
    assert fitted.device == CPU.device and fitted.intra == CPU.intra


def test_fitted_costs_round_trip_through_a_profile(tmp_path):
    cluster = dataclasses.replace(CPU, host=HostCosts(op_s=1e-6, unit_s=2e-4))
    cluster.save(tmp_path / "c.json")
    assert get_cluster(str(tmp_path / "c.json")) == cluster
    # a profile saved before host costs existed reads as zero costs
    data = CPU.to_dict()
    del data["host"]
    assert get_cluster(data).host == HostCosts()
