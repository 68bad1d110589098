"""``smp.save_checkpoint`` / ``smp.resume_from_checkpoint``: exact resume on the same layout,
resharding across layouts, the full (torch.load-able) form, and named errors for damaged
checkpoints.

- Exact resume: the demo GPT with dropout at pp 2 x tp 2, AdamW, resumed by a fresh model
  (before its first step partitions it): the next losses are bit-identical to the run that
  went on, and the TP group's replicated parameters stay identical.
- Resharding: one run moves through six layouts (pp 2 x tp 2 -> tp 2 x dp 2 -> pp 4 -> one
  process -> pp 2 x tp 2 -> pp 2 x dp 2), three AdamW steps on each, each resuming the previous
  one's checkpoint; every loss and the final parameters match one process training straight
  through, every rank with its own share of each global batch.
- Damage: truncated, corrupted and missing files, a missing manifest, a missing tag, the wrong
  ``partial`` and a model of another shape each give a CheckpointError naming the file or key,
  on every rank; ``num_kept_partial_checkpoints`` keeps the newest complete ones.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch
from model import GPT, lm_loss
from models import gpt_train_step, parity_adamw, split_gpt_blocks, tiny_gpt_config

BATCH = 8  # global samples per step: every layout's data-parallel ranks divide it
TOL = dict(rtol=2e-4, atol=2e-5)


def _gpt(layers: int = 2, dropout: float = 0.0, seed: int = 0, **config):
    torch.manual_seed(seed)
    cfg = dataclasses.replace(tiny_gpt_config(), n_layer=layers, dropout=dropout, **config)
    return GPT(cfg)


def _global_batch(step: int):
    cfg = tiny_gpt_config()
    g = torch.Generator().manual_seed(4242 + step)
    tokens = torch.randint(0, cfg.vocab_size, (BATCH, cfg.block_size + 1), generator=g)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def _my_share(smp, step: int):
    x, y = _global_batch(step)
    n, r = smp.dp_size(), smp.dp_rank()  # TP ranks bring their own samples too
    per = BATCH // n
    return x[r * per : (r + 1) * per], y[r * per : (r + 1) * per]


def _wrap(smp, module, tp: int):
    if tp > 1:
        split_gpt_blocks(smp, module)
    model = smp.DistributedModel(module)
    return model, smp.DistributedOptimizer(parity_adamw(model.parameters()))


def _replicated_equal_across_tp(smp, model) -> bool:
    import torch.distributed as dist

    state = smp.state.get_state()
    same = True
    for p in model.local_parameters():
        if getattr(p, "_smp_tp_split", None) is None and smp.tp_size() > 1:
            copies = [torch.empty_like(p) for _ in range(smp.tp_size())]
            dist.all_gather(copies, p.detach().contiguous(), group=state.groups["tp"])
            same &= all(torch.equal(c, copies[0]) for c in copies)
    return same


# ---- exact resume ------------------------------------------------------------------------------


def _exact_worker(directory: str):
    import smp

    smp.init({"pipeline_parallel_degree": 2, "tensor_parallel_degree": 2, "microbatches": 2})
    model, optimizer = _wrap(smp, _gpt(dropout=0.1), tp=2)
    train_step = gpt_train_step(smp)

    def train(model, optimizer, first: int, last: int) -> list[float]:
        losses = []
        for step in range(first, last):
            optimizer.zero_grad()
            losses.append(train_step(model, *_my_share(smp, step)).reduce_mean().item())
            optimizer.step()
        return losses

    train(model, optimizer, 0, 2)
    smp.save_checkpoint(directory, "step_2", user_content={"step": 2, "epoch": 0})
    expected = train(model, optimizer, 2, 5)
    replicated_ok = _replicated_equal_across_tp(smp, model)

    # A fresh job's view: other weights, a fresh optimizer, resumed before the first step.
    fresh, fresh_optimizer = _wrap(smp, _gpt(dropout=0.1, seed=7), tp=2)
    content = smp.resume_from_checkpoint(directory)
    resumed = train(fresh, fresh_optimizer, content["step"], 5)
    same_params = all(
        torch.equal(a, b)
        for a, b in zip(model.local_parameters(), fresh.local_parameters(), strict=True)
    )
    return content, expected, resumed, replicated_ok, same_params


def test_resume_is_exact_with_dropout_at_pp2_tp2(pools, tmp_path):
    for content, expected, resumed, replicated_ok, same_params in pools.run(
        4, _exact_worker, str(tmp_path), timeout_s=300
    ):
        assert content == {"step": 2, "epoch": 0}
        assert resumed == expected  # bit-identical losses: RNG, TP generators, AdamW state
        assert same_params
        assert replicated_ok  # the TP group's replicated parameters never drift apart
    assert (tmp_path / "newest").read_text() == "step_2"
    manifest = json.loads((tmp_path / "step_2" / "smp_checkpoint.json").read_text())
    assert manifest["layout"] == {"pp": 2, "tp": 2, "dp": 1, "world": 4}
    assert {".metadata", "rng.pt", "user_content.pt"} <= set(manifest["files"])
    on_disk = {p.name for p in (tmp_path / "step_2").iterdir()} - {"smp_checkpoint.json"}
    assert on_disk == set(manifest["files"])
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no leftovers


# ---- resharding --------------------------------------------------------------------------------

LAYOUTS = {
    "pp2_tp2": (4, dict(pipeline_parallel_degree=2, tensor_parallel_degree=2)),
    "tp2_dp2": (4, dict(tensor_parallel_degree=2)),
    "pp4": (4, dict(pipeline_parallel_degree=4)),
    "one": (1, {}),
    "pp2_dp2": (4, dict(pipeline_parallel_degree=2)),
}
CHAIN = ["pp2_tp2", "tp2_dp2", "pp4", "one", "pp2_tp2", "pp2_dp2"]
SEGMENT = 3  # steps run at each layout
LAYERS = 4


def _segment_worker(directory: str, layout: str, index: int):
    import smp

    config = dict(LAYOUTS[layout][1])
    smp.init({**config, "microbatches": 2})
    tp = config.get("tensor_parallel_degree", 1)
    # Resumed segments start from other weights: the checkpoint must replace them.
    model, optimizer = _wrap(smp, _gpt(LAYERS, seed=0 if index == 0 else 100 + index), tp)
    if index > 0:
        assert smp.resume_from_checkpoint(directory) == {"next": index * SEGMENT}
    train_step = gpt_train_step(smp)
    losses = []
    for step in range(index * SEGMENT, (index + 1) * SEGMENT):
        optimizer.zero_grad()
        loss = train_step(model, *_my_share(smp, step)).reduce_mean().item()
        losses.append(sum(smp.allgather(loss, smp.DP_GROUP)) / smp.dp_size())
        optimizer.step()
    smp.save_checkpoint(
        directory, f"{layout}_{index}", user_content={"next": (index + 1) * SEGMENT}
    )
    full = model.state_dict()
    return losses, (full if smp.rank() == 0 else None)


def _reference(steps: int):
    model = _gpt(LAYERS)
    optimizer = parity_adamw(model.parameters())
    losses = []
    for step in range(steps):
        optimizer.zero_grad()
        x, y = _global_batch(step)
        loss = lm_loss(model(x), y)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses, model.state_dict()


def test_checkpoints_reshard_across_six_layouts(pools, tmp_path):
    expected_losses, expected_state = _reference(SEGMENT * len(CHAIN))
    for index, layout in enumerate(CHAIN):
        results = pools.run(
            LAYOUTS[layout][0], _segment_worker, str(tmp_path), layout, index, timeout_s=300
        )
        losses, full = results[0]
        want = expected_losses[index * SEGMENT : (index + 1) * SEGMENT]
        torch.testing.assert_close(losses, want, **TOL, msg=lambda m, lay=layout: f"{lay}: {m}")
        for key, value in expected_state.items() if index == len(CHAIN) - 1 else ():
            torch.testing.assert_close(full[key], value, **TOL, msg=lambda m, k=key: k + m)
    assert (tmp_path / "newest").read_text() == f"{CHAIN[-1]}_{len(CHAIN) - 1}"


# ---- the full form -----------------------------------------------------------------------------


def _full_worker(directory: str, layout: str):
    from models import tiny_hf_model

    import smp

    config = dict(LAYOUTS[layout][1])
    smp.init({**config, "microbatches": 2})
    torch.manual_seed(3)
    module = tiny_hf_model("llama", 64, 8, use_cache=False)
    if config.get("tensor_parallel_degree", 1) > 1:
        smp.set_tensor_parallelism(module)  # the whole model, as SMP scripts mark it
    model = smp.DistributedModel(module)
    optimizer = smp.DistributedOptimizer(parity_adamw(model.parameters()))

    @smp.step
    def train_step(model, ids):
        loss = model(input_ids=ids, labels=ids)["loss"]
        model.backward(loss)
        return loss

    ids = torch.randint(0, 64, (4, 8), generator=torch.Generator().manual_seed(smp.dp_rank()))
    if layout == "pp2_tp2":
        optimizer.zero_grad()
        train_step(model, ids)
        optimizer.step()
        smp.save_checkpoint(directory, "full", partial=False, user_content="hf")
    else:  # another layout resumes the full checkpoint
        assert smp.resume_from_checkpoint(directory, partial=False) == "hf"
        train_step(model, ids)  # partitions; the state is loaded right after
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
    return state if smp.rank() == 0 else None


def test_full_checkpoint_loads_into_the_plain_hf_model_and_another_layout(pools, tmp_path):
    from models import tiny_hf_model

    saved = pools.run(4, _full_worker, str(tmp_path), "pp2_tp2", timeout_s=300)[0]
    plain = tiny_hf_model("llama", 64, 8, use_cache=False)
    state = torch.load(tmp_path / "full" / "model.pt")  # plain torch, original keys and shapes
    plain.load_state_dict(state)
    for key, value in plain.state_dict().items():
        assert torch.equal(value, saved["model"][key]), key
    resumed = pools.run(4, _full_worker, str(tmp_path), "pp2_dp2", timeout_s=300)[0]
    for key, value in saved["model"].items():
        assert torch.equal(resumed["model"][key], value), key
    for index, entry in saved["optimizer"]["state"].items():
        for name, value in entry.items():
            assert torch.equal(resumed["optimizer"]["state"][index][name], value), (index, name)


# ---- damage ------------------------------------------------------------------------------------


def _damage_worker(directory: str):
    import smp

    smp.init({"tensor_parallel_degree": 2, "microbatches": 2, "fp16": True})
    model, _ = _wrap(smp, _gpt(), tp=2)
    optimizer = smp.DistributedOptimizer(
        torch.optim.AdamW(model.parameters(), lr=1e-3),
        dynamic_loss_scale=True,
        dynamic_loss_args={"init_scale": 2.0**8},
    )
    train_step = gpt_train_step(smp)
    for step in range(2):
        optimizer.zero_grad()
        train_step(model, *_my_share(smp, step))
        optimizer.step()
    optimizer._smp_scaler.scale = 64.0  # as after overflows: the scale must come back
    root = Path(directory)
    for tag in ("a", "b", "c", "d"):
        smp.save_checkpoint(directory, tag, num_kept_partial_checkpoints=2)
    smp.save_checkpoint(directory, "d")  # an existing tag is replaced once the new one is whole
    kept = sorted(p.name for p in root.iterdir())

    # The loss scale comes back with the optimizer state.
    optimizer._smp_scaler.scale = 1.0
    smp.resume_from_checkpoint(directory)
    scale = optimizer.loss_scale

    def attempt(**kwargs) -> str:
        try:
            smp.resume_from_checkpoint(directory, **kwargs)
        except smp.CheckpointError as exc:
            return str(exc)
        return "no error"

    def damaged(name: str, damage, **kwargs) -> str:
        file = root / "d" / name
        if smp.rank() == 0:
            original = file.read_bytes()
            damage(file)
        smp.barrier()
        message = attempt(**kwargs)
        smp.barrier()
        if smp.rank() == 0:
            file.write_bytes(original)
        smp.barrier()
        return message

    def flip(file: Path) -> None:
        data = bytearray(file.read_bytes())
        data[len(data) // 2] ^= 0xFF
        file.write_bytes(bytes(data))

    messages = {
        "truncated": damaged("__1_0.distcp", lambda f: f.write_bytes(f.read_bytes()[:-10])),
        "corrupted": damaged("__0_0.distcp", flip),
        "missing": damaged(".metadata", lambda f: f.unlink()),
        "incomplete": damaged("smp_checkpoint.json", lambda f: f.unlink()),
        "no tag": attempt(tag="zzz"),
        "full": attempt(partial=False),
    }
    # A model of another shape: the named key and both shapes.
    other = smp.DistributedModel(_gpt(n_embd=64))
    other_optimizer = smp.DistributedOptimizer(torch.optim.AdamW(other.parameters()))
    messages["shape"] = attempt()
    del other_optimizer
    return kept, scale, messages


def test_damaged_checkpoints_give_named_errors_on_every_rank(pools, tmp_path):
    for kept, scale, messages in pools.run(2, _damage_worker, str(tmp_path), timeout_s=300):
        assert kept == ["c", "d", "newest"]  # num_kept_partial_checkpoints=2
        assert scale == 64.0
        d = tmp_path / "d"
        assert messages["truncated"].startswith(
            f"checkpoint {d}: {d / '__1_0.distcp'} is truncated"
        )
        assert f"{d / '__0_0.distcp'} is corrupted: bytes " in messages["corrupted"]
        assert "have CRC-32C 0x" in messages["corrupted"]
        assert f"{d / '.metadata'} is missing" in messages["missing"]
        assert "is incomplete: smp_checkpoint.json is missing" in messages["incomplete"]
        assert messages["no tag"] == f"checkpoint {tmp_path / 'zzz'} does not exist"
        assert (
            "is a partial checkpoint; call resume_from_checkpoint with partial=True"
            in (messages["full"])
        )
        assert "does not match the model" in messages["shape"]
        assert "model/wte.weight: saved (64, 32), this model (64, 64)" in (messages["shape"])
