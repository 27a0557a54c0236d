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

Beyond Alpa:

* ``interleaved_1f1b``: Megatron-LM's interleaved 1F1B (Narayanan et al., SC'21). The
  model is cut into S = P v *virtual* stages, stage s on mesh s % P, so each of the P
  meshes holds v model chunks; the pipeline bubble shrinks by v at the price of v times
  more point-to-point messages. A mesh runs its chunks from one list, so
  ``Schedule.instructions`` is indexed by *mesh* and ``Instruction.stage`` names the
  virtual stage; ``Schedule.mesh_of_stage`` says where each stage lives.
* ``zb_h1``: ZB-H1 from Zero Bubble Pipeline Parallelism (Qi et al., ICLR'24). The
  backward is split into B (``backward_input``, the gradient w.r.t. the stage input, on
  the critical path) and W (``backward_weight``, the weight gradient, deferrable). Stage
  i defers its W passes by i micro-batches so they fill the cool-down bubble.

Conventions for the two:

* Stages that share a mesh hand activations and gradients over in device memory: there is
  no SEND/RECV between them (a transfer is only emitted across meshes), and the consumer
  RUN simply has to come after the producer RUN in the mesh's list (``check`` verifies).
  A channel is an ordered pair of meshes (as NCCL point-to-point between two ranks), so
  with interleaving one channel carries several stage boundaries, forward and backward
  messages mixed, and their SEND and RECV orders must still agree; Megatron's order does.
* With a split backward, the gradient SEND follows B and the FREE follows W.
* ``peak_in_flight`` counts micro-batches that hold their full forward stash (forward ran,
  B or fused backward not yet). ZB-H1's W only keeps the smaller weight-gradient inputs
  (the paper's M_W <= M_B), so it is reported apart, in ``peak_unfreed`` (forward ran,
  FREE not yet); for fused-backward schedules the two are equal.

Pure Python, no JAX: the schedule is a planning artifact, tested without devices.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from alpa_lab.plan.timeline import Timeline, TimelineRecord  # data a PipelinePlan keeps: defined below the passes

__all__ = [
    "BACKWARD",
    "BACKWARD_INPUT",
    "BACKWARD_WEIGHT",
    "FORWARD",
    "KINDS",
    "PHASES",
    "INFERENCE",
    "SCHEDULES",
    "TRAINING_SCHEDULES",
    "SPLIT_BACKWARD",
    "Instruction",
    "Schedule",
    "ScheduleError",
    "ScheduleReport",
    "Timeline",
    "TimelineRecord",
    "WARMUP_SCHEDULES",
    "check",
    "eager_one_f_one_b",
    "gpipe",
    "interleaved_one_f_one_b",
    "make_schedule",
    "one_f_one_b",
    "one_f_one_b_estimate",
    "one_f_one_b_windows",
    "simulate",
    "warmup_makespan",
    "warmup_peaks",
    "warmup_timeline",
    "zb_h1",
]

FORWARD = "forward"
BACKWARD = "backward"
BACKWARD_INPUT = "backward_input"  # ZB's B: gradient w.r.t. the stage input (critical path)
BACKWARD_WEIGHT = "backward_weight"  # ZB's W: gradient w.r.t. the weights (deferrable)
KINDS = ("RUN", "SEND", "RECV", "FREE")
PHASES = (FORWARD, BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT)
_GRAD_PHASES = (BACKWARD, BACKWARD_INPUT)  # the backwards whose output goes to stage - 1


class ScheduleError(ValueError):
    """A schedule is incomplete, inconsistent or deadlocks."""


@dataclass(frozen=True)
class Instruction:
    """One step of a mesh's static program.

    ``stage`` is the (virtual) stage the step belongs to; ``peer`` is the other stage of
    a SEND/RECV; ``None`` for RUN/FREE.
    """

    kind: str
    stage: int
    microbatch: int
    phase: str
    peer: int | None = None

    def __post_init__(self) -> None:
        try:
            if (self.kind, self.phase, self.peer is None) in _VALID_INSTRUCTIONS:
                return  # the common case in one lookup: schedules are made of 100,000s of these
        except TypeError:  # an unhashable kind or phase: said below, as any other bad one
            pass
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


_VALID_INSTRUCTIONS = frozenset(
    (kind, phase, kind in ("RUN", "FREE")) for kind in KINDS for phase in PHASES
)
"""(kind, phase, peer is None) of every well-formed instruction"""


@dataclass(frozen=True)
class Schedule:
    """One instruction list per mesh, each in execution order.

    ``mesh_of_stage[s]`` is the mesh that runs stage s; empty means one stage per mesh
    (stage s on mesh s, the Alpa case), so ``instructions[s]`` is stage s's list.
    """

    name: str
    num_stages: int
    num_microbatches: int
    instructions: tuple[tuple[Instruction, ...], ...]
    mesh_of_stage: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not self.mesh_of_stage:
            if len(self.instructions) != self.num_stages:
                raise ValueError(
                    f"schedule {self.name!r} has {len(self.instructions)} instruction lists "
                    f"for {self.num_stages} stages"
                )
            return
        P = len(self.instructions)
        if len(self.mesh_of_stage) != self.num_stages:
            raise ValueError(
                f"schedule {self.name!r}: mesh_of_stage has {len(self.mesh_of_stage)} entries "
                f"for {self.num_stages} stages"
            )
        if any(isinstance(p, bool) or not isinstance(p, int) or not 0 <= p < P for p in self.mesh_of_stage):
            raise ValueError(
                f"schedule {self.name!r}: mesh_of_stage {self.mesh_of_stage} must name meshes 0..{P - 1} "
                f"(one instruction list per mesh)"
            )
        if set(self.mesh_of_stage) != set(range(P)):
            idle = sorted(set(range(P)) - set(self.mesh_of_stage))
            raise ValueError(f"schedule {self.name!r}: meshes {idle} run no stage")

    @property
    def num_meshes(self) -> int:
        return len(self.instructions)

    @functools.cached_property
    def program(self) -> _Program:
        """What each instruction waits for and an order to run them in (``simulate``'s work that does not
        depend on the times: made once per schedule); raises ``ScheduleError`` if the lists deadlock."""
        return _compile(self)

    @functools.cached_property
    def split_backward(self) -> bool:
        """Whether the backward is split into B and W (ZB) instead of one fused pass
        (for a schedule by name: ``SPLIT_BACKWARD``)."""
        return any(i.phase in (BACKWARD_INPUT, BACKWARD_WEIGHT) for prog in self.instructions for i in prog)

    def mesh(self, stage: int) -> int:
        """The mesh that runs ``stage``."""
        return self.mesh_of_stage[stage] if self.mesh_of_stage else stage

    @functools.cached_property
    def stage_meshes(self) -> tuple[int, ...]:
        """``mesh(s)`` for every stage s, made once: the checker, compiler and simulator index it per instruction."""
        return tuple(self.mesh(s) for s in range(self.num_stages))

    def stages_of(self, mesh: int) -> tuple[int, ...]:
        """The stages (model chunks) ``mesh`` holds, in stage order."""
        return tuple(s for s in range(self.num_stages) if self.mesh(s) == mesh)

    def runs(self, stage: int) -> tuple[tuple[str, int], ...]:
        """The (phase, micro-batch) RUN order on ``stage``: the schedule without its comms."""
        return tuple(
            (i.phase, i.microbatch)
            for i in self.instructions[self.mesh(stage)]
            if i.kind == "RUN" and i.stage == stage
        )

    def mesh_runs(self, mesh: int) -> tuple[tuple[int, str, int], ...]:
        """The (stage, phase, micro-batch) RUN order on ``mesh``: its program without comms.

        With several stages per mesh this is the order the mesh interleaves its chunks in.
        """
        return tuple((i.stage, i.phase, i.microbatch) for i in self.instructions[mesh] if i.kind == "RUN")


# ---------------------------------------------------------------------------------------
# Schedule construction
# ---------------------------------------------------------------------------------------


def _validate_count(label: str, v: int) -> None:
    if isinstance(v, bool) or not isinstance(v, int):
        raise ValueError(f"{label} must be an int, got {v!r}")  # noqa: TRY004 (API: ValueError)
    if v < 1:
        raise ValueError(f"{label} must be >= 1, got {v}")


def _validate_sizes(num_stages: int, num_microbatches: int) -> None:
    _validate_count("num_stages", num_stages)
    _validate_count("num_microbatches", num_microbatches)


def _lower(order: Sequence[tuple[int, str, int]], mesh_of: Sequence[int]) -> tuple[Instruction, ...]:
    """Expand a mesh's RUN order of (stage, phase, micro-batch) into its full program.

    Receives go right before the RUN that needs them and sends right after the RUN that
    produced the data, so that matching SEND/RECV pairs appear in the same order on both
    ends of each channel (required for NCCL-style in-order point-to-point). Neighbouring
    stages on the same mesh exchange nothing: the data is already there.
    """
    out: list[Instruction] = []
    last = len(mesh_of) - 1
    # per stage: whether its previous / next stage lives on another mesh (data must travel)
    before = [s > 0 and mesh_of[s] != mesh_of[s - 1] for s in range(last + 1)]
    after = [s < last and mesh_of[s] != mesh_of[s + 1] for s in range(last + 1)]
    add = out.append

    for stage, phase, m in order:
        if phase == FORWARD:
            if before[stage]:
                add(Instruction("RECV", stage, m, FORWARD, stage - 1))
            add(Instruction("RUN", stage, m, FORWARD))
            if after[stage]:
                add(Instruction("SEND", stage, m, FORWARD, stage + 1))
        elif phase == BACKWARD_WEIGHT:
            add(Instruction("RUN", stage, m, BACKWARD_WEIGHT))
            add(Instruction("FREE", stage, m, BACKWARD_WEIGHT))
        else:  # BACKWARD (fused: FREE at once) or BACKWARD_INPUT (FREE waits for W)
            if after[stage]:
                add(Instruction("RECV", stage, m, phase, stage + 1))
            add(Instruction("RUN", stage, m, phase))
            if phase == BACKWARD:
                add(Instruction("FREE", stage, m, BACKWARD))
            if before[stage]:
                add(Instruction("SEND", stage, m, phase, stage - 1))
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
    identity = range(num_stages)
    return Schedule(
        name,
        num_stages,
        num_microbatches,
        tuple(
            _lower([(s, p, m) for p, m in _warmup_then_1b1f(num_microbatches, warmup(s))], identity)
            for s in range(num_stages)
        ),
    )


_WARMUP: dict[str, Callable[[int, int, int], int]] = {
    "gpipe": lambda S, M, s: M,
    "1f1b": lambda S, M, s: S - s,
    "eager_1f1b": lambda S, M, s: 2 * (S - s - 1) + 1,  # 0-based s is 1-based s + 1: 2 (S - (s + 1)) + 1
    "inference": lambda S, M, s: M,
}
"""The schedules that are a warm-up of forwards then 1B1F, one stage per mesh: stage s's warm-up forwards
(capped at M) for S stages and M micro-batches"""
WARMUP_SCHEDULES = frozenset(_WARMUP)


def gpipe(num_stages: int, num_microbatches: int) -> Schedule:
    """GPipe: all forwards, then all backwards; peak in-flight is M on every stage."""
    _validate_sizes(num_stages, num_microbatches)
    return _build("gpipe", num_stages, num_microbatches, lambda s: _WARMUP["gpipe"](num_stages, num_microbatches, s))


def one_f_one_b(num_stages: int, num_microbatches: int) -> Schedule:
    """PipeDream-flush 1F1B: stage i (0-based) keeps at most min(S - i, M) micro-batches in flight.

    It runs min(S - i, M) forwards before its first backward (S - i - 1 warm-up plus the
    first steady-state forward), then 1B1F, then the cool-down backwards.
    """
    _validate_sizes(num_stages, num_microbatches)
    return _build("1f1b", num_stages, num_microbatches, lambda s: _WARMUP["1f1b"](num_stages, num_microbatches, s))


def eager_one_f_one_b(num_stages: int, num_microbatches: int) -> Schedule:
    """Eager-1F1B (MLSys'23): stage i (1-based) runs min(2 (S - i) + 1, M) forwards first.

    The extra warm-up lets each stage's forward SEND overlap with its next forward, so
    cross-mesh resharding hides behind compute, at the price of more in-flight memory.
    """
    _validate_sizes(num_stages, num_microbatches)
    return _build("eager_1f1b", num_stages, num_microbatches, lambda s: _WARMUP["eager_1f1b"](num_stages, num_microbatches, s))


def interleaved_one_f_one_b(num_stages: int, num_microbatches: int, num_meshes: int) -> Schedule:
    """Megatron-LM interleaved 1F1B: S = P v virtual stages, stage s on mesh s % P.

    Mesh p walks its M v (chunk, micro-batch) forwards in Megatron's order: groups of P
    micro-batches, each group through chunk 0, 1, ..., v - 1 (backwards: chunk v - 1
    first). It runs (v - 1) P + 2 (P - p - 1) warm-up forwards, then 1F1B, then drains, as
    Megatron does; with M = P every mesh runs all its forwards first (Megatron's special
    case). Needs M % P == 0 so every group is full. With f, b the per-chunk times and no
    transfer cost the makespan is (M v + P - 1)(f + b): the 1F1B bubble (P - 1)(F + B) of
    whole-model-slice times F = v f, B = v b, divided by v.
    """
    _validate_sizes(num_stages, num_microbatches)
    _validate_count("num_meshes", num_meshes)
    S, M, P = num_stages, num_microbatches, num_meshes
    if S % P:
        raise ScheduleError(f"interleaved_1f1b: num_stages {S} must be a multiple of num_meshes {P}")
    if M % P:
        raise ScheduleError(
            f"interleaved_1f1b: num_microbatches {M} must be a multiple of num_meshes {P} "
            "(Megatron's interleaved schedule runs micro-batches in groups of P)"
        )
    v, total = S // P, M * (S // P)

    def chunk_step(p: int, k: int, backward: bool) -> tuple[int, str, int]:
        c = (k // P) % v
        m = (k // (P * v)) * P + k % P
        if backward:
            return ((v - 1 - c) * P + p, BACKWARD, m)
        return (c * P + p, FORWARD, m)

    programs = []
    for p in range(P):
        warmup = total if M == P else min((v - 1) * P + 2 * (P - p - 1), total)
        order = [chunk_step(p, k, False) for k in range(warmup)]
        for k in range(total - warmup):
            order += [chunk_step(p, warmup + k, False), chunk_step(p, k, True)]
        order += [chunk_step(p, k, True) for k in range(max(total - warmup, 0), total)]
        programs.append(order)
    mesh_of = tuple(s % P for s in range(S))
    return Schedule(
        "interleaved_1f1b", S, M, tuple(_lower(order, mesh_of) for order in programs), mesh_of
    )


def zb_h1(num_stages: int, num_microbatches: int) -> Schedule:
    """ZB-H1 (Qi et al., ICLR'24): 1F1B with the backward split into B and W, W deferred.

    Stage i (0-based) runs F and B in exactly 1F1B's order (min(S - i, M) forwards, then
    1B1F), so at most min(S - i, M) micro-batches hold their full forward stash, as in
    1F1B. W of micro-batch j - i follows B of micro-batch j: stage i defers i W passes,
    which lets the gradient chain (B only) run ahead and the deferred Ws fill the tail
    bubble. Every stage then holds at most min(S, M) micro-batches' W inputs (M_W <= M_B
    each), never more memory than 1F1B's first stage. With F = B = W = 1, no transfer cost
    and M >= S the makespan is 3 M + S - 1, bubble S - 1 per stage: the paper's
    (S - 1)(F + B - W), one third of 1F1B's 3 (S - 1).
    """
    _validate_sizes(num_stages, num_microbatches)
    S, M = num_stages, num_microbatches
    programs = []
    for i in range(S):
        warmup = min(S - i, M)
        order = [(i, FORWARD, m) for m in range(warmup)]
        nf = warmup
        for j in range(M):
            order.append((i, BACKWARD_INPUT, j))
            if j >= i:
                order.append((i, BACKWARD_WEIGHT, j - i))
            if nf < M:
                order.append((i, FORWARD, nf))
                nf += 1
        order += [(i, BACKWARD_WEIGHT, m) for m in range(max(M - i, 0), M)]
        programs.append(order)
    return Schedule("zb_h1", S, M, tuple(_lower(order, range(S)) for order in programs))


def inference(num_stages: int, num_microbatches: int) -> Schedule:
    """Alpa's inference pipeline (``pipeline_schedule="inference"``): each stage runs every micro-batch's forward
    in turn, as GPipe's forwards. A forward-only step has no backward ops, so the backward RUNs GPipe's lists keep
    run nothing and take no time: the checks, the simulation and the runtime of the training schedules run it as
    they are."""
    _validate_sizes(num_stages, num_microbatches)
    return _build(INFERENCE, num_stages, num_microbatches, lambda s: num_microbatches)


INFERENCE = "inference"
SCHEDULES: dict[str, Callable[..., Schedule]] = {  # in the order of plan.timeline.SCHEDULE_NAMES
    "gpipe": gpipe,
    "1f1b": one_f_one_b,
    "eager_1f1b": eager_one_f_one_b,
    "interleaved_1f1b": interleaved_one_f_one_b,
    "zb_h1": zb_h1,
    INFERENCE: inference,
}
TRAINING_SCHEDULES = tuple(name for name in SCHEDULES if name != INFERENCE)
"""The schedules of a training step (a forward, a backward and an update); ``INFERENCE`` is a forward-only step's."""
_TAKES_NUM_MESHES = frozenset({"interleaved_1f1b"})  # several stages per mesh
SPLIT_BACKWARD = frozenset({"zb_h1"})
"""The schedules whose backward is split into B and W (``Schedule.split_backward``), known without building one."""


def make_schedule(
    name: str, num_stages: int, num_microbatches: int, *, num_meshes: int | None = None
) -> Schedule:
    """Build a schedule by name ("gpipe", "1f1b", "eager_1f1b", "interleaved_1f1b", "zb_h1").

    ``num_meshes`` is required by "interleaved_1f1b" (S / num_meshes chunks per mesh);
    the others run one stage per mesh, so it must be omitted or equal ``num_stages``.
    """
    if name not in SCHEDULES:
        raise ValueError(f"unknown pipeline schedule {name!r}; known: {', '.join(sorted(SCHEDULES))}")
    if name in _TAKES_NUM_MESHES:
        if num_meshes is None:
            raise ValueError(f"schedule {name!r} needs num_meshes (stages are spread over fewer meshes)")
        return SCHEDULES[name](num_stages, num_microbatches, num_meshes)
    if num_meshes is not None and num_meshes != num_stages:
        raise ValueError(
            f"schedule {name!r} runs one stage per mesh: num_meshes must be {num_stages} or None, "
            f"got {num_meshes}"
        )
    return SCHEDULES[name](num_stages, num_microbatches)


# ---------------------------------------------------------------------------------------
# Simulation
# ---------------------------------------------------------------------------------------


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


def one_f_one_b_windows(stage_times: Sequence[float], transfer_times: Sequence[float]) -> np.ndarray:
    """The period each window of stages i..j imposes on 1F1B at steady state.

    Stages i..j hold j - i + 1 micro-batches between them, and each must go through their
    forwards and backwards and over their boundaries twice (activation out, gradient back):
    (sum t_i + 2 sum c_b) / (j - i + 1), for every i <= j (one stage alone: its t_i).
    """
    t = np.asarray(stage_times, dtype=float)
    c = np.asarray(transfer_times, dtype=float)
    if len(c) != len(t) - 1:
        raise ValueError(f"{len(c)} transfer times for the {len(t) - 1} boundaries of {len(t)} stages")
    T = np.concatenate([[0.0], np.cumsum(t)])
    C = np.concatenate([[0.0], np.cumsum(c)])  # C[j] - C[i]: boundaries i..j-1, inside stages i..j
    i, j = np.triu_indices(len(t))
    return (T[j + 1] - T[i] + 2 * (C[j] - C[i])) / (j - i + 1)


def warmup_makespan(
    name: str,
    forward_time: Sequence[float],
    backward_time: Sequence[float],
    transfer_time: Sequence[float],
    num_microbatches: int,
) -> float:
    """The makespan ``simulate`` gives schedule ``name`` (one of ``_WARMUP``'s: gpipe, 1f1b, eager_1f1b) for
    these per-stage times and per-boundary transfers, without its instruction lists (``_warmup_runs``).

    It is what a search that simulates many stage counts once each needs (building, compiling and
    simulating a schedule of 32 stages and 1,024 micro-batches took 0.65 s here, this 50 ms);
    ``tests/test_schedule.py`` checks it equals ``simulate`` exactly.
    """
    *_, clock = _warmup_runs(name, forward_time, backward_time, transfer_time, num_microbatches)
    return max(clock, default=0.0)


def warmup_timeline(
    name: str,
    forward_time: Sequence[float],
    backward_time: Sequence[float],
    transfer_time: Sequence[float],
    num_microbatches: int,
    *,
    records: bool = True,
) -> Timeline:
    """``simulate(make_schedule(name, S, M), ...)`` for a warm-up schedule (gpipe, 1f1b, eager_1f1b), every
    field and record the same, without building, checking or compiling its instruction lists. Times are per
    stage (S of them) and per boundary (S - 1; one number: every boundary's).

    The planner simulates the plan it keeps; for GPT-39B (32 stages, 1,024 micro-batches) the lists are
    225,000 instructions, and making them and working out what each waits for took 0.5 s of its 10. The
    schedule's shape fixes the rest: a RECV runs right before the RUN that needs it, a SEND and a FREE right
    after the RUN that made the data (``_lower``), so each takes its RUN's start or end; stage s holds at most
    min(warm-up forwards, M) micro-batches, freed as its fused backward runs. ``tests/test_schedule.py`` checks
    the whole timeline equals ``simulate``'s.
    """
    S, M = len(forward_time), num_microbatches
    if isinstance(transfer_time, (int, float)):
        transfer_time = (transfer_time,) * max(S - 1, 0)
    orders, starts, clock = _warmup_runs(name, forward_time, backward_time, transfer_time, num_microbatches)
    ft, bt = _per_stage(forward_time, S, "forward_time"), _per_stage(backward_time, S, "backward_time")
    link = tuple(float(t) for t in transfer_time)
    makespan = max(clock, default=0.0)
    busy = [0.0] * S  # summed as simulate sums it: each RUN's end - start, in the mesh's order
    kept: list[TimelineRecord] = []
    add = kept.append
    for s in range(S):
        dur = {FORWARD: ft[s], BACKWARD: bt[s]}
        before, after = s > 0, s < S - 1
        for (phase, m), t in zip(orders[s], starts[s], strict=True):
            e = t + dur[phase]
            busy[s] += e - t
            if not records:
                continue
            if phase == FORWARD:
                if before:
                    add(TimelineRecord(s, "RECV", phase, m, t, t, s))
                add(TimelineRecord(s, "RUN", phase, m, t, e, s))
                if after:
                    add(TimelineRecord(s, "SEND", phase, m, e, e, s))
            else:
                if after:
                    add(TimelineRecord(s, "RECV", phase, m, t, t, s))
                add(TimelineRecord(s, "RUN", phase, m, t, e, s))
                add(TimelineRecord(s, "FREE", phase, m, e, e, s))
                if before:
                    add(TimelineRecord(s, "SEND", phase, m, e, e, s))
    peaks = warmup_peaks(name, S, M)
    return Timeline(
        records=tuple(kept),
        makespan=makespan,
        bubble_fraction=1.0 - sum(busy) / (S * makespan) if makespan > 0 else 0.0,
        peak_in_flight=peaks,
        mesh_peak_in_flight=peaks,
        peak_unfreed=peaks,
        mesh_bubble_fractions=tuple(1.0 - b / makespan if makespan > 0 else 0.0 for b in busy),
        mesh_peak_unfreed=peaks,
        transfer_time=max(link, default=0.0),
        transfer_times=link,
    )


def warmup_peaks(name: str, num_stages: int, num_microbatches: int) -> tuple[int, ...]:
    """Per stage, the most micro-batches in flight under warm-up schedule ``name``: its warm-up forwards (at
    most M), as ``simulate`` counts them (``peak_in_flight``), without building the schedule."""
    return tuple(min(_WARMUP[name](num_stages, num_microbatches, s), num_microbatches) for s in range(num_stages))


def _warmup_runs(
    name: str,
    forward_time: Sequence[float],
    backward_time: Sequence[float],
    transfer_time: Sequence[float],
    num_microbatches: int,
) -> tuple[list[list[tuple[str, int]]], list[list[float]], list[float]]:
    """Each stage's RUN order under warm-up schedule ``name``, each RUN's start, and each stage's last end.

    A RUN starts at the later of its mesh's last end and its input's end plus the boundary's transfer; that
    recurrence is walked over the RUNs alone, in the order ``_build`` gives them (``_warmup_then_1b1f``),
    each stage advancing while its inputs exist.
    """
    if name not in _WARMUP:
        raise ValueError(f"warm-up schedules are {', '.join(sorted(_WARMUP))}, not {name!r} (simulate its schedule)")
    S, M = len(forward_time), num_microbatches
    _validate_sizes(S, M)
    forward_time, backward_time = _per_stage(forward_time, S, "forward_time"), _per_stage(backward_time, S, "backward_time")
    transfer_time = tuple(float(t) for t in transfer_time)
    if len(transfer_time) != max(S - 1, 0) or any(not math.isfinite(t) or t < 0 for t in transfer_time):
        raise ValueError(f"transfer_time must be {max(S - 1, 0)} finite times >= 0 (one per boundary), got {transfer_time}")
    orders = [_warmup_then_1b1f(M, _WARMUP[name](S, M, s)) for s in range(S)]  # each stage's RUNs, as _build has them
    ends = {FORWARD: [[None] * M for _ in range(S)], BACKWARD: [[None] * M for _ in range(S)]}
    # per stage and phase: where its input comes from (stage s - 1's forward, s + 1's backward; None: no other
    # stage), that boundary's transfer, the RUN's own time, and this stage's ends
    feeds = [
        {
            FORWARD: (ends[FORWARD][s - 1] if s > 0 else None, transfer_time[s - 1] if s > 0 else 0.0,
                      forward_time[s], ends[FORWARD][s]),
            BACKWARD: (ends[BACKWARD][s + 1] if s < S - 1 else None, transfer_time[s] if s < S - 1 else 0.0,
                       backward_time[s], ends[BACKWARD][s]),
        }
        for s in range(S)
    ]
    starts: list[list[float]] = [[] for _ in range(S)]
    clock, k = [0.0] * S, [0] * S
    progress = True
    while progress:
        progress = False
        for s in range(S):
            t, i, order, feed, began = clock[s], k[s], orders[s], feeds[s], starts[s].append
            while i < len(order):
                phase, m = order[i]
                source, link, duration, mine = feed[phase]
                if source is not None:
                    ready = source[m]
                    if ready is None:
                        break
                    if ready + link > t:
                        t = ready + link
                began(t)
                t += duration
                mine[m] = t
                i += 1
                progress = True
            k[s], clock[s] = i, t
    stuck = [s for s in range(S) if k[s] < 2 * M]
    if stuck:
        raise ScheduleError(f"schedule {name!r} deadlocks: stuck stages {stuck}")
    return orders, starts, clock


def one_f_one_b_estimate(stage_times: Sequence[float], transfer_times: Sequence[float], num_microbatches: int) -> float:
    """1F1B's makespan without simulating it: B - 1 periods (the slowest window's,
    ``one_f_one_b_windows``), then one micro-batch's trip through every stage and boundary.

    An estimate of ``simulate``, not a bound: within a few percent once B >= 8 S
    (``tests/test_schedule.py``), too high with few micro-batches (the fill dominates).
    Microseconds for 64 stages, so a search can call it where the simulation (O(S B)) is too slow.
    """
    period = float(one_f_one_b_windows(stage_times, transfer_times).max())
    return (num_microbatches - 1) * period + float(sum(stage_times)) + 2 * float(sum(transfer_times))


def _where(schedule: Schedule, mesh: int) -> str:
    """How messages name a program: by stage when each mesh runs one stage, else by mesh."""
    return f"mesh {mesh}" if schedule.mesh_of_stage else f"stage {mesh}"


@dataclass(frozen=True)
class _Program:
    """A schedule's instruction lists compiled for timing: what each instruction waits for
    and one order they can run in, worked out once (they do not depend on the times).

    Instructions are numbered mesh by mesh in list order; index ``n`` (one past the last) is
    a sentinel that finished at time 0. ``steps`` holds, in a feasible execution order, per
    instruction: (index, previous instruction on its mesh, the dependency whose arrival
    needs a link time added, that boundary (``len(link)`` for none: 0 s), the other
    dependency, its duration slot (``num_stages * 4`` for zero-duration)). The peaks are
    structural too: a stage's instructions all run in its mesh's list order.
    """

    steps: tuple[tuple[int, int, int, int, int, int], ...]
    offsets: tuple[int, ...]  # first index of each mesh's list (and n at the end)
    run_slots: tuple[tuple[int, int], ...]  # (index, duration slot) of every RUN
    peak_in_flight: tuple[int, ...]
    mesh_peak_in_flight: tuple[int, ...]
    peak_unfreed: tuple[int, ...]
    mesh_peak_unfreed: tuple[int, ...]


_PHASE_SLOT = {FORWARD: 0, BACKWARD: 1, BACKWARD_INPUT: 2, BACKWARD_WEIGHT: 3}


def _compile(schedule: Schedule) -> _Program:
    """Walk every mesh's list as far as its inputs allow, round after round, recording what each
    instruction waited for; if no mesh can advance while some still have instructions left,
    the schedule deadlocks (whatever the times) and ``ScheduleError`` names them."""
    S, P = schedule.num_stages, schedule.num_meshes
    mesh_of = schedule.stage_meshes
    offsets = [0]
    for prog in schedule.instructions:
        offsets.append(offsets[-1] + len(prog))
    n, none_link, zero = offsets[-1], max(S - 1, 0), 4 * S
    pc = [0] * P
    sent: dict[tuple[int | None, int, str, int], int] = {}  # (src, dst, phase, mb) -> the SEND
    received: dict[tuple[int, str, int], int] = {}  # (stage, phase, mb) -> the RECV
    ran: dict[tuple[int, str, int], int] = {}  # (stage, phase, mb) -> the RUN
    steps: list[tuple[int, int, int, int, int, int]] = []
    run_slots: list[tuple[int, int]] = []
    in_flight, peak = [0] * S, [0] * S
    unfreed, peak_unfreed = [0] * S, [0] * S
    mesh_in_flight, mesh_peak = [0] * P, [0] * P
    mesh_unfreed, mesh_peak_unfreed = [0] * P, [0] * P

    def neighbour(s: int, other: int, phase: str, m: int) -> int | None:
        """What brings stage ``other``'s output for (s, phase, m) to s's mesh."""
        if mesh_of[other] == mesh_of[s]:
            return ran.get((other, phase, m))
        return received.get((s, phase, m))

    progress = True
    while progress:
        progress = False
        for p in range(P):
            prog, base = schedule.instructions[p], offsets[p]
            k = pc[p]
            while k < len(prog):
                ins = prog[k]
                s, phase, m, kind = ins.stage, ins.phase, ins.microbatch, ins.kind
                if not 0 <= s < S or mesh_of[s] != p:
                    raise ScheduleError(f"instruction {ins} is in {_where(schedule, p)}'s list")
                a, link, b = n, none_link, n
                if kind == "RECV":
                    found = sent.get((ins.peer, s, phase, m))
                    if found is None:
                        break
                    a, link = found, min(s, ins.peer)  # type: ignore[type-var]
                elif kind != "RUN":  # SEND, FREE: the data must exist, so its own RUN ran
                    found = ran.get((s, phase, m))
                    if found is None:
                        break
                    b = found
                elif phase == FORWARD:
                    if s > 0:
                        found = neighbour(s, s - 1, FORWARD, m)
                        if found is None:
                            break
                        b = found
                elif phase == BACKWARD_WEIGHT:
                    found = ran.get((s, BACKWARD_INPUT, m))
                    if found is None:
                        break
                    b = found
                else:
                    found = ran.get((s, FORWARD, m))
                    other = neighbour(s, s + 1, phase, m) if s < S - 1 else n
                    if found is None or other is None:
                        break
                    a, b = found, other
                i = base + k
                slot = zero
                if kind == "RUN":
                    slot = _PHASE_SLOT[phase] * S + s
                    ran[(s, phase, m)] = i
                    run_slots.append((i, slot))
                    if phase == FORWARD:
                        in_flight[s] += 1
                        unfreed[s] += 1
                        mesh_in_flight[p] += 1
                        mesh_unfreed[p] += 1
                        peak[s] = max(peak[s], in_flight[s])
                        peak_unfreed[s] = max(peak_unfreed[s], unfreed[s])
                        mesh_peak[p] = max(mesh_peak[p], mesh_in_flight[p])
                        mesh_peak_unfreed[p] = max(mesh_peak_unfreed[p], mesh_unfreed[p])
                    elif phase in _GRAD_PHASES:
                        in_flight[s] -= 1
                        mesh_in_flight[p] -= 1
                elif kind == "SEND":
                    sent[(s, ins.peer, phase, m)] = i
                elif kind == "RECV":
                    received[(s, phase, m)] = i
                else:
                    unfreed[s] -= 1
                    mesh_unfreed[p] -= 1
                steps.append((i, i - 1 if k else n, a, link, b, slot))
                k += 1
                progress = True
            pc[p] = k

    stuck = [p for p in range(P) if pc[p] < len(schedule.instructions[p])]
    if stuck:
        detail = "; ".join(f"{_where(schedule, p)} waits at {schedule.instructions[p][pc[p]]}" for p in stuck)
        what = "meshes" if schedule.mesh_of_stage else "stages"
        raise ScheduleError(f"schedule {schedule.name!r} deadlocks: stuck {what} {stuck}: {detail}")
    return _Program(
        tuple(steps), tuple(offsets), tuple(run_slots), tuple(peak), tuple(mesh_peak), tuple(peak_unfreed),
        tuple(mesh_peak_unfreed),
    )


def simulate(
    schedule: Schedule,
    forward_time: float | Sequence[float] = 1.0,
    backward_time: float | Sequence[float] = 2.0,
    transfer_time: float | Sequence[float] = 0.0,
    weight_time: float | Sequence[float] | None = None,
    *,
    records: bool = True,
) -> Timeline:
    """Run every mesh's list in order, each instruction as soon as its inputs exist.

    A RUN forward needs stage s - 1's activation: RECV'd from another mesh, or that
    stage's RUN on the same mesh. A RUN backward (fused, or B) needs its own forward and
    stage s + 1's gradient, likewise; a W needs its own B. A RECV completes when the
    peer's matching SEND has executed plus ``transfer_time`` (one time, or one per boundary
    between stages b and b + 1: a link inside a host is faster than one between hosts). SENDs are non-blocking.
    There is no contention other than each mesh being sequential (across all its
    stages), so each instruction's start is the later of its mesh's clock and its inputs'
    arrival, worked out in an order where inputs come first: exact. If no mesh can
    advance while some still have instructions left, the schedule deadlocks and
    ``ScheduleError`` names them.

    What waits for what is worked out once per schedule (``_compile``, kept on it), so a
    search that simulates one schedule with many stage times pays for it once;
    ``records=False`` leaves the per-instruction records out (the makespan and the other
    figures are the same).

    Times are per (virtual) stage. ``weight_time`` chooses how the backward splits:

    * ``None`` (default): ``backward_time`` is the whole backward; a split schedule runs
      B and W in half of it each. So the same arguments give every schedule the same work
      (defaults: F 1, B 1, W 1 against a fused backward of 2).
    * given: ``backward_time`` is B and ``weight_time`` is W; a fused backward takes
      their sum.
    """
    S, P = schedule.num_stages, schedule.num_meshes
    ft = _per_stage(forward_time, S, "forward_time")
    bt = _per_stage(backward_time, S, "backward_time")
    if weight_time is None:
        b_time = tuple(b / 2 for b in bt)
        w_time = b_time
        fused = bt
    else:
        b_time = bt
        w_time = _per_stage(weight_time, S, "weight_time")
        fused = tuple(b + w for b, w in zip(bt, w_time, strict=True))
    if isinstance(transfer_time, (int, float)):  # one time for every boundary, or one per boundary
        transfer_time = (transfer_time,) * max(S - 1, 0)
    link = tuple(float(t) for t in transfer_time)
    if len(link) != max(S - 1, 0):
        raise ValueError(f"transfer_time has {len(link)} entries for the {max(S - 1, 0)} boundaries of {S} stages")
    if any(not math.isfinite(t) or t < 0 for t in link):
        raise ValueError(f"transfer_time must be finite and >= 0, got {transfer_time}")
    program = schedule.program
    duration = [*ft, *fused, *b_time, *w_time, 0.0]  # by _PHASE_SLOT * S + stage; the last: zero
    arrival = [*link, 0.0]
    n = program.offsets[-1]
    start, end = [0.0] * (n + 1), [0.0] * (n + 1)
    for i, before, a, lk, b, slot in program.steps:
        t = end[before]
        x = end[a] + arrival[lk]
        if x > t:
            t = x
        x = end[b]
        if x > t:
            t = x
        start[i] = t
        end[i] = t + duration[slot]

    offsets = program.offsets
    makespan = max((end[offsets[p + 1] - 1] for p in range(P) if offsets[p + 1] > offsets[p]), default=0.0)
    busy = [0.0] * P
    mesh_of = schedule.stage_meshes
    for i, slot in program.run_slots:
        busy[mesh_of[slot % S]] += end[i] - start[i]
    bubble = 1.0 - sum(busy) / (P * makespan) if makespan > 0 else 0.0
    kept: tuple[TimelineRecord, ...] = ()
    if records:
        kept = tuple(
            TimelineRecord(ins.stage, ins.kind, ins.phase, ins.microbatch, start[i], end[i], p)
            for p, prog in enumerate(schedule.instructions)
            for i, ins in enumerate(prog, offsets[p])
        )
    return Timeline(
        records=kept,
        makespan=makespan,
        bubble_fraction=bubble,
        peak_in_flight=program.peak_in_flight,
        mesh_peak_in_flight=program.mesh_peak_in_flight,
        peak_unfreed=program.peak_unfreed,
        mesh_bubble_fractions=tuple(1.0 - b / makespan if makespan > 0 else 0.0 for b in busy),
        mesh_peak_unfreed=program.mesh_peak_unfreed,
        transfer_time=max(link, default=0.0),
        transfer_times=link,
    )


# ---------------------------------------------------------------------------------------
# Checker
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ScheduleReport:
    """What ``check`` proved and measured.

    Unit times: forward 1, backward 2 (split schedules: B 1 and W 1), no transfer cost.
    Per-stage fields are indexed by (virtual) stage, ``mesh_*`` fields by mesh.
    """

    name: str
    num_stages: int
    num_microbatches: int
    bubble_fraction: float
    clock_count: float  # makespan in units of one forward
    peak_in_flight: tuple[int, ...]
    warmup_forwards: tuple[int, ...]  # forwards each stage runs before its first backward
    num_meshes: int = 0
    mesh_peak_in_flight: tuple[int, ...] = ()
    mesh_warmup_forwards: tuple[int, ...] = ()  # forwards each mesh runs before its first backward
    mesh_bubble_fractions: tuple[float, ...] = ()
    peak_unfreed: tuple[int, ...] = ()  # forward ran, FREE not yet (ZB: includes W pending)
    mesh_peak_unfreed: tuple[int, ...] = ()


def _remote(schedule: Schedule, a: int, b: int) -> bool:
    """Whether stage b exists and lives on another mesh than stage a (data must travel)."""
    return 0 <= b < schedule.num_stages and schedule.mesh(a) != schedule.mesh(b)


def _stage_program(schedule: Schedule, s: int) -> list[Instruction]:
    return [i for i in schedule.instructions[schedule.mesh(s)] if i.stage == s]


def _check_stage(schedule: Schedule, s: int, split: bool) -> None:
    """Every micro-batch's forward, backward (or B and W) and FREE exactly once, in a legal order.

    Missing or duplicated work is reported before misordering, since a missing RUN makes
    every instruction that depends on it look misordered.
    """
    S, M = schedule.num_stages, schedule.num_microbatches
    grad = BACKWARD_INPUT if split else BACKWARD  # the pass whose output goes to stage - 1
    last = BACKWARD_WEIGHT if split else BACKWARD  # the last pass that needs the activations
    runs = (FORWARD, BACKWARD_INPUT, BACKWARD_WEIGHT) if split else (FORWARD, BACKWARD)
    prog = _stage_program(schedule, s)
    remote = {s - 1: _remote(schedule, s, s - 1), s + 1: _remote(schedule, s, s + 1)}  # the only peers a message may name
    count: dict[tuple[str, str, int], int] = {}
    for ins in prog:
        if not 0 <= ins.microbatch < M:
            raise ScheduleError(f"{ins}: micro-batch out of range 0..{M - 1}")
        if ins.kind == "RUN" and ins.phase not in runs:
            raise ScheduleError(
                f"{ins}: this schedule's backward is {'split into B and W' if split else 'fused'}"
            )
        if ins.kind in ("SEND", "RECV"):
            if ins.phase not in (FORWARD, grad):
                raise ScheduleError(f"{ins}: only forward activations and {grad} gradients travel")
            expect = s + 1 if (ins.phase == FORWARD) == (ins.kind == "SEND") else s - 1
            if ins.peer != expect or not 0 <= expect < S:
                raise ScheduleError(
                    f"{ins}: a {ins.phase} {ins.kind} of stage {s} must pair with stage {expect}"
                    + ("" if 0 <= expect < S else " (no such stage)")
                )
            if not remote[expect]:
                raise ScheduleError(
                    f"{ins}: stages {s} and {expect} share mesh {schedule.mesh(s)}; "
                    "they hand data over in memory, without SEND/RECV"
                )
        key = (ins.kind, ins.phase, ins.microbatch)
        count[key] = count.get(key, 0) + 1
    duplicated = [key for key, n in count.items() if n > 1]
    if duplicated:
        kind, phase, m = min(duplicated)
        raise ScheduleError(f"stage {s} has {kind} {phase} of micro-batch {m} {count[kind, phase, m]} times")
    for m in range(M):
        for phase in runs:
            if ("RUN", phase, m) not in count:
                raise ScheduleError(f"missing {phase} of (stage {s}, micro-batch {m})")
        if ("FREE", last, m) not in count:
            raise ScheduleError(f"missing FREE of (stage {s}, micro-batch {m})")
        if remote[s - 1] and ("RECV", FORWARD, m) not in count:
            raise ScheduleError(f"missing RECV forward of (stage {s}, micro-batch {m}) from stage {s - 1}")
        if remote[s + 1] and ("RECV", grad, m) not in count:
            raise ScheduleError(f"missing RECV {grad} of (stage {s}, micro-batch {m}) from stage {s + 1}")
    if any(k[0] == "FREE" and k[1] != last for k in count):
        raise ScheduleError(f"stage {s}: FREE must carry phase {last!r} (it follows the {last})")
    seen: set[tuple[str, str, int]] = set()
    for ins in prog:
        m = ins.microbatch
        if ins.kind == "SEND" and ("RUN", ins.phase, m) not in seen:
            raise ScheduleError(f"{ins} comes before the RUN that produces its data")
        if ins.kind == "RUN" and ins.phase == grad and ("RUN", FORWARD, m) not in seen:
            raise ScheduleError(f"stage {s} runs the {grad} of micro-batch {m} before its forward")
        if ins.kind == "RUN" and ins.phase == BACKWARD_WEIGHT and ("RUN", BACKWARD_INPUT, m) not in seen:
            raise ScheduleError(f"stage {s} runs the W of micro-batch {m} before its B")
        if ins.kind == "FREE" and ("RUN", last, m) not in seen:
            raise ScheduleError(f"{ins} frees activations before the {last} that needs them")
        seen.add((ins.kind, ins.phase, m))


def _check_local_handover(schedule: Schedule, p: int, split: bool) -> None:
    """Neighbouring stages on one mesh: the producer's RUN must precede the consumer's."""
    grad = BACKWARD_INPUT if split else BACKWARD
    seen: set[tuple[int, str, int]] = set()
    for s, phase, m in schedule.mesh_runs(p):
        src = s - 1 if phase == FORWARD else s + 1 if phase == grad else None
        local = src is not None and 0 <= src < schedule.num_stages and not _remote(schedule, s, src)
        if local and (src, phase, m) not in seen:
            raise ScheduleError(
                f"mesh {p} runs {phase} of (stage {s}, micro-batch {m}) before the {phase} "
                f"of stage {src} on the same mesh that feeds it"
            )
        seen.add((s, phase, m))


def _channel(schedule: Schedule, kind: str, src: int, dst: int) -> list[tuple]:
    """Messages on the directed channel mesh src -> mesh dst, in the order ``kind``'s side issues them.

    A message is (phase, micro-batch) when each mesh runs one stage (the pair of meshes
    names the pair of stages), else (source stage, destination stage, phase, micro-batch).
    """
    side, peer = (src, dst) if kind == "SEND" else (dst, src)
    mesh_of = schedule.stage_meshes
    out: list[tuple] = []
    for i in schedule.instructions[side]:
        if i.kind == kind and i.peer is not None and mesh_of[i.peer] == peer:
            edge = (i.stage, i.peer) if kind == "SEND" else (i.peer, i.stage)
            out.append((*edge, i.phase, i.microbatch) if schedule.mesh_of_stage else (i.phase, i.microbatch))
    return out


def _first_backward(runs: Sequence[tuple[str, int]]) -> int:
    return next((k for k, (phase, _) in enumerate(runs) if phase in _GRAD_PHASES), len(runs))


def check(schedule: Schedule) -> ScheduleReport:
    """Prove ``schedule`` complete, consistent and deadlock-free, and measure it.

    Order of checks: every instruction sits in its stage's mesh's list; per-stage
    completeness and ordering; same-mesh hand-overs in producer-consumer order; every SEND
    has its RECV (same set per channel, a channel being an ordered pair of meshes);
    deadlock-freedom by simulation with unit times (a
    swapped RECV shows up here, naming the stuck stages or meshes); finally that each
    channel's SENDs and RECVs match in order, as in-order point-to-point transport (NCCL)
    requires.
    """
    S, M = schedule.num_stages, schedule.num_microbatches
    _validate_sizes(S, M)
    mesh_of = schedule.stage_meshes
    for p, prog in enumerate(schedule.instructions):
        for ins in prog:
            if not 0 <= ins.stage < S or mesh_of[ins.stage] != p:
                raise ScheduleError(f"instruction {ins} is in {_where(schedule, p)}'s list")
    split = schedule.split_backward
    for s in range(S):
        _check_stage(schedule, s, split)
    for p in range(schedule.num_meshes):
        _check_local_handover(schedule, p, split)
    boundaries = {(schedule.mesh(s), schedule.mesh(s + 1)) for s in range(S - 1) if _remote(schedule, s, s + 1)}
    channels = sorted(boundaries | {(b, a) for a, b in boundaries})
    what = "src stage, dst stage, phase, micro-batch" if schedule.mesh_of_stage else "phase, micro-batch"
    messages = {(src, dst): (_channel(schedule, "SEND", src, dst), _channel(schedule, "RECV", src, dst)) for src, dst in channels}
    for (src, dst), (sends, recvs) in messages.items():
        if sorted(sends) != sorted(recvs):
            unmatched = sorted(set(sends) ^ set(recvs))
            raise ScheduleError(
                f"channel {_where(schedule, src)} -> {_where(schedule, dst)}: SENDs and RECVs do not "
                f"match; unmatched ({what}): {unmatched}"
            )
    timeline = simulate(schedule, 1.0, 2.0, 0.0, records=False)
    for (src, dst), (sends, recvs) in messages.items():
        if sends != recvs:
            k = next(i for i, (a, b) in enumerate(zip(sends, recvs)) if a != b)
            raise ScheduleError(
                f"channel {_where(schedule, src)} -> {_where(schedule, dst)}: message #{k} is sent as {sends[k]} "
                f"but received as {recvs[k]}; SEND/RECV order must match"
            )
    return ScheduleReport(
        name=schedule.name,
        num_stages=S,
        num_microbatches=M,
        bubble_fraction=timeline.bubble_fraction,
        clock_count=timeline.makespan,
        peak_in_flight=timeline.peak_in_flight,
        warmup_forwards=tuple(_first_backward(schedule.runs(s)) for s in range(S)),
        num_meshes=schedule.num_meshes,
        mesh_peak_in_flight=timeline.mesh_peak_in_flight,
        mesh_warmup_forwards=tuple(
            _first_backward([(ph, m) for _, ph, m in schedule.mesh_runs(p)])
            for p in range(schedule.num_meshes)
        ),
        mesh_bubble_fractions=timeline.mesh_bubble_fractions,
        peak_unfreed=timeline.peak_unfreed,
        mesh_peak_unfreed=timeline.mesh_peak_unfreed,
    )
