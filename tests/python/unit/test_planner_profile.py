"""What the planner measures of a model (smp/planner/profile.py, memory.py; design.md §13.2):
per-module activations and ops traced under fake tensors, checked against torch's own memory
tracker, against the published full-scale figures of Korthikanti et al. 2022, and the ledger's
arithmetic."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed._tools.mem_tracker import MemTracker

from smp.planner.literature import KORTHIKANTI_FIGURE_1, MegatronLayer, full_scale_memory
from smp.planner.memory import Ledger, StateBytes, peak_in_flight
from smp.planner.profile import _same, profile_model


@pytest.mark.parametrize("name", list(KORTHIKANTI_FIGURE_1))
def test_the_ledger_of_a_traced_gpt3_layer_matches_the_published_full_scale_memory(name):
    _, h, a, _, _, _, _ = KORTHIKANTI_FIGURE_1[name]
    s, b, t = 2048, 1, 8
    row = next(r for r in full_scale_memory() if r["model"] == name)
    # The traced layer is what the paper derives for it: sbh(10 + 24/t + 5as/(ht)).
    expected = s * b * h * (10 + 24 / t + 5 * a * s / (h * t))
    assert row["layer_activation_bytes"] == pytest.approx(expected, rel=1e-3)
    assert abs(row["activations_error"]) < 0.005 and abs(row["states_error"]) < 0.005


def test_cpu_kernels_save_what_they_save_and_the_cuda_rule_what_cuda_saves():
    h, a, s = 64, 4, 32
    layer = MegatronLayer(h, a)
    x = torch.randn(s, 2, h)
    cpu = profile_model(layer, (x,), device="cpu")
    cuda = profile_model(layer, (x,), device="cuda")
    sbh = s * 2 * h
    # CPU dropout keeps an fp32 noise tensor (4 bytes an element), CUDA's a bool mask.
    assert cpu.modules["drop1"].activation_bytes == 4 * sbh
    assert cuda.modules["drop1"].activation_bytes == sbh
    assert cpu.modules["attn.drop"].activation_bytes == 4 * a * s * s * 2
    assert cuda.modules["attn.drop"].activation_bytes == a * s * s * 2
    with pytest.raises(ValueError, match=r"device is 'cpu' or 'cuda', not 'tpu'"):
        profile_model(layer, (x,), device="tpu")


class _Shared(nn.Module):
    """Three projections of one input (saved once), a tied pair of weights (counted once)."""

    def __init__(self):
        super().__init__()
        self.q, self.k, self.v = nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(16, 16)
        self.embed = nn.Embedding(10, 16)
        self.head = nn.Linear(16, 10, bias=False)
        self.head.weight = self.embed.weight
        self.drop = nn.Dropout(0.5)

    def forward(self, ids):
        x = self.embed(ids)
        y = self.q(x) * self.k(x) + self.v(x)
        return self.head(self.drop(y))


def test_shared_inputs_and_tied_weights_count_once_and_nothing_is_changed():
    model = _Shared().eval()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    ids = torch.randint(0, 10, (4, 8))
    rng = torch.random.get_rng_state()
    trace = profile_model(model, (ids,))
    x_bytes = 4 * 8 * 16 * 4
    # q saves x first; k and v save the same storage, which counts at q only.
    assert trace.modules["q"].activation_bytes == x_bytes
    assert trace.modules["k"].activation_bytes == 0 and trace.modules["v"].activation_bytes == 0
    # The product saves q(x) and k(x), in the root's own code; the ids are saved by the
    # embedding (int64).
    assert trace.modules[""].activation_bytes == 2 * x_bytes
    assert trace.modules["embed"].activation_bytes == 4 * 8 * 8
    assert trace.parameter_bytes() == (3 * (16 * 16 + 16) + 10 * 16) * 4
    assert trace.modules["head"].parameter_bytes == 0  # tied: counted at the embedding
    assert trace.traces["head"].output_bytes == 4 * 8 * 10 * 4
    assert trace.traces["q"].calls == 1
    # Not changed: eval mode, parameters, the random stream.
    assert not model.training
    assert all(torch.equal(before[n], p) for n, p in model.named_parameters())
    assert torch.equal(torch.random.get_rng_state(), rng)


def test_the_traced_activations_are_what_torchs_memory_tracker_sees_alive_after_a_real_forward():
    torch.manual_seed(0)
    model = nn.Sequential(MegatronLayer(64, 4), MegatronLayer(64, 4))
    x = torch.randn(32, 2, 64)  # the input is the caller's, saved by the first layer norm
    trace = profile_model(model, (x,))
    tracker = MemTracker()
    tracker.track_external(model)
    with tracker:
        out = model(x)
        loss = out.float().pow(2).mean()
        alive = tracker.get_tracker_snapshot("current")[torch.device("cpu")]
        loss.backward()
    # Alive after the forward: what autograd saved plus the output (unsaved, still referenced),
    # less the caller's input (not made under the tracker).
    expected = trace.activation_bytes() - x.numel() * 4 + out.numel() * 4
    assert alive["Activation"] == pytest.approx(expected, rel=0.01)
    assert alive["Parameter"] == trace.parameter_bytes()


def test_a_meta_hugging_face_llama_traces_without_memory():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=2,
        num_attention_heads=32, num_key_value_heads=32,
    )  # fmt: skip
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config).to(torch.bfloat16)
    ids = torch.zeros(1, 2048, dtype=torch.long)
    trace = profile_model(model, (), {"input_ids": ids, "labels": ids, "use_cache": False})
    assert trace.parameter_bytes() == sum(p.numel() for p in model.parameters()) * 2
    layer = trace.activation_bytes("model.layers.0")
    # The rotary tables, computed once and passed to every layer, count in each layer alone
    # (a stage holding either holds them) and once in both.
    assert layer == trace.activation_bytes("model.layers.1")
    rotary = 2 * 2048 * 128 * 2  # cos and sin, bf16
    both = trace.activation_bytes(["model.layers.0", "model.layers.1"])
    assert both == 2 * layer - rotary
    own = {
        i: sum(
            r.activation_bytes
            for n, r in trace.modules.items()
            if n.startswith(f"model.layers.{i}")
        )
        for i in (0, 1)
    }  # each storage at the first module that saved it: the tables at layer 0
    assert own[0] - own[1] == rotary
    # SDPA keeps no s × s matrix: a layer saves O(s·h) (about 35 sbh bytes with SwiGLU).
    sbh = 2048 * 4096
    assert 20 * sbh < layer < 50 * sbh
    # The head saves its input; the loss, computed in the root's own forward on fp32 logits,
    # saves their log-softmax: s·V fp32 values, as much as 1.6 layers here.
    assert trace.modules["lm_head"].activation_bytes == 2048 * 4096 * 2
    assert trace.modules[""].activation_bytes == pytest.approx(2048 * 32000 * 4, rel=1e-3)


def test_peak_in_flight_is_the_schedule_irs_simulation():
    from smp.planner.memory import _simulated_peaks

    for p in range(1, 9):
        for m in range(1, 17):
            for schedule in ("1f1b", "gpipe", "zbh1"):
                assert peak_in_flight(schedule, p, m) == _simulated_peaks(schedule, p, m, 1)
            for v in (2, 3):
                if m % p == 0:
                    expected = _simulated_peaks("interleaved", p, m, v)
                    assert peak_in_flight("interleaved", p, m, v) == expected


def test_peak_in_flight_comes_from_the_schedule_ir():
    assert peak_in_flight("1f1b", 4, 8) == [4, 3, 2, 1]
    assert peak_in_flight("gpipe", 4, 8) == [8, 8, 8, 8]
    assert peak_in_flight("1f1b", 4, 2)[0] == 2  # fewer microbatches than stages
    assert peak_in_flight("interleaved", 8, 16, 3)[0] == 8 * 3 + 8 - 1
    assert peak_in_flight("zbh1", 4, 8)[0] == 4
    with pytest.raises(ValueError, match=r"no schedule 'dualpipe'.*'interleaved'"):
        peak_in_flight("dualpipe", 4, 8)


def test_the_ledger_adds_what_a_rank_holds():
    states = StateBytes(weight=2, gradient=2, optimizer=12, optimizer_shards=4)
    assert states.per_parameter() == 2 + 2 + 3
    ledger = Ledger.of(1e9, 3e6, 4, states, reserved=1e9, other=5e8)
    assert (ledger.parameters, ledger.gradients, ledger.optimizer) == (2e9, 2e9, 3e9)
    assert ledger.activations == 12e6 and ledger.in_flight == 4
    assert ledger.total == 2e9 + 2e9 + 3e9 + 12e6 + 1e9 + 5e8
    assert ledger.as_dict()["total"] == ledger.total


def test_the_cuda_rule_keeps_attention_options_given_positionally():
    from smp.planner.profile import _CudaKernels

    q = torch.randn(1, 2, 8, 4, requires_grad=True)
    shapes = []
    with (
        torch.autograd.graph.saved_tensors_hooks(
            lambda t: shapes.append(t.shape) or t, lambda t: t
        ),
        _CudaKernels(),
    ):
        # attn_mask, dropout_p, is_causal given positionally: dropout goes, causality stays.
        out = torch.nn.functional.scaled_dot_product_attention(q, q, q, None, 0.5, True)
    assert torch.allclose(
        out, torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)
    )
    assert shapes and all(tuple(s[-2:]) != (8, 8) for s in shapes)  # no s × s matrix saved


def test_live_memory_sees_the_peak_torchs_tracker_sees():
    from smp.planner.live import LiveMemory

    torch.manual_seed(0)
    model = nn.Sequential(MegatronLayer(64, 4), MegatronLayer(64, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(32, 2, 64)

    def step():
        model(x).float().pow(2).mean().backward()
        opt.step()
        opt.zero_grad()

    step()  # the optimizer's state exists from here on
    state = [t for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    live = LiveMemory([*model.parameters(), *state])
    with live:
        step()
    tracker = MemTracker()
    tracker.track_external(model, opt)
    with tracker:
        step()
    peak = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]
    # The tracker does not count the caller's input, which the first layer norm saves.
    assert live.peak_bytes == pytest.approx(peak + x.numel() * 4, rel=1e-3)
    assert live.current_bytes < live.peak_bytes  # what the step made was freed
    live.reset_peak()
    assert live.peak_bytes == live.current_bytes


def test_a_tensor_parallel_rank_is_profiled_from_smps_own_conversion():
    transformers = pytest.importorskip("transformers")
    from smp.planner.plan import _tensor_parallel

    config = transformers.LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2,
    )  # fmt: skip
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
    ids = torch.zeros(2, 16, dtype=torch.long)
    kwargs = {"input_ids": ids, "labels": ids, "use_cache": False}
    before = [(n, p.shape) for n, p in model.named_parameters()]
    ranked, profile = _tensor_parallel(model, 2, (), kwargs, None, "cpu")
    whole = profile_model(model, (), kwargs)
    assert [(n, p.shape) for n, p in model.named_parameters()] == before  # a copy was converted
    assert ranked is not model
    # Each layer's projections and the vocabulary-split head halve; the norms stay whole.
    assert profile.parameter_bytes("model.layers.0") < 0.55 * whole.parameter_bytes(
        "model.layers.0"
    )
    assert profile.parameter_bytes("lm_head") == whole.parameter_bytes("lm_head") / 2
    # What the layer's primitives move: one all-reduce of the attention's and of the MLP's
    # output forward (b · s · h fp32), and of their inputs' gradients backward.
    layer = [
        c for name, r in profile.modules.items() if name.startswith("model.layers.0")
        for c in r.collectives
    ]  # fmt: skip
    reduced = [nbytes for name, nbytes in layer if name == "reduce_from_region"]
    assert reduced == [2 * 16 * 64 * 4] * 2
    assert whole.modules["model.layers.0"].collectives == []


def test_a_module_registered_twice_is_known_by_its_first_name():
    class Twice(nn.Module):
        def __init__(self):
            super().__init__()
            self.shared = nn.Linear(8, 8)
            self.inner = nn.Module()
            self.inner.alias = self.shared  # one module, two names (as T5's embeddings)

        def forward(self, x):
            return self.inner.alias(x)

    profile = profile_model(Twice(), (torch.randn(2, 8, requires_grad=True),))
    assert "inner.alias" not in profile.modules
    assert profile.traces["shared"].calls == 1 and profile.modules["shared"].ops


def _hf(name: str, layers: int):
    transformers = pytest.importorskip("transformers")
    small = {"vocab_size": 128}
    configs = {
        "gpt2": (transformers.GPT2Config, transformers.GPT2LMHeadModel,
                 {"n_layer": layers, "n_embd": 32, "n_head": 4, "n_positions": 32}),
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM,
                  {"num_hidden_layers": layers, "hidden_size": 32, "intermediate_size": 64,
                   "num_attention_heads": 4, "num_key_value_heads": 2}),
        # Local and global attention alternate: period 2.
        "gemma2": (transformers.Gemma2Config, transformers.Gemma2ForCausalLM,
                   {"num_hidden_layers": layers, "hidden_size": 32, "intermediate_size": 64,
                    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8}),
        # Sliding-window attention from layer 3 on: three distinct leading blocks.
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM,
                  {"num_hidden_layers": layers, "hidden_size": 32, "intermediate_size": 64,
                   "num_attention_heads": 4, "num_key_value_heads": 2,
                   "use_sliding_window": True, "max_window_layers": 3}),
        # The first block alone holds the relative position bias, and passes it to the others.
        "t5": (transformers.T5Config, transformers.T5ForConditionalGeneration,
               {"num_layers": layers, "d_model": 32, "d_ff": 64, "num_heads": 4, "d_kv": 8,
                "decoder_start_token_id": 0}),
    }  # fmt: skip
    config_class, model_class, options = configs[name]
    with torch.device("meta"):
        return model_class(config_class(**small, **options))


@pytest.mark.parametrize(
    ("name", "layers", "traced"),
    [("gpt2", 12, "4 of 12"), ("llama", 10, "4 of 10"), ("gemma2", 18, "8 of 18"),
     ("qwen2", 16, "7 of 16"), ("t5", 12, "5 of 12")],
)  # fmt: skip
def test_a_profile_traced_from_a_few_blocks_is_the_profile_of_all(name, layers, traced):
    model = _hf(name, layers)
    ids = torch.zeros(2, 16, dtype=torch.long)
    kwargs = {"input_ids": ids, "labels": ids}
    whole = profile_model(model, (), kwargs, device="cuda")
    sampled = profile_model(model, (), kwargs, device="cuda", sample=True)
    assert sampled.sampled.startswith(f"{traced} blocks"), sampled.sampled
    assert not whole.sampled
    # Every module's parameters, saved bytes, ops and collectives; every saved storage with
    # its owners; the partitioner's traces (call order included).
    assert _same(sampled, whole)
    assert sampled.parameter_bytes() == whole.parameter_bytes()
    assert sampled.activation_bytes() == whole.activation_bytes()
    assert len(list(model.parameters())) > 0 and sum(1 for _ in model.modules()) == len(
        sampled.modules
    )  # the model is whole again


def test_blocks_are_all_traced_where_the_evidence_for_sampling_is_missing():
    class Stack(nn.Module):
        def __init__(self, blocks, scale_each=False):
            super().__init__()
            self.blocks = nn.ModuleList(blocks)
            self.scale_each = scale_each

        def forward(self, x):
            for block in self.blocks:
                x = block(x)
                if self.scale_each:  # the parent's own work per block
                    x = x * 1.5
            return x.sum()

    x = torch.randn(4, 8, requires_grad=True)
    one = nn.Linear(8, 8)
    cases = {
        "holds one module more than once": Stack([one] * 10),
        "do not repeat": Stack([nn.Linear(8, 8, bias=i % 5 == 0) for i in range(10)]),
        "differs from the trace": Stack([nn.Linear(8, 8) for _ in range(10)], scale_each=True),
        "no nn.ModuleList of 8 or more": Stack([nn.Linear(8, 8) for _ in range(7)]),
    }
    for why, model in cases.items():
        sampled = profile_model(model, (x,), sample=True)
        assert sampled.sampled.startswith("every block traced") and why in sampled.sampled
        assert _same(sampled, profile_model(model, (x,)))
    # The same stack without the parent's per-block work samples.
    plain = Stack([nn.Linear(8, 8) for _ in range(10)])
    sampled = profile_model(plain, (x,), sample=True)
    assert sampled.sampled.startswith("4 of 10 blocks") and _same(
        sampled, profile_model(plain, (x,))
    )


def test_a_tensor_parallel_rank_samples_as_the_whole_model_does():
    from smp.planner.plan import _tensor_parallel

    model = _hf("llama", 10)
    ids = torch.zeros(2, 16, dtype=torch.long)
    kwargs = {"input_ids": ids, "labels": ids}
    _, whole = _tensor_parallel(model, 2, (), kwargs, None, "cuda", False)
    _, sampled = _tensor_parallel(model, 2, (), kwargs, None, "cuda", True)
    assert sampled.sampled.startswith("4 of 10 blocks")
    assert _same(sampled, whole)
    assert any(r.collectives for r in sampled.modules.values())


def test_a_stage_sends_the_values_that_flow_between_its_modules_and_another_stages():
    class Chain(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList(nn.Linear(16, 16) for _ in range(4))
            self.head = nn.Linear(16, 32)

        def forward(self, x, y):
            for block in self.blocks:
                x = torch.relu(block(x))  # the root's op on a block's value runs with the block
            return nn.functional.cross_entropy(self.head(x), y)  # and the loss with the head

    batch = 4
    x, y = torch.randn(batch, 16, requires_grad=True), torch.randint(0, 32, (batch,))
    profile = profile_model(Chain(), (x, y))
    stages = {"": 0, "blocks": 0, "blocks.0": 0, "blocks.1": 0, "blocks.2": 1, "blocks.3": 1}
    stages["head"] = 1
    # Between the stages: block 1's output into block 2 and its gradient back (fp32), and the
    # targets into the loss on the head's stage (int64, no gradient); the head's output, which
    # the loss reads on its own stage, stays there but is kept for its backward (a call from
    # stage 0). Not the input x (stage 0 reads it), not the logits' way back to the root.
    crossing = 2 * batch * 16 * 4 + batch * 8
    served = [c.output_bytes for name in ("blocks.2", "blocks.3", "head")
              for c in profile.traces[name].callers.values()]  # fmt: skip
    assert profile.message_bytes(stages, 2) == [crossing, crossing + sum(served)]
    assert sum(served) == batch * 16 * 4 * 2 + batch * 32 * 4
    # One stage: nothing crosses.
    assert profile.message_bytes(dict.fromkeys(stages, 0), 1) == [0]
