"""smp.plan (smp/planner/plan.py, design.md §13.3): ranked plans whose configs smp accepts,
ledgers that add up and fit, and a reason for every rejected layout."""

from __future__ import annotations

import json

import pytest
import torch
from models import build_model, lm_loss, make_batch

import smp
from smp.config import build_config
from smp.planner import get_cluster
from smp.planner.plan import plan

GIB = 1024**3


def _gpt_plans(cluster="h100", num_devices=4, global_batch=16, **kwargs):
    model = build_model("gpt")
    x, y = make_batch("gpt", 2, 0)
    return model, plan(
        model, (x,), cluster, global_batch, num_devices=num_devices,
        run=lambda m, ids: lm_loss(m(ids), y), max_plans=1000, **kwargs,
    )  # fmt: skip


def test_plans_are_ranked_valid_configs_whose_ledgers_add_up_and_fit():
    _, plans = _gpt_plans()
    assert len(plans) > 5 and plans.rejected
    device = get_cluster("h100").device
    times = [p.predicted["step_time_s"] for p in plans]
    assert times == sorted(times)
    for p in plans:
        config = build_config(p.config)  # smp.init accepts it as it is
        pp, tp = config.pipeline_parallel_degree, config.tensor_parallel_degree
        dp = p.predicted["data_parallel_degree"]
        assert pp * tp * dp == 4
        assert dp * config.microbatches * p.predicted["microbatch_size"] == 16
        ledgers, memory = p.predicted["ledger"], p.predicted["memory_bytes"]
        assert len(ledgers) == len(memory) == 4
        for ledger, total in zip(ledgers, memory):
            parts = ("parameters", "gradients", "optimizer", "activations", "reserved", "other")
            assert total == pytest.approx(sum(ledger[k] for k in parts))
            assert total <= device.memory_bytes
        assert p.predicted["samples_per_s"] == pytest.approx(16 / p.predicted["step_time_s"])
        assert 0 < p.predicted["mfu"] < 1


def test_the_ledger_follows_the_layout():
    model, plans = _gpt_plans()
    by = {}
    for p in plans:
        c = p.config
        key = (
            c["tensor_parallel_degree"],
            c["pipeline_parallel_degree"], c.get("shard_optimizer_state", False),
            c.get("sharded_data_parallel_degree", 1), c["microbatches"],
            c.get("pipeline_schedule"), bool(p.checkpointing),
        )  # fmt: skip
        by[key] = p.predicted["ledger"]
    params = sum(p.numel() for p in model.parameters())
    # dp 4, replicated: every rank holds every parameter, fp32 Adam (4 + 4 + 8 bytes).
    whole = by[(1, 1, False, 1, 4, None, False)][0]
    assert whole["parameters"] == whole["gradients"] == params * 4
    assert whole["optimizer"] == params * 8
    # ZeRO-1 shards the optimizer state over dp; sdp shards all three.
    zero = by[(1, 1, True, 1, 4, None, False)][0]
    assert zero["optimizer"] == pytest.approx(params * 8 / 4) and zero["parameters"] == params * 4
    sdp = by[(1, 1, False, 4, 4, None, False)][0]
    assert sdp["parameters"] == pytest.approx(params * 4 / 4)
    # Checkpointing the blocks keeps less per microbatch.
    assert by[(1, 1, False, 1, 4, None, True)][0]["activations"] < whole["activations"]
    # pp 2: the stages split the parameters; GPipe holds every microbatch at once, 1F1B at
    # most pp, on any stage (a stage runs whichever task is ready, design.md §4.5).
    gpipe = by[(1, 2, False, 1, 8, "gpipe", False)]
    one_f = by[(1, 2, False, 1, 8, "1f1b", False)]
    # Placement "cluster" (D, P, T; T varies fastest): rank 1 is stage 1, rank 2 stage 0 again.
    assert gpipe[0]["in_flight"] == 8 and one_f[0]["in_flight"] == 2 and one_f[1]["in_flight"] == 2
    assert one_f[2] == one_f[0]
    assert gpipe[0]["activations"] == pytest.approx(4 * one_f[0]["activations"])
    assert sum(one_f[r]["parameters"] for r in (0, 1)) == pytest.approx(params * 4)
    # tp 2 (smp's conversion of the whole model, on a copy): the layers' weights halve, the
    # layer norms and biases of row-parallel layers stay whole.
    tp2 = by[(2, 1, False, 1, 4, None, False)]
    assert 0.5 * params * 4 < tp2[0]["parameters"] < 0.6 * params * 4
    assert tp2[0] == tp2[1]  # the TP ranks of a replica hold alike


def test_every_rejected_layout_names_its_reason():
    tiny = dict(get_cluster("h100").to_dict())
    # 28,032 parameters: 438 KiB of fp32 Adam state replicated, 110 KiB sharded over 4.
    tiny["device"] = dict(tiny["device"], memory_bytes=300 * 1024, reserved_bytes=0)
    _, plans = _gpt_plans(cluster=tiny, global_batch=12)
    reasons = [r.reason for r in plans.rejected]
    assert any("sharded data parallelism under pipeline parallelism" in r for r in reasons)
    assert any(
        r.startswith("does not fit: stage 0's ranks need")
        and "KiB over the device's 300.00 KiB" in r
        for r in reasons
    )
    for r in plans.rejected:
        assert r.reason and isinstance(r.config, dict)
    assert plans  # sharded layouts fit, and what is left fits the device
    for p in plans:
        assert max(p.predicted["memory_bytes"]) <= 300 * 1024
    odd = _gpt_plans(num_devices=8, global_batch=12)[1]
    assert any(r.reason == "global batch 12 is not divisible by dp 8" for r in odd.rejected)


def test_json_holds_configs_predictions_and_reasons():
    _, plans = _gpt_plans()
    data = json.loads(json.dumps(plans.to_json()))
    assert set(data) == {"plans", "rejected"}
    first = data["plans"][0]
    assert first["config"] == plans[0].config
    for key in ("step_time_s", "samples_per_s", "mfu", "memory_bytes", "ledger"):
        assert key in first["predicted"]
    assert len(first["predicted"]["memory_bytes"]) == 4
    assert all(set(r) == {"config", "reason"} for r in data["rejected"])
    text = plans.explain()
    assert text.startswith("1. pp ") and "rank " in text and "candidates rejected" in text


def test_bad_arguments_are_named():
    model = build_model("gpt")
    with pytest.raises(ValueError, match=r"global_batch must be an int >= 1, got 0"):
        plan(model, (torch.zeros(1, 8, dtype=torch.long),), "h100", 0)
    with pytest.raises(ValueError, match=r"no tensor with a batch dimension"):
        plan(model, {"x": 3}, "h100", 8)
    with pytest.raises(ValueError, match=r"unknown cluster 'h1000'"):
        plan(model, (torch.zeros(1, 8, dtype=torch.long),), "h1000", 8)
    assert smp.plan is plan


def test_the_command_line_plans_a_hugging_face_config(tmp_path, capsys):
    from smp.planner.__main__ import main

    config = tmp_path / "config.json"
    config.write_text(
        json.dumps(
            {
                "model_type": "llama", "vocab_size": 256, "hidden_size": 64,
                "intermediate_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4,
                "num_key_value_heads": 2,
            }
        )
    )  # fmt: skip
    out, trace = tmp_path / "plans.json", tmp_path / "trace.json"
    code = main(
        [
            "--model", str(config), "--cluster", "a100-80gb", "--gpus", "4",
            "--global-batch", "16", "--seq", "32", "--json", str(out), "--trace", str(trace),
        ]
    )  # fmt: skip
    assert code == 0
    captured = capsys.readouterr()
    printed = captured.out
    assert printed.startswith("1. pp ") and "candidates rejected" in printed
    # Progress as each profile starts (one fake forward of the whole model each).
    assert "smp.plan: profiling one rank of tensor parallelism at 2 (2 of 3)" in captured.err
    data = json.loads(out.read_text())
    assert data["plans"] and data["rejected"]
    assert data["plans"][0]["config"]["bf16"] is True  # --dtype bf16, the default
    build_config(data["plans"][0]["config"])
    events = json.loads(trace.read_text())["traceEvents"]
    assert any(e.get("ph") == "X" for e in events)
    with pytest.raises(SystemExit, match=r"no such file"):
        main(
            [
                "--model",
                str(tmp_path / "none.json"),
                "--cluster",
                "h100",
                "--global-batch",
                "8",
                "--seq",
                "8",
            ]
        )


def test_a_meta_model_plans_tensor_parallel_layouts_as_its_real_twin():
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=256, n_positions=64)
    torch.manual_seed(0)
    real = transformers.GPT2LMHeadModel(config)
    with torch.device("meta"):
        meta = transformers.GPT2LMHeadModel(config)
    ids = torch.zeros(1, 16, dtype=torch.long)
    example = {"input_ids": ids, "labels": ids}

    def ledgers(model):
        plans = plan(model, example, "h100", 8, num_devices=2, max_plans=1000)
        assert not [r for r in plans.rejected if "could not be profiled" in r.reason]
        return {
            json.dumps(p.config, sort_keys=True) + str(p.checkpointing): p.predicted["ledger"]
            for p in plans
        }

    got, expected = ledgers(meta), ledgers(real)
    assert any('"tensor_parallel_degree": 2' in key for key in got)
    assert got == expected
