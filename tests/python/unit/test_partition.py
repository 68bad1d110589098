"""Tracing, node building and plans on real torch models, in one process."""

from __future__ import annotations

import pytest
import torch
from model import GPT  # examples/gpt
from models import tiny_gpt_config
from torch import nn

import smp
from smp.partitioning.plan import CrossingCosts
from smp.partitioning.trace import trace_modules


class Bert(nn.Module):
    """BERT-shaped: embeddings, an encoder wrapping a ModuleList of layers, a pooler, and a module
    that is defined but never called."""

    def __init__(self, vocab=100, d=32, layers=6):
        super().__init__()
        self.embeddings = nn.ModuleDict(
            {"word": nn.Embedding(vocab, d), "pos": nn.Embedding(16, d)}
        )
        self.encoder = nn.Module()
        self.encoder.layer = nn.ModuleList(
            nn.TransformerEncoderLayer(d, 2, 4 * d, dropout=0.0, batch_first=True)
            for _ in range(layers)
        )
        self.pooler = nn.Linear(d, d)
        self.unused_head = nn.Linear(d, 1000)  # never called: placed with its parent

    def forward(self, ids, mask):
        x = self.embeddings["word"](ids) + self.embeddings["pos"](torch.arange(ids.shape[1]))
        for layer in self.encoder.layer:
            x = layer(x, src_key_padding_mask=~mask)
        return torch.tanh(self.pooler(x[:, 0]))


class Reuse(nn.Module):
    """A block called twice per forward, a data-dependent branch, and a Python loop."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(8, 64)
        self.shared = nn.Linear(64, 64)
        self.pos = nn.Linear(64, 64)
        self.neg = nn.Linear(64, 64)
        self.out = nn.Linear(64, 2)

    def forward(self, x):
        h = self.shared(self.shared(torch.relu(self.inp(x))))
        h = self.pos(h) if h.sum() > 0 else self.neg(h)
        for _ in range(int(x.abs().sum().item()) % 3 + 1):
            h = torch.relu(h)
        return self.out(h)


def _gpt():
    torch.manual_seed(0)
    return GPT(tiny_gpt_config())


def _ids(batch=2):
    cfg = tiny_gpt_config()
    return torch.randint(0, cfg.vocab_size, (batch, cfg.block_size))


def test_trace_records_order_calls_bytes_and_flops():
    model = Reuse()
    x = torch.randn(4, 8)
    traces = trace_modules(model, lambda: model(x))
    assert traces["inp"].first_call < traces["shared"].first_call < traces["out"].first_call
    assert traces["shared"].calls == 2 and traces["inp"].calls == 1
    assert traces["shared"].output_bytes == 2 * 4 * 64 * 4
    # addmm of (4, 64) x (64, 64): 2·4·64·64 FLOPs per call
    assert traces["shared"].flops == pytest.approx(2 * 2 * 4 * 64 * 64)
    taken = "pos" if traces["pos"].calls else "neg"
    assert traces["neg" if taken == "pos" else "pos"].first_call is None
    assert traces[""].calls == 1


def test_tracing_does_not_change_rng_or_buffers():
    model = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.5), nn.BatchNorm1d(4))
    model.train()
    x = torch.randn(8, 4)
    before = model[2].running_mean.clone()
    torch.manual_seed(3)
    trace_modules(model, lambda: model(x))
    after_trace = torch.rand(3)
    torch.manual_seed(3)
    expected = torch.rand(3)
    torch.testing.assert_close(after_trace, expected)
    torch.testing.assert_close(model[2].running_mean, before)
    assert model[2].num_batches_tracked.item() == 0


def test_tracing_failure_names_the_module():
    class Broken(nn.Module):
        def __init__(self):
            super().__init__()
            self.ok = nn.Linear(4, 4)
            self.bad = nn.Linear(5, 4)

        def forward(self, x):
            return self.bad(self.ok(x))

    with pytest.raises(RuntimeError, match=r"in module 'bad'"):
        smp.plan_partition(Broken(), torch.randn(2, 4), 2)


@pytest.mark.parametrize("stages", [2, 4])
def test_gpt_tied_embeddings_land_together_and_blocks_are_contiguous(stages):
    plan = smp.plan_partition(_gpt(), _ids(), stages)
    a = plan.assignment
    assert a["wte"] == a["lm_head"]
    assert set(a) == {name for name, _ in _gpt().named_modules()}
    block_stages = [a[f"h.{i}"] for i in range(tiny_gpt_config().n_layer)]
    assert block_stages == sorted(block_stages)
    assert set(range(stages)) == set(a.values())  # every stage holds something
    for i in range(tiny_gpt_config().n_layer):  # a block's submodules follow it unless split
        assert a[f"h.{i}.attn"] in range(stages)
    assert plan.imbalance >= 1.0
    report = plan.report()
    assert f"{stages} stages" in report and "imbalance" in report


def test_bert_with_pooler_and_unused_module():
    model = Bert()
    ids = torch.randint(0, 100, (2, 16))
    mask = torch.ones(2, 16, dtype=torch.bool)
    plan = smp.plan_partition(model, (ids, mask), 4)
    a = plan.assignment
    assert a["unused_head"] == a[""]  # placed with its parent, the root
    layers = [a[f"encoder.layer.{i}"] for i in range(6)]
    assert layers == sorted(layers) and len(set(layers)) >= 3
    assert a["pooler"] == max(a.values())


def test_module_called_twice_and_branching_model():
    model = Reuse()
    plan = smp.plan_partition(model, torch.randn(4, 8), 2)
    assert set(plan.assignment.values()) == {0, 1}
    assert plan.assignment["inp"] <= plan.assignment["out"]


def test_manual_pins_are_honoured():
    with smp.partition(1):
        head = nn.Linear(64, 2)
    model = Reuse()
    model.out = head
    smp.set_partition(model.inp, 1)
    plan = smp.plan_partition(model, torch.randn(4, 8), 2)
    assert plan.assignment["out"] == 1 and plan.assignment["inp"] == 1


def test_partition_context_nests_innermost_wins():
    with smp.partition(2):
        outer = nn.Sequential(nn.Linear(2, 2))
        with smp.partition(0):
            inner = nn.Linear(2, 2)
        outer.append(inner)
    from smp.partitioning.trace import _pin_of

    assert _pin_of(outer) == 2 and _pin_of(outer[0]) == 2 and _pin_of(inner) == 0
    assert _pin_of(nn.Linear(2, 2)) is None  # contexts are gone
    with pytest.raises(ValueError, match="int >= 0"), smp.partition(-1):
        pass


def test_manual_partition_without_auto():
    with smp.partition(1):
        tail = nn.Linear(4, 4)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), tail)
    plan = smp.plan_partition(
        model, torch.randn(2, 4), 2, auto_partition=False, default_partition=0
    )
    assert plan.assignment == {"": 0, "0": 0, "1": 0, "2": 1}


def test_pin_out_of_range_names_the_module():
    model = Reuse()
    smp.set_partition(model.pos, 3)
    with pytest.raises(ValueError, match=r"'pos'.*stage 3.*pipeline_parallel_degree is 2"):
        smp.plan_partition(model, torch.randn(4, 8), 2)


def test_too_many_stages_names_the_largest_modules():
    model = nn.Sequential(nn.Linear(4, 400), nn.Linear(400, 4))
    with pytest.raises(ValueError, match=r"smaller pipeline_parallel_degree|smp.partition"):
        smp.plan_partition(model, torch.randn(2, 4), 8)


def test_skip_tracing_partitions_without_running_the_model():
    class Unrunnable(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList(nn.Linear(16, 16) for _ in range(8))

        def forward(self, x):
            raise AssertionError("must not run")

    plan = smp.plan_partition(Unrunnable(), None, 4, skip_tracing=True)
    stages = [plan.assignment[f"layers.{i}"] for i in range(8)]
    assert stages == [0, 0, 1, 1, 2, 2, 3, 3]


def test_unknown_config_key_gets_did_you_mean():
    with pytest.raises(ValueError, match="did you mean"):
        smp.plan_partition(Reuse(), torch.randn(4, 8), 2, memory_weigth=0.5)


def test_report_collapses_block_runs():
    plan = smp.plan_partition(_gpt(), _ids(), 2)
    from smp.partitioning.plan import _collapse_numbered

    assert _collapse_numbered(["h.0", "h.1", "h.2", "ln_f"]) == ["h.0–h.2", "ln_f"]
    assert _collapse_numbered(["h.0", "h.2"]) == ["h.0", "h.2"]
    assert "stage" in plan.report()


# ---- crossings ----------------------------------------------------------------------------------


def test_trace_records_callers_and_argument_bytes():
    model = Reuse()
    x = torch.randn(4, 8)
    traces = trace_modules(model, lambda: model(x))
    root = traces[""].callers
    assert list(root) == [None]  # called by the code outside the model
    assert root[None].calls == 1 and root[None].input_bytes == 4 * 8 * 4
    assert root[None].output_bytes == 4 * 2 * 4
    shared = traces["shared"].callers
    assert list(shared) == [""]  # both calls made by the root's forward
    assert shared[""].calls == 2
    assert shared[""].input_bytes == shared[""].output_bytes == 2 * 4 * 64 * 4
    assert shared[""].input_grad_bytes == shared[""].output_grad_bytes == 2 * 4 * 64 * 4
    assert traces["shared"].input_bytes == 2 * 4 * 64 * 4


class _ByHand(nn.Module):
    """The root (stage 0) calls an embedding (stage 1) once and a linear layer (stage 1) twice."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(10, 16)
        self.a = nn.Linear(16, 16)
        self.b = nn.Linear(16, 4)

    def forward(self, ids):
        h = torch.relu(self.a(self.embed(ids)))
        return self.b(h) + self.b(h)


def test_report_counts_crossings_and_bytes_by_hand():
    model = _ByHand()
    smp.set_partition(model, 0)
    smp.set_partition(model.embed, 1)
    smp.set_partition(model.b, 1)
    ids = torch.zeros(2, 3, dtype=torch.long)
    plan = smp.plan_partition(model, ids, 2)
    assert plan.assignment == {"": 0, "embed": 1, "a": 0, "b": 1}
    # embed: ids out (2·3 int64 = 48 B), (2, 3, 16) float32 back (384 B); backward: only the
    # float output's gradient (384 B). b, twice: (2, 3, 16) out (384 B), (2, 3, 4) back (96 B);
    # backward the same. Calls a (stage 0 from stage 0) and the root (from the step function,
    # on stage 0) do not cross.
    (link,) = plan.links
    assert link.stages == (0, 1)
    assert link.calls == 3
    assert link.forward_bytes == (48 + 384) + 2 * (384 + 96) == 1392
    assert link.backward_bytes == 384 + 2 * (384 + 96) == 1344
    costs = CrossingCosts()
    assert link.seconds == pytest.approx(2 * 3 * costs.latency_s + (1392 + 1344) / costs.bandwidth)
    assert plan.crossings_priced
    assert plan.stage_crossing_cost[0] == pytest.approx(plan.stage_crossing_cost[1])
    assert plan.stage_crossing_cost[0] > 0
    assert plan.max_stage_load == pytest.approx(
        max(c + x for c, x in zip(plan.stage_cost, plan.stage_crossing_cost))
    )
    report = plan.report()
    assert "stages 0-1: 3 calls, forward 1.4 KiB, backward 1.3 KiB" in report
    # Unpriced: the same crossings, reported, cost nothing.
    free = smp.plan_partition(model, ids, 2, crossing_costs=CrossingCosts(priced=False))
    assert free.links == plan.links and free.stage_crossing_cost == [0.0, 0.0]
    assert "not priced" in free.report()


def _tiny_llama(layers: int):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=172,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=4,
    )
    return transformers.LlamaForCausalLM(config)


def _layers_cut(plan, layers: int) -> list[int]:
    """Decoder layers whose modules are not all on one stage."""
    cut = []
    for i in range(layers):
        prefix = f"model.layers.{i}"
        stages = {
            s for path, s in plan.assignment.items() if path.split(".")[:3] == prefix.split(".")
        }
        if len(stages) > 1:
            cut.append(i)
    return cut


@pytest.mark.parametrize("layers", [4, 6, 8])
@pytest.mark.parametrize("stages", [2, 4])
def test_hugging_face_llama_is_not_cut_inside_a_decoder_layer(layers, stages):
    model = _tiny_llama(layers)
    ids = torch.randint(0, 128, (2, 16))
    plan = smp.plan_partition(model, ids, stages)
    assert _layers_cut(plan, layers) == []
    layer_stages = [plan.assignment[f"model.layers.{i}"] for i in range(layers)]
    assert layer_stages == sorted(layer_stages)
    assert set(plan.assignment.values()) == set(range(stages))
    # What it saves: ignoring crossings, the same model is cut inside layers with more calls
    # crossing, and its largest stage load (crossings priced) is higher.
    free = smp.plan_partition(model, ids, stages, crossing_costs=CrossingCosts(priced=False))
    if _layers_cut(free, layers):
        assert sum(link.calls for link in free.links) > sum(link.calls for link in plan.links)
