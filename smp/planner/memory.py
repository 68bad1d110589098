"""A rank's memory ledger: what the layout makes of a model's profile (design.md §13.2).

Per rank: model states (weights, gradients, optimizer state, each sharded or not), activations
(smp.planner.profile's saved bytes of the rank's modules) times the microbatches a rank holds at
once (read off the schedule IR's simulation, :func:`peak_in_flight`), what a rank reserves (the
cluster's), and what else a plan adds.
"""

from __future__ import annotations

import dataclasses

from smp import _C

__all__ = ["Ledger", "StateBytes", "peak_in_flight"]


@dataclasses.dataclass(frozen=True)
class StateBytes:
    """Bytes per parameter of each model state, and how each is sharded over the data-parallel
    ranks (1: replicated).

    The defaults are Adam with mixed precision: 16-bit weights and gradients, fp32 masters and
    two fp32 moments (16 bytes; ZeRO's 2 + 2 + 12). Megatron accumulates gradients in fp32:
    ``gradient=4`` (18 bytes, as Korthikanti et al. count).
    """

    weight: float = 2.0
    gradient: float = 2.0
    optimizer: float = 12.0  # masters and moments
    weight_shards: int = 1
    gradient_shards: int = 1
    optimizer_shards: int = 1

    def per_parameter(self) -> float:
        return (
            self.weight / self.weight_shards
            + self.gradient / self.gradient_shards
            + self.optimizer / self.optimizer_shards
        )


@dataclasses.dataclass(frozen=True)
class Ledger:
    """One rank's predicted memory, by part (bytes)."""

    parameters: float
    gradients: float
    optimizer: float
    activations: float  # one microbatch's saved activations × microbatches in flight
    in_flight: int
    reserved: float = 0.0  # runtime context, communicator buffers, the allocator's floor
    other: float = 0.0  # logits, communication buffers and what else a plan adds

    @property
    def total(self) -> float:
        return (
            self.parameters
            + self.gradients
            + self.optimizer
            + self.activations
            + self.reserved
            + self.other
        )

    def as_dict(self) -> dict[str, float]:
        return {**dataclasses.asdict(self), "total": self.total}

    @classmethod
    def of(
        cls,
        num_parameters: float,
        activation_bytes: float,
        in_flight: int,
        states: StateBytes = StateBytes(),  # noqa: B008 - frozen, shared safely
        reserved: float = 0.0,
        other: float = 0.0,
    ) -> Ledger:
        """A rank holding ``num_parameters`` parameters (its share: after TP and PP), with
        ``activation_bytes`` saved per microbatch and ``in_flight`` microbatches at once."""
        return cls(
            parameters=num_parameters * states.weight / states.weight_shards,
            gradients=num_parameters * states.gradient / states.gradient_shards,
            optimizer=num_parameters * states.optimizer / states.optimizer_shards,
            activations=activation_bytes * in_flight,
            in_flight=in_flight,
            reserved=reserved,
            other=other,
        )


def peak_in_flight(
    schedule: str, num_stages: int, num_microbatches: int, virtual_stages: int = 1
) -> list[int]:
    """Per rank, the most (stage, microbatch) pairs whose forward has started and whose backward
    has not finished, in the schedule IR's simulation of ``schedule`` ("gpipe", "1f1b",
    "interleaved", "zbh1"): the microbatches of activations a rank holds at once (for
    "interleaved", in units of one virtual stage's layers). Where the backward is split, a
    pair is held until its weight half (W) has run: the weight gradients need the inputs the
    forward saved (ZB-H1 holds more than the IR's F-to-I count).

    Example: ``peak_in_flight("interleaved", 8, 16, 3)[0] == 31``: p·v + p - 1 chunks, the
    p·(1 + (p - 1)/(p·v)) stages' worth of Korthikanti et al.

    Closed forms of the simulation (equal to it for p <= 8, m <= 16: the unit tests), so that a
    search over thousands of stages and microbatches costs nothing here: 1F1B min(m, p - r) on
    rank r; GPipe m; ZB-H1 min(p, m) on every rank; interleaved min(m·v, p·v + p - 1 - 2r),
    or m·v everywhere when m = p.
    """
    p, m, v = num_stages, num_microbatches, virtual_stages
    if schedule == "1f1b" and v == 1:
        return [min(m, p - r) for r in range(p)]
    if schedule == "gpipe" and v == 1:
        return [m] * p
    if schedule == "zbh1" and v == 1:
        return [min(p, m)] * p
    if schedule == "interleaved":
        if m % p:
            raise ValueError(
                f"smp: the interleaved schedule needs microbatches ({m}) to be a multiple of the "
                f"stages ({p})"
            )
        return [m * v] * p if m == p else [min(m * v, p * v + p - 1 - 2 * r) for r in range(p)]
    return _simulated_peaks(schedule, p, m, v)  # raises naming the schedules there are


def _simulated_peaks(
    schedule: str, num_stages: int, num_microbatches: int, virtual_stages: int
) -> list[int]:
    S = _C.schedule
    if schedule == "interleaved":
        program = S.interleaved_1f1b(num_stages, virtual_stages, num_microbatches)
    else:
        makers = {"gpipe": S.gpipe, "1f1b": S.one_f_one_b, "zbh1": S.zero_bubble_h1}
        if schedule not in makers or virtual_stages != 1:
            raise ValueError(
                f"smp: no schedule {schedule!r} with {virtual_stages} virtual stages; give one of "
                "'gpipe', '1f1b', 'zbh1' (1 virtual stage) or 'interleaved'"
            )
        program = makers[schedule](num_stages, num_microbatches)
    actions = S.simulate(program).actions
    weighted = {
        (a.stage, a.microbatch) for a in (S.Action.parse(text) for _, text, _, _ in actions)
        if a.type == "W"
    }  # fmt: skip
    events: list[list[tuple[float, int]]] = [[] for _ in range(len(program))]
    for rank, text, start, end in actions:
        action = S.Action.parse(text)
        key = (action.stage, action.microbatch)
        if action.type == "F":
            events[rank].append((start, 1))
        elif action.type == ("W" if key in weighted else "B") or (
            action.type == "I" and key not in weighted
        ):
            events[rank].append((end, -1))
    peaks = []
    for rank_events in events:
        held = peak = 0
        for _, change in sorted(rank_events):  # at one instant, a release before a hold
            held += change
            peak = max(peak, held)
        peaks.append(peak)
    return peaks
