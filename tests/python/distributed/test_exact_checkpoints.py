"""Checkpoints: no silent wrong numbers, no lost or corrupted files, no code run
from a checkpoint.

- Order: the DistributedOptimizer created before or after ``smp.resume_from_checkpoint``, from a
  partial and from a full checkpoint, at pp 2 and at dp 2 (every rank its own data): the losses,
  the parameters after the resumed steps and AdamW's step count equal those of the run that went
  on; with ``load_optimizer=False`` the optimizer state is not taken; a training step with the
  state taken by no DistributedOptimizer fails on every rank.
- ``smp.save(..., partial=False)`` on several ranks at once: every file is one writer's whole file.
- Pruning follows the save order when the clock steps back; every rename smp does is followed by
  an fsync of its directory.
- Trust: a checkpoint's files load with ``weights_only=True`` (a user type is refused by name
  until allowed), and a crafted ``user_content.pt``, ``rng.pt``, ``optimizer.pt``, DCP
  ``.metadata`` or DCP byte item runs no code.
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
import pickle
import signal
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest
import torch
from model import GPT
from models import gpt_train_step, parity_adamw, tiny_gpt_config

BATCH = 8
SAVED, END = 3, 6  # steps before the checkpoint; the last step
LAYOUTS = {"pp2": {"pipeline_parallel_degree": 2}, "dp2": {}}
# Not bitwise: two identical pp 2 runs already differ by a few ulp in the parameters (seen up to
# 7e-9; the pipeline's gradient sums are not bit-reproducible run to run), which AdamW (eps 1e-6)
# may amplify. Optimizer state not loaded moves the parameters by ~lr = 1e-3 at the first step.
TIGHT = dict(rtol=1e-6, atol=1e-6)


def _gpt(seed: int):
    torch.manual_seed(seed)
    return GPT(dataclasses.replace(tiny_gpt_config(), dropout=0.1))


def _my_share(smp, step: int):
    cfg = tiny_gpt_config()
    g = torch.Generator().manual_seed(4242 + step)
    tokens = torch.randint(0, cfg.vocab_size, (BATCH, cfg.block_size + 1), generator=g)
    n, r = smp.dp_size(), smp.dp_rank()
    per = BATCH // n
    return tokens[r * per : (r + 1) * per, :-1], tokens[r * per : (r + 1) * per, 1:]


def _train(smp, train_step, model, optimizer, first: int, last: int) -> list[float]:
    losses = []
    for step in range(first, last):
        optimizer.zero_grad()
        losses.append(train_step(model, *_my_share(smp, step)).reduce_mean().item())
        optimizer.step()
    return losses


def _outcome(model, optimizer, losses):
    params = [p.detach().clone() for p in model.local_parameters()]
    steps = sorted({float(entry["step"]) for entry in optimizer.state.values()})
    return losses, params, steps


# ---- the optimizer created before or after resume_from_checkpoint -----------------------------


def _resumed(smp, train_step, directory: str, tag: str, order: str, **options):
    """A fresh job's run from checkpoint ``tag``, its optimizer created ``order`` the resume.
    At dp 2 (the model partitioned already) "after" takes the state the resume held; at pp 2
    the state loads at the first step, by which time the optimizer exists."""
    model = smp.DistributedModel(_gpt(seed=7))  # other weights: the checkpoint replaces them

    def make():
        return smp.DistributedOptimizer(parity_adamw(model.parameters()))

    optimizer = make() if order == "before" else None
    content = smp.resume_from_checkpoint(directory, tag=tag, partial=tag == "partial", **options)
    if optimizer is None:
        optimizer = make()
    return _outcome(model, optimizer, _train(smp, train_step, model, optimizer, content, END))


def _order_worker(directory: str, layout: str):
    import smp

    smp.init({**LAYOUTS[layout], "microbatches": 2})
    train_step = gpt_train_step(smp)
    model = smp.DistributedModel(_gpt(seed=0))
    optimizer = smp.DistributedOptimizer(parity_adamw(model.parameters()))
    _train(smp, train_step, model, optimizer, 0, SAVED)
    smp.save_checkpoint(directory, "partial", user_content=SAVED)
    smp.save_checkpoint(directory, "full", partial=False, user_content=SAVED)
    expected = _outcome(model, optimizer, _train(smp, train_step, model, optimizer, SAVED, END))
    got = {
        (tag, order): _resumed(smp, train_step, directory, tag, order)
        for tag in ("partial", "full")
        for order in ("before", "after")
    }
    for tag in ("partial", "full"):  # the optimizer's state is not held for it either
        got[(tag, "not loaded")] = _resumed(
            smp, train_step, directory, tag, "after", load_optimizer=False
        )
    # A checkpoint saved with no DistributedOptimizer holds no optimizer state: a job resuming
    # it trains with an optimizer smp does not wrap, and nothing is held or refused.
    bare = smp.DistributedModel(_gpt(seed=3))
    train_step(bare, *_my_share(smp, 0))
    bare_directory = os.path.join(directory, "bare")
    smp.save_checkpoint(bare_directory, "partial")
    smp.save_checkpoint(bare_directory, "full", partial=False)
    for tag in ("partial", "full"):
        model = smp.DistributedModel(_gpt(seed=7))
        smp.resume_from_checkpoint(bare_directory, tag=tag, partial=tag == "partial")
        torch.optim.SGD(model.parameters(), lr=0.1)
        try:
            train_step(model, *_my_share(smp, SAVED))
            got[(tag, "no optimizer state")] = None
        except Exception as exc:  # noqa: BLE001 - the message is the result
            got[(tag, "no optimizer state")] = str(exc)
    # No DistributedOptimizer ever takes the state: the training step refuses to run (last: the
    # failed step leaves this job's runtime unusable).
    model = smp.DistributedModel(_gpt(seed=7))
    smp.resume_from_checkpoint(directory, tag="partial")
    torch.optim.SGD(model.parameters(), lr=0.1)  # one smp does not wrap
    try:
        train_step(model, *_my_share(smp, SAVED))
        got["untaken"] = None
    except Exception as exc:  # noqa: BLE001 - the message is the result
        got["untaken"] = str(exc)
    return expected, got


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_resume_is_exact_whether_the_optimizer_is_created_before_or_after(pools, tmp_path, layout):
    for (losses, params, steps), got in pools.run(
        2, _order_worker, str(tmp_path), layout, timeout_s=300
    ):
        assert steps == [float(END)]
        for key in [(tag, order) for tag in ("partial", "full") for order in ("before", "after")]:
            resumed_losses, resumed_params, resumed_steps = got[key]
            torch.testing.assert_close(
                resumed_losses, losses, **TIGHT, msg=lambda m, k=key: f"{k}{m}"
            )
            assert resumed_steps == steps, key  # AdamW's step counter went on from SAVED
            for a, b in zip(resumed_params, params, strict=True):
                torch.testing.assert_close(a, b, **TIGHT, msg=lambda m, k=key: f"{k}: {m}")
        for tag in ("partial", "full"):
            fresh_losses, _, fresh_steps = got[(tag, "not loaded")]
            assert fresh_steps == [float(END - SAVED)], tag  # a fresh optimizer's count
            assert fresh_losses[0] == losses[0], tag  # the model did load
            assert fresh_losses != losses, tag  # and the optimizer state did not
        assert got["untaken"] is not None and "holds optimizer state" in got["untaken"]
        for tag in ("partial", "full"):
            assert got[(tag, "no optimizer state")] is None, got[(tag, "no optimizer state")]


# ---- several writers of one file name -----------------------------------------------------------


def _payload(rank: int) -> dict:
    return {"rank": rank, "values": torch.full((1 << 16 << (2 * rank),), float(rank))}


def _concurrent_save_worker(directory: str, count: int):
    import smp

    smp.init({})
    for index in range(count):
        smp.barrier()  # every rank writes the same name at the same moment
        smp.save(_payload(smp.rank()), os.path.join(directory, f"shared_{index}.pt"), partial=False)
    smp.barrier()


def test_full_saves_of_one_name_on_several_ranks_leave_whole_files(pools, tmp_path):
    count = 30
    pools.run(2, _concurrent_save_worker, str(tmp_path), count, timeout_s=300)
    payloads = [_payload(rank) for rank in range(2)]
    for index in range(count):
        loaded = torch.load(tmp_path / f"shared_{index}.pt", weights_only=True)
        assert any(
            loaded["rank"] == p["rank"] and torch.equal(loaded["values"], p["values"])
            for p in payloads
        ), index
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        f"shared_{i}.pt" for i in range(count)
    )  # no temporary file left


def test_a_killed_writers_temporary_file_is_removed_by_the_next_save(tmp_path):
    import smp

    target = tmp_path / "state.pt"
    killed = subprocess.run(  # a writer killed mid-write, after some of its bytes
        [
            sys.executable,
            "-c",
            "import os, signal, sys\n"
            "from pathlib import Path\n"
            "from smp.checkpoints.files import write_atomically\n"
            "write_atomically(Path(sys.argv[1]), lambda f: (f.write(b'half'), f.flush(), "
            "os.kill(os.getpid(), signal.SIGKILL)))\n",
            str(target),
        ],
        capture_output=True,
        timeout=120,
    )
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    left = [p.name for p in tmp_path.iterdir()]
    assert len(left) == 1 and left[0].startswith(".state.pt.tmp-"), left
    other_host = tmp_path / ".state.pt.tmp-1-abcdef@elsewhere"  # its writer may be alive
    other_host.write_bytes(b"another host's writer")
    smp.save({"a": 1}, str(target), partial=False)
    assert torch.load(target, weights_only=True) == {"a": 1}
    assert sorted(p.name for p in tmp_path.iterdir()) == [other_host.name, "state.pt"]

    class Unpicklable:
        def __reduce__(self):
            raise RuntimeError("cannot pickle this")

    with pytest.raises(RuntimeError, match="cannot pickle"):
        smp.save(Unpicklable(), str(target), partial=False)
    assert torch.load(target, weights_only=True) == {"a": 1}  # the previous file, whole
    assert sorted(p.name for p in tmp_path.iterdir()) == [other_host.name, "state.pt"]


# ---- pruning and fsync --------------------------------------------------------------------------


class _ClockSteppingBack:
    """time for smp.checkpoints.training: time() goes back an hour at every call."""

    perf_counter = staticmethod(time.perf_counter)

    def __init__(self):
        self.now = 2.0e9

    def time(self) -> float:
        self.now -= 3600.0
        return self.now


def _small_model(smp):
    model = smp.DistributedModel(_gpt(seed=0))
    return model, smp.DistributedOptimizer(parity_adamw(model.parameters()))


def _prune_worker(directory: str):
    import smp
    import smp.checkpoints.training as checkpoints

    smp.init({})
    kept = _small_model(smp)  # noqa: F841 - smp holds models weakly
    real, checkpoints.time = checkpoints.time, _ClockSteppingBack()
    try:
        for tag in ("a", "b", "c"):
            smp.save_checkpoint(directory, tag, num_kept_partial_checkpoints=2)
    finally:
        checkpoints.time = real
    return sorted(p.name for p in Path(directory).iterdir())


def test_pruning_keeps_the_newest_saves_when_the_clock_steps_back(pools, tmp_path):
    assert pools.run(1, _prune_worker, str(tmp_path))[0] == ["b", "c", "newest"]
    assert (tmp_path / "newest").read_text() == "c"


def _record_renames_and_fsyncs(action) -> list[tuple[str, str]]:
    """Runs ``action()`` with os.rename / os.replace / os.fsync recorded as (kind, path): the
    rename's target, the fsync'd file or directory."""
    events: list[tuple[str, str]] = []
    real = os.rename, os.replace, os.fsync

    def renamer(original):
        def rename(src, dst, *args, **kwargs):
            original(src, dst, *args, **kwargs)
            events.append(("rename", os.path.abspath(dst)))

        return rename

    def fsync(fd):
        real[2](fd)
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))

    os.rename, os.replace, os.fsync = renamer(real[0]), renamer(real[1]), fsync
    try:
        action()
    finally:
        os.rename, os.replace, os.fsync = real
    return events


def _unsynced(events: list[tuple[str, str]]) -> list[str]:
    """Renames whose directory was not fsync'd before a rename elsewhere or the end."""
    pending: dict[str, str] = {}  # directory -> a rename in it not yet fsync'd
    late = []
    for kind, path in events:
        if kind == "fsync":
            pending.pop(path, None)
            continue
        directory = os.path.dirname(path)
        late += [f"{p} (before {path})" for d, p in pending.items() if d != directory]
        pending = {d: p for d, p in pending.items() if d == directory}
        pending[directory] = path
    return late + [f"{p} (at the end)" for p in pending.values()]


def _fsync_worker(directory: str):
    import smp

    smp.init({})
    kept = _small_model(smp)  # noqa: F841 - smp holds models weakly
    root = os.path.join(directory, "ckpt")
    smp.save_checkpoint(root, "t")
    events = {
        "save_checkpoint": _record_renames_and_fsyncs(lambda: smp.save_checkpoint(root, "t")),
        "save": _record_renames_and_fsyncs(
            lambda: smp.save({"x": 1}, os.path.join(directory, "x.pt"), partial=False)
        ),
    }
    return {what: (_unsynced(e), sum(k == "rename" for k, _ in e)) for what, e in events.items()}


def test_every_rename_is_followed_by_an_fsync_of_its_directory(pools, tmp_path):
    for what, (unsynced, renames) in pools.run(1, _fsync_worker, str(tmp_path))[0].items():
        assert renames > 0, what  # the recorder saw the renames
        assert unsynced == [], what


# ---- trust: nothing in a checkpoint runs code ---------------------------------------------------


@dataclasses.dataclass
class Position:
    """A user type in user_content."""

    step: int


class _RunsCode:
    """Unpickling this creates ``marker``: what a crafted checkpoint could do instead."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _craft(directory: Path, name: str, marker: str) -> bytes:
    """Replaces ``directory/name`` with code-running bytes, the manifest updated to match (its
    checksums stop accidents, not an attacker); returns the original bytes."""
    from smp.checkpoints.training import _digest

    file = directory / name
    original = file.read_bytes()
    if name == ".metadata":
        file.write_bytes(pickle.dumps(_RunsCode(marker)))
    else:
        torch.save(_RunsCode(marker), file)
    manifest_file = directory / "smp_checkpoint.json"
    manifest = json.loads(manifest_file.read_text())
    manifest["files"][name] = _digest(file)
    manifest_file.write_text(json.dumps(manifest))
    return original


def _trust_worker(directory: str):
    import smp

    smp.init({})
    kept = _small_model(smp)  # noqa: F841 - smp holds models weakly
    root = Path(directory)
    smp.save_checkpoint(directory, "user_type", user_content=Position(3))
    messages = {}
    try:
        smp.resume_from_checkpoint(directory, tag="user_type")
        messages["user type"] = "no error"
    except smp.CheckpointError as exc:
        messages["user type"] = str(exc)
    with torch.serialization.safe_globals([Position]):
        allowed = smp.resume_from_checkpoint(directory, tag="user_type")

    smp.save_checkpoint(directory, "partial", user_content={"step": 1})
    smp.save_checkpoint(directory, "full", partial=False, user_content={"step": 1})
    ran = {}
    for tag, name in [
        ("partial", "user_content.pt"),
        ("partial", "rng.pt"),
        ("partial", ".metadata"),
        ("full", "optimizer.pt"),
        ("full", "model.pt"),
    ]:
        marker = root / f"ran_{name}"
        manifest = (root / tag / "smp_checkpoint.json").read_bytes()
        original = _craft(root / tag, name, str(marker))
        try:
            smp.resume_from_checkpoint(directory, tag=tag, partial=tag == "partial")
            messages[name] = "no error"
        except smp.CheckpointError as exc:
            messages[name] = str(exc)
        finally:
            (root / tag / name).write_bytes(original)
            (root / tag / "smp_checkpoint.json").write_bytes(manifest)
        ran[name] = marker.exists()
    return allowed, messages, ran


def test_a_checkpoint_runs_no_code_and_user_types_are_allowed_by_name(pools, tmp_path):
    allowed, messages, ran = pools.run(1, _trust_worker, str(tmp_path), timeout_s=300)[0]
    assert allowed == Position(3)
    user_type = f"{Position.__module__}.Position"
    assert f"holds {user_type}, which smp does not load" in messages["user type"]
    assert "torch.serialization.add_safe_globals([Position])" in messages["user type"]
    assert ran == dict.fromkeys(ran, False)  # no crafted file ran its code
    for name in ("user_content.pt", "rng.pt", "optimizer.pt", "model.pt"):
        assert "holds io.open, which smp does not load" in messages[name], name
    assert "refused the global io.open" in messages[".metadata"]


def test_dcp_byte_items_load_as_plain_values_only(tmp_path):
    import smp
    from smp.checkpoints.dcp import _LoadPlanner

    planner = _LoadPlanner(lambda metadata: set())
    planner.state_dict = {}
    item = types.SimpleNamespace(dest_index=types.SimpleNamespace(fqn="optim/param_groups"))

    def saved(obj) -> io.BytesIO:
        buffer = io.BytesIO()
        torch.save(obj, buffer)
        buffer.seek(0)
        return buffer

    groups = [{"lr": 1e-3, "betas": (0.9, 0.999), "foreach": None}]
    planner.load_bytes(item, saved(groups))
    assert planner.state_dict["optim/param_groups"] == groups
    marker = tmp_path / "ran"
    with pytest.raises(smp.CheckpointError, match="'optim/param_groups' holds io.open"):
        planner.load_bytes(item, saved(_RunsCode(str(marker))))
    assert not marker.exists()
