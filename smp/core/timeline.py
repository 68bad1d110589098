"""What the pipeline did: the actions each rank ran in the last step, with their times.

``smp.last_step_timeline()`` gathers every rank's record of its last pipelined step (a collective:
every rank must call it). Each record is a list of :class:`TimedAction` in the schedule IR's
string form ``<stage><type><microbatch>`` (``1F3``: stage 1 ran forward work of microbatch 3;
``0B2``: backward work of microbatch 2; ``1W2``: weight gradients of microbatch 2 computed
apart from its input gradients, design.md §4.4), with wall-clock start and end times. The
dynamic runtime splits a microbatch's work on a stage wherever it waited for another stage, so
one (stage, microbatch, type) may appear as several pieces; :meth:`Timeline.program` merges
consecutive pieces, and :meth:`Timeline.to_schedule` projects the step onto a schedule the IR's
validator, simulator and CSV export take. Recording costs two clock reads per task.

    timeline = smp.last_step_timeline()
    if smp.rank() == 0:
        timeline.save_chrome_trace("step.json")   # open in ui.perfetto.dev or chrome://tracing
        timeline.plot("step.png")                 # needs matplotlib
        print(timeline.summary())
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import torch.distributed as dist

__all__ = ["TimedAction", "Timeline", "last_step_timeline"]


@dataclasses.dataclass(frozen=True)
class TimedAction:
    """One piece of work: ``action`` in IR string form, wall-clock ``start``/``end`` seconds."""

    action: str
    start: float
    end: float


class Timeline:
    """The last step's actions per rank (``ranks``: rank -> list of TimedAction, in order), and
    the size of each rank's call-structure caches (``caches``: rank -> {table: entries}, with
    the tables' ``limit`` and the entries ``evicted`` so far; design.md §4.7)."""

    def __init__(
        self, ranks: dict[int, list[TimedAction]], caches: dict[int, dict[str, int]] | None = None
    ):
        self.ranks = ranks
        self.caches = caches or {}

    @property
    def start(self) -> float:
        return min((a.start for acts in self.ranks.values() for a in acts), default=0.0)

    @property
    def end(self) -> float:
        return max((a.end for acts in self.ranks.values() for a in acts), default=0.0)

    def program(self) -> dict[int, list[str]]:
        """Per rank, the action strings in the order they ran, consecutive pieces merged."""
        out: dict[int, list[str]] = {}
        for rank, actions in self.ranks.items():
            merged: list[str] = []
            for a in actions:
                if not merged or merged[-1] != a.action:
                    merged.append(a.action)
            out[rank] = merged
        return out

    def _by_stage(self) -> dict[int, list[TimedAction]]:
        """Stage -> the actions of its lowest rank (data- and tensor-parallel replicas run the
        same microbatches)."""
        from smp import _C

        by_stage: dict[int, list[TimedAction]] = {}
        for rank in sorted(self.ranks):
            if self.ranks[rank]:
                stage = _C.schedule.parse_action(self.ranks[rank][0].action).stage
                by_stage.setdefault(stage, self.ranks[rank])
        return by_stage

    def to_schedule(self) -> list[list[Any]]:
        """The step as a compute-only schedule in the IR: one program per pipeline stage (from
        the lowest rank of each stage; data- and tensor-parallel replicas run the same
        microbatches), one ``smp._C.schedule.Action`` per (stage, type, microbatch).

        The dynamic runtime runs a (stage, type, microbatch) in pieces, and the leader's
        forward encloses every other stage's (its root module calls them). The projection
        places a forward where its first piece started and a backward where its last piece
        ended, which is where a chain schedule has them: a stage's forward of a microbatch
        starts before the next stage's, and its backward completes after the next stage's.
        For a model whose stages call each other in a chain the result passes
        ``smp._C.schedule.validate_schedule``; ``smp._C.schedule.to_csv`` writes it in
        torch.distributed.pipelining's CSV form, and ``simulate`` replays it.
        """
        from smp import _C

        parse = _C.schedule.parse_action
        by_stage = self._by_stage()
        programs = []
        for stage in sorted(by_stage):
            at: dict[str, float] = {}
            for a in by_stage[stage]:
                if "F" in a.action:
                    at[a.action] = min(at.get(a.action, a.start), a.start)
                else:
                    at[a.action] = max(at.get(a.action, a.end), a.end)
            # A microbatch whose weight gradients ran apart: its "B" pieces were the input half
            # (I), and the weight half (W) counts as done once both halves are.
            for action in [a for a in at if "W" in a]:
                backward = action.replace("W", "B")
                if backward in at:
                    at[backward.replace("B", "I")] = at.pop(backward)
                    at[action] = max(at[action], at[backward.replace("B", "I")])
            order = {"F": 0, "B": 1, "I": 1, "W": 2}  # equal times: I before its W
            actions = [parse(action) for action in at]
            actions.sort(key=lambda a: (at[str(a)], order[a.type]))
            programs.append(actions)
        return programs

    def stage_costs(self) -> list[Any]:
        """What each stage's work cost per microbatch in this step, as one
        ``smp._C.schedule.ActionCosts`` per stage (seconds; from the lowest rank of each stage),
        for ``smp._C.schedule.simulate(schedule, costs)``: how long another order of the same
        pieces, say a static 1F1B or ZB-H1 program, would take (communication free).

        Each type's pieces are summed per microbatch and averaged. ``forward`` and
        ``full_backward`` (backward and weight pieces) are means over every microbatch. Where
        weight gradients ran apart (§4.4: the step's last microbatches on stages after the
        first), ``backward_input`` is the mean of those microbatches' backward pieces and
        ``backward_weight`` of their weight pieces; where none did, ``backward_input`` is
        ``full_backward`` and ``backward_weight`` is 0.
        """
        from smp import _C

        parse = _C.schedule.parse_action
        by_stage = self._by_stage()
        costs = []
        for stage in sorted(by_stage):
            per = {"F": {}, "B": {}, "W": {}}  # type -> microbatch -> seconds
            for a in by_stage[stage]:
                action = parse(a.action)
                times = per[action.type]
                times[action.microbatch] = times.get(action.microbatch, 0.0) + a.end - a.start
            microbatches = set().union(*per.values())
            n = len(microbatches)
            f = sum(per["F"].values()) / n
            full = (sum(per["B"].values()) + sum(per["W"].values())) / n
            split = per["W"]
            i = sum(per["B"].get(mb, 0.0) for mb in split) / len(split) if split else full
            w = sum(split.values()) / len(split) if split else 0.0
            costs.append(
                _C.schedule.ActionCosts(
                    forward=f, full_backward=full, backward_input=i, backward_weight=w
                )
            )
        return costs

    def busy_fraction(self, rank: int) -> float:
        """Time ``rank`` spent in recorded work over the step's span."""
        span = self.end - self.start
        busy = sum(a.end - a.start for a in self.ranks[rank])
        return busy / span if span > 0 else 0.0

    def summary(self) -> str:
        lines = [f"step span {1e3 * (self.end - self.start):.1f} ms"]
        for rank in sorted(self.ranks):
            acts = self.ranks[rank]
            line = f"  rank {rank}: {len(acts)} pieces, busy {100 * self.busy_fraction(rank):.1f}%"
            caches = dict(self.caches.get(rank, {}))
            if caches:
                limit, evicted = caches.pop("limit"), caches.pop("evicted")
                sizes = ", ".join(f"{name} {n}" for name, n in caches.items())
                line += f"; call caches: {sizes} (limit {limit} each, {evicted} evicted)"
            lines.append(line)
        return "\n".join(lines)

    def save_chrome_trace(self, path: str | Path) -> None:
        """Writes Trace Event JSON (one row per rank) for Perfetto or chrome://tracing."""
        t0 = self.start
        events: list[dict[str, Any]] = []
        for rank, actions in sorted(self.ranks.items()):
            events.append(
                {"ph": "M", "name": "process_name", "pid": rank, "args": {"name": f"rank {rank}"}}
            )
            for a in actions:
                events.append(
                    {
                        "ph": "X",
                        "name": a.action,
                        "cat": _category(a.action),
                        "pid": rank,
                        "tid": 0,
                        "ts": (a.start - t0) * 1e6,
                        "dur": (a.end - a.start) * 1e6,
                    }
                )
        Path(path).write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}))

    def plot(self, path: str | Path) -> None:
        """Writes a PNG: one row per rank, forward pieces blue, backward orange, weight
        gradients computed apart green, labelled."""
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError as exc:
            raise ImportError(
                "Timeline.plot needs matplotlib (pip install matplotlib); "
                "save_chrome_trace() needs nothing"
            ) from exc
        t0 = self.start
        ranks = sorted(self.ranks)
        fig, ax = plt.subplots(figsize=(12, 0.6 + 0.5 * len(ranks)))
        for row, rank in enumerate(ranks):
            for a in self.ranks[rank]:
                color = _COLORS[_category(a.action)]
                width = (a.end - a.start) * 1e3
                ax.barh(row, width, left=(a.start - t0) * 1e3, color=color, edgecolor="white")
                if width > 0.04 * (self.end - t0) * 1e3:
                    ax.text((a.start - t0) * 1e3 + width / 2, row, a.action, ha="center",
                            va="center", fontsize=7, color="white")  # fmt: skip
        ax.set_yticks(range(len(ranks)), [f"rank {r}" for r in ranks])
        ax.invert_yaxis()
        ax.set_xlabel("ms")
        fig.tight_layout()
        fig.savefig(path, dpi=120)
        plt.close(fig)


_COLORS = {"forward": "tab:blue", "backward": "tab:orange", "weight": "tab:green"}


def _category(action: str) -> str:
    return "weight" if "W" in action else "backward" if "B" in action else "forward"


def last_step_timeline() -> Timeline:
    """The actions every rank ran in its last pipelined step. A collective over all ranks.

    Raises:
        RuntimeError: no pipelined step has run yet (pipeline_parallel_degree = 1 records
            nothing: there is no pipeline to show).
    """
    from smp.state import get_state

    state = get_state()
    mine: tuple[list[tuple[str, float, float]], dict[str, int]] | None = None
    latest = float("-inf")
    for runtime in state.runtimes:  # the model that stepped last, if there are several
        recorder = getattr(runtime, "recorder", None)
        if recorder is not None and recorder.spans and recorder.spans[-1][3] > latest:
            latest = recorder.spans[-1][3]
            spans = [
                (f"{runtime.stage}{k}{mb}", start, end) for k, mb, start, end in recorder.spans
            ]
            mine = (spans, runtime.cache_sizes())
    records: list[Any] = [None] * state.world_size
    dist.all_gather_object(records, mine, group=state.groups["world"])
    if any(r is None for r in records):
        raise RuntimeError(
            "smp.last_step_timeline(): no pipelined step has run on rank "
            f"{records.index(None)}; it records steps with pipeline_parallel_degree > 1"
        )
    return Timeline(
        {rank: [TimedAction(*a) for a in spans] for rank, (spans, _) in enumerate(records)},
        {rank: caches for rank, (_, caches) in enumerate(records)},
    )
