"""Pipeline schedules as static per-mesh instruction lists, with a checker.

Alpa (OSDI'22, sec. 5) compiles the inter-operator pass into one *static* instruction
list per mesh: RUN a stage's forward or backward on a micro-batch, SEND/RECV the
activation (stage i -> i+1, forward) or gradient (stage i+1 -> i, backward) across
meshes, and FREE the activations a micro-batch kept for its backward. Because the lists
are static, a wrong order is not a slow run but a hang; so every schedule here goes
through ``check``, which proves it complete and deadlock-free by simulating it.

Schedules:

* ``gpipe``: all forwards, then all backwards (GPipe). Every stage holds all M
  micro-batches' activations at its peak.
* ``1f1b``: PipeDream-flush 1F1B. Stage i (0-based) runs forwards until S - i
  micro-batches are in flight, then alternates one backward and one forward, then drains.
  Same makespan as GPipe, but activation memory bounded by S - i instead of M.
* ``eager_1f1b``: eager-1F1B from the cross-mesh resharding paper (MLSys'23): stage i
  (1-based) runs 2 (S - i) + 1 warm-up forwards, so that the SEND of a forward overlaps
  with the next forward's compute; costs more in-flight memory to hide communication.

Pure Python, no JAX: the schedule is a planning artifact, tested without devices.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

__all__ = [
    "BACKWARD",
    "FORWARD",
    "KINDS",
    "PHASES",
    "SCHEDULES",
    "Instruction",
    "Schedule",
    "ScheduleError",
    "ScheduleReport",
    "Timeline",
    "TimelineRecord",
    "check",
    "eager_one_f_one_b",
    "gpipe",
    "make_schedule",
    "one_f_one_b",
    "simulate",
]

FORWARD = "forward"
BACKWARD = "backward"
KINDS = ("RUN", "SEND", "RECV", "FREE")
PHASES = (FORWARD, BACKWARD)


class ScheduleError(ValueError):
    """A schedule is incomplete, inconsistent or deadlocks."""


@dataclass(frozen=True)
class Instruction:
    """One step of a mesh's static program.

    ``peer`` is the other stage of a SEND/RECV; ``None`` for RUN/FREE.
    """

    kind: str
    stage: int
    microbatch: int
    phase: str
    peer: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown instruction kind {self.kind!r}; known: {KINDS}")
        if self.phase not in PHASES:
            raise ValueError(f"unknown phase {self.phase!r}; known: {PHASES}")
        if (self.peer is None) != (self.kind in ("RUN", "FREE")):
            raise ValueError(f"{self.kind} takes {'no' if self.kind in ('RUN', 'FREE') else 'a'} peer")

    def __str__(self) -> str:
        s = f"{self.kind} {self.phase} mb {self.microbatch} on stage {self.stage}"
        if self.kind == "SEND":
            s += f" to stage {self.peer}"
        elif self.kind == "RECV":
            s += f" from stage {self.peer}"
        return s


@dataclass(frozen=True)
class Schedule:
    """One instruction list per stage (= per mesh), each in execution order."""

    name: str
    num_stages: int
    num_microbatches: int
    instructions: tuple[tuple[Instruction, ...], ...]

    def __post_init__(self) -> None:
        if len(self.instructions) != self.num_stages:
            raise ValueError(
                f"schedule {self.name!r} has {len(self.instructions)} instruction lists "
                f"for {self.num_stages} stages"
            )

    def runs(self, stage: int) -> tuple[tuple[str, int], ...]:
        """The (phase, micro-batch) RUN order on ``stage``: the schedule without its comms."""
        return tuple((i.phase, i.microbatch) for i in self.instructions[stage] if i.kind == "RUN")


# ---------------------------------------------------------------------------------------
# Schedule construction
# ---------------------------------------------------------------------------------------


def _validate_sizes(num_stages: int, num_microbatches: int) -> None:
    for label, v in (("num_stages", num_stages), ("num_microbatches", num_microbatches)):
        if isinstance(v, bool) or not isinstance(v, int):
            raise ValueError(f"{label} must be an int, got {v!r}")  # noqa: TRY004 (API: ValueError)
        if v < 1:
            raise ValueError(f"{label} must be >= 1, got {v}")


def _lower(stage: int, num_stages: int, order: Sequence[tuple[str, int]]) -> tuple[Instruction, ...]:
    """Expand a RUN order into the full mesh program with its SEND/RECV/FREE.

    Receives go right before the RUN that needs them and sends right after the RUN that
    produced the data, so that matching SEND/RECV pairs appear in the same order on both
    ends of each channel (required for NCCL-style in-order point-to-point).
    """
    out: list[Instruction] = []
    last = num_stages - 1
    for phase, m in order:
        if phase == FORWARD:
            if stage > 0:
                out.append(Instruction("RECV", stage, m, FORWARD, stage - 1))
            out.append(Instruction("RUN", stage, m, FORWARD))
            if stage < last:
                out.append(Instruction("SEND", stage, m, FORWARD, stage + 1))
        else:
            if stage < last:
                out.append(Instruction("RECV", stage, m, BACKWARD, stage + 1))
            out.append(Instruction("RUN", stage, m, BACKWARD))
            out.append(Instruction("FREE", stage, m, BACKWARD))
            if stage > 0:
                out.append(Instruction("SEND", stage, m, BACKWARD, stage - 1))
    return tuple(out)


def _warmup_then_1b1f(num_microbatches: int, warmup: int) -> list[tuple[str, int]]:
    """``warmup`` forwards, then alternate 1B1F until forwards run out, then drain."""
    warmup = min(warmup, num_microbatches)
    order = [(FORWARD, m) for m in range(warmup)]
    nf, nb = warmup, 0
    while nb < num_microbatches:
        order.append((BACKWARD, nb))
        nb += 1
        if nf < num_microbatches:
            order.append((FORWARD, nf))
            nf += 1
    return order


def _build(name: str, num_stages: int, num_microbatches: int, warmup: Callable[[int], int]) -> Schedule:
    return Schedule(
        name,
        num_stages,
        num_microbatches,
        tuple(
            _lower(s, num_stages, _warmup_then_1b1f(num_microbatches, warmup(s)))
            for s in range(num_stages)
        ),
    )


def gpipe(num_stages: int, num_microbatches: int) -> Schedule:
    """GPipe: all forwards, then all backwards; peak in-flight is M on every stage."""
    _validate_sizes(num_stages, num_microbatches)
    return _build("gpipe", num_stages, num_microbatches, lambda s: num_microbatches)


def one_f_one_b(num_stages: int, num_microbatches: int) -> Schedule:
    """PipeDream-flush 1F1B: stage i (0-based) keeps at most min(S - i, M) micro-batches in flight.

    It runs min(S - i, M) forwards before its first backward (S - i - 1 warm-up plus the
    first steady-state forward), then 1B1F, then the cool-down backwards.
    """
    _validate_sizes(num_stages, num_microbatches)
    return _build("1f1b", num_stages, num_microbatches, lambda s: num_stages - s)


def eager_one_f_one_b(num_stages: int, num_microbatches: int) -> Schedule:
    """Eager-1F1B (MLSys'23): stage i (1-based) runs min(2 (S - i) + 1, M) forwards first.

    The extra warm-up lets each stage's forward SEND overlap with its next forward, so
    cross-mesh resharding hides behind compute, at the price of more in-flight memory.
    """
    _validate_sizes(num_stages, num_microbatches)
    # 0-based s is 1-based s + 1: 2 (S - (s + 1)) + 1
    return _build("eager_1f1b", num_stages, num_microbatches, lambda s: 2 * (num_stages - s - 1) + 1)


SCHEDULES: dict[str, Callable[[int, int], Schedule]] = {
    "gpipe": gpipe,
    "1f1b": one_f_one_b,
    "eager_1f1b": eager_one_f_one_b,
}


def make_schedule(name: str, num_stages: int, num_microbatches: int) -> Schedule:
    """Build a schedule by name ("gpipe", "1f1b", "eager_1f1b")."""
    if name not in SCHEDULES:
        raise ValueError(f"unknown pipeline schedule {name!r}; known: {', '.join(sorted(SCHEDULES))}")
    return SCHEDULES[name](num_stages, num_microbatches)


# ---------------------------------------------------------------------------------------
# Simulation
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TimelineRecord:
    """When one instruction ran. SEND/RECV/FREE have start == end (zero duration)."""

    stage: int
    kind: str
    phase: str
    microbatch: int
    start: float
    end: float


@dataclass(frozen=True)
class Timeline:
    """Result of ``simulate``: records per instruction, in each stage's program order."""

    records: tuple[TimelineRecord, ...]
    makespan: float
    bubble_fraction: float
    peak_in_flight: tuple[int, ...]

    def run(self, stage: int, phase: str, microbatch: int) -> TimelineRecord:
        """The RUN record of (stage, phase, micro-batch)."""
        for r in self.records:
            if r.kind == "RUN" and (r.stage, r.phase, r.microbatch) == (stage, phase, microbatch):
                return r
        raise KeyError((stage, phase, microbatch))


def _per_stage(value: float | Sequence[float], num_stages: int, label: str) -> tuple[float, ...]:
    if isinstance(value, (int, float)):
        values = (float(value),) * num_stages
    else:
        values = tuple(float(v) for v in value)
        if len(values) != num_stages:
            raise ValueError(f"{label} has {len(values)} entries for {num_stages} stages")
    for v in values:
        if not math.isfinite(v) or v < 0:
            raise ValueError(f"{label} must be finite and >= 0, got {v}")
    return values


def simulate(
    schedule: Schedule,
    forward_time: float | Sequence[float] = 1.0,
    backward_time: float | Sequence[float] = 2.0,
    transfer_time: float = 0.0,
) -> Timeline:
    """Run every stage's list in order, each instruction as soon as its inputs exist.

    A RUN forward needs its RECV'd activation (stage > 0); a RUN backward needs its own
    forward and its RECV'd gradient (not last stage). A RECV completes when the peer's
    matching SEND has executed plus ``transfer_time``. SENDs are non-blocking. There is no
    contention other than each stage being sequential, so computing each instruction's
    time by fixpoint over the stages is exact. If no stage can advance while some still
    have instructions left, the schedule deadlocks and ``ScheduleError`` names them.
    """
    S = schedule.num_stages
    ft = _per_stage(forward_time, S, "forward_time")
    bt = _per_stage(backward_time, S, "backward_time")
    if not math.isfinite(transfer_time) or transfer_time < 0:
        raise ValueError(f"transfer_time must be finite and >= 0, got {transfer_time}")

    pc = [0] * S
    clock = [0.0] * S
    records: list[list[TimelineRecord]] = [[] for _ in range(S)]
    sent: dict[tuple[int, int, str, int], float] = {}  # (src, dst, phase, mb) -> arrival
    received: dict[tuple[int, str, int], float] = {}  # (stage, phase, mb) -> time
    ran: dict[tuple[int, str, int], float] = {}  # (stage, phase, mb) -> end time
    in_flight = [0] * S
    peak = [0] * S

    def ready_time(ins: Instruction) -> float | None:
        s = ins.stage
        if ins.kind == "RECV":
            return sent.get((ins.peer, s, ins.phase, ins.microbatch))
        if ins.kind in ("SEND", "FREE"):
            # Data to send / activations to free must exist: needs its own RUN.
            return ran.get((s, ins.phase, ins.microbatch))
        # RUN
        deps: list[float | None] = []
        if ins.phase == FORWARD:
            if s > 0:
                deps.append(received.get((s, FORWARD, ins.microbatch)))
        else:
            deps.append(ran.get((s, FORWARD, ins.microbatch)))
            if s < S - 1:
                deps.append(received.get((s, BACKWARD, ins.microbatch)))
        if any(d is None for d in deps):
            return None
        return max(deps, default=0.0)  # type: ignore[type-var]

    progress = True
    while progress:
        progress = False
        for s in range(S):
            prog = schedule.instructions[s]
            while pc[s] < len(prog):
                ins = prog[pc[s]]
                if ins.stage != s:
                    raise ScheduleError(f"instruction {ins} is in stage {s}'s list")
                t = ready_time(ins)
                if t is None:
                    break
                start = max(clock[s], t)
                key = (s, ins.phase, ins.microbatch)
                if ins.kind == "RUN":
                    end = start + (ft[s] if ins.phase == FORWARD else bt[s])
                    ran[key] = end
                    in_flight[s] += 1 if ins.phase == FORWARD else -1
                    peak[s] = max(peak[s], in_flight[s])
                else:
                    end = start
                    if ins.kind == "SEND":
                        sent[(s, ins.peer, ins.phase, ins.microbatch)] = start + transfer_time
                    elif ins.kind == "RECV":
                        received[key] = start
                clock[s] = end
                records[s].append(TimelineRecord(s, ins.kind, ins.phase, ins.microbatch, start, end))
                pc[s] += 1
                progress = True

    stuck = [s for s in range(S) if pc[s] < len(schedule.instructions[s])]
    if stuck:
        detail = "; ".join(f"stage {s} waits at {schedule.instructions[s][pc[s]]}" for s in stuck)
        raise ScheduleError(
            f"schedule {schedule.name!r} deadlocks: stuck stages {stuck}: {detail}"
        )

    makespan = max(clock, default=0.0)
    busy = sum(r.end - r.start for rs in records for r in rs if r.kind == "RUN")
    bubble = 1.0 - busy / (S * makespan) if makespan > 0 else 0.0
    return Timeline(
        records=tuple(r for rs in records for r in rs),
        makespan=makespan,
        bubble_fraction=bubble,
        peak_in_flight=tuple(peak),
    )


# ---------------------------------------------------------------------------------------
# Checker
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ScheduleReport:
    """What ``check`` proved and measured (unit times: forward 1, backward 2)."""

    name: str
    num_stages: int
    num_microbatches: int
    bubble_fraction: float
    clock_count: float  # makespan in units of one forward
    peak_in_flight: tuple[int, ...]
    warmup_forwards: tuple[int, ...]  # forwards each stage runs before its first backward


def _check_stage(schedule: Schedule, s: int) -> None:
    """Every micro-batch's forward, backward and FREE exactly once, in a legal order.

    Missing or duplicated work is reported before misordering, since a missing RUN makes
    every instruction that depends on it look misordered.
    """
    S, M = schedule.num_stages, schedule.num_microbatches
    count: dict[tuple[str, str, int], int] = {}
    for ins in schedule.instructions[s]:
        if ins.stage != s:
            raise ScheduleError(f"instruction {ins} is in stage {s}'s list")
        if not 0 <= ins.microbatch < M:
            raise ScheduleError(f"{ins}: micro-batch out of range 0..{M - 1}")
        if ins.kind in ("SEND", "RECV"):
            expect = s + 1 if (ins.phase == FORWARD) == (ins.kind == "SEND") else s - 1
            if ins.peer != expect or not 0 <= expect < S:
                raise ScheduleError(
                    f"{ins}: a {ins.phase} {ins.kind} of stage {s} must pair with stage {expect}"
                    + ("" if 0 <= expect < S else " (no such stage)")
                )
        key = (ins.kind, ins.phase, ins.microbatch)
        count[key] = count.get(key, 0) + 1
    for (kind, phase, m), n in sorted(count.items()):
        if n > 1:
            raise ScheduleError(f"stage {s} has {kind} {phase} of micro-batch {m} {n} times")
    for m in range(M):
        for phase in PHASES:
            if ("RUN", phase, m) not in count:
                raise ScheduleError(f"missing {phase} of (stage {s}, micro-batch {m})")
        if ("FREE", BACKWARD, m) not in count:
            raise ScheduleError(f"missing FREE of (stage {s}, micro-batch {m})")
        if s > 0 and ("RECV", FORWARD, m) not in count:
            raise ScheduleError(f"missing RECV forward of (stage {s}, micro-batch {m}) from stage {s - 1}")
        if s < S - 1 and ("RECV", BACKWARD, m) not in count:
            raise ScheduleError(f"missing RECV backward of (stage {s}, micro-batch {m}) from stage {s + 1}")
    if any(k[0] == "FREE" and k[1] != BACKWARD for k in count):
        raise ScheduleError(f"stage {s}: FREE must carry phase 'backward' (it follows the backward)")
    seen: set[tuple[str, str, int]] = set()
    for ins in schedule.instructions[s]:
        m = ins.microbatch
        if ins.kind == "SEND" and ("RUN", ins.phase, m) not in seen:
            raise ScheduleError(f"{ins} comes before the RUN that produces its data")
        if ins.kind == "RUN" and ins.phase == BACKWARD and ("RUN", FORWARD, m) not in seen:
            raise ScheduleError(f"stage {s} runs the backward of micro-batch {m} before its forward")
        if ins.kind == "FREE" and ("RUN", BACKWARD, m) not in seen:
            raise ScheduleError(f"{ins} frees activations before the backward that needs them")
        seen.add((ins.kind, ins.phase, m))


def _channel(schedule: Schedule, kind: str, src: int, dst: int) -> list[tuple[str, int]]:
    """Messages on the directed channel src -> dst, in the order ``kind``'s side issues them."""
    side = src if kind == "SEND" else dst
    peer = dst if kind == "SEND" else src
    return [
        (i.phase, i.microbatch)
        for i in schedule.instructions[side]
        if i.kind == kind and i.peer == peer
    ]


def check(schedule: Schedule) -> ScheduleReport:
    """Prove ``schedule`` complete, consistent and deadlock-free, and measure it.

    Order of checks: per-stage completeness and ordering; every SEND has its RECV (same
    set per channel); deadlock-freedom by simulation with unit times (a swapped RECV shows
    up here, naming the stuck stages); finally that each channel's SENDs and RECVs match
    in order, as in-order point-to-point transport (NCCL) requires.
    """
    S, M = schedule.num_stages, schedule.num_microbatches
    _validate_sizes(S, M)
    for s in range(S):
        _check_stage(schedule, s)
    channels = [(s, s + 1) for s in range(S - 1)] + [(s + 1, s) for s in range(S - 1)]
    for src, dst in channels:
        sends, recvs = _channel(schedule, "SEND", src, dst), _channel(schedule, "RECV", src, dst)
        if sorted(sends) != sorted(recvs):
            unmatched = sorted(set(sends) ^ set(recvs))
            raise ScheduleError(
                f"channel stage {src} -> stage {dst}: SENDs and RECVs do not match; "
                f"unmatched (phase, micro-batch): {unmatched}"
            )
    timeline = simulate(schedule, 1.0, 2.0, 0.0)
    for src, dst in channels:
        sends, recvs = _channel(schedule, "SEND", src, dst), _channel(schedule, "RECV", src, dst)
        if sends != recvs:
            k = next(i for i, (a, b) in enumerate(zip(sends, recvs)) if a != b)
            raise ScheduleError(
                f"channel stage {src} -> stage {dst}: message #{k} is sent as {sends[k]} "
                f"but received as {recvs[k]}; SEND/RECV order must match"
            )
    warmup = []
    for s in range(S):
        runs = schedule.runs(s)
        warmup.append(next(i for i, (phase, _) in enumerate(runs) if phase == BACKWARD))
    return ScheduleReport(
        name=schedule.name,
        num_stages=S,
        num_microbatches=M,
        bubble_fraction=timeline.bubble_fraction,
        clock_count=timeline.makespan,
        peak_in_flight=timeline.peak_in_flight,
        warmup_forwards=tuple(warmup),
    )
