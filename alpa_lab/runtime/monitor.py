"""What a training run records while it goes, in bounded memory, and the profile it adds up to.

A ``RunMonitor`` is written by the run's thread (after each step: the step's figures, the
mesh workers' new events, the devices' memory) and read by whoever watches (the dashboard,
at its own pace, through ``snapshot``). It keeps a *window* of detailed events (the last few
steps' instructions), every step's small record up to a cap, and per (stage, kind, phase)
the most recent durations for medians; so a run of any length holds a bounded amount.
``profile(plan, monitor)`` turns the medians into a ``cost.profile.Profile``: each measured
span next to the plan's prediction of it, split into the cost model's terms.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import numpy as np

from alpa_lab.cost.cluster import ClusterSpec
from alpa_lab.cost.profile import CostParts, Profile, ProfileError, rows_from
from alpa_lab.runtime.mesh_worker import Event

__all__ = ["MemoryRow", "MonitorSnapshot", "RunMonitor", "StepRecord", "profile"]


@dataclass(frozen=True)
class StepRecord:
    """One training step as the driver saw it."""

    step: int
    start: float
    """driver clock (``time.time()``) when the step was sent"""
    seconds: float
    loss: float | None
    samples: int
    flops: float
    link_bytes: Mapping[tuple[int, int], int] = field(default_factory=dict)
    """(sending worker, receiving worker) -> bytes this step (empty where the runtime does not count them)"""


@dataclass(frozen=True)
class MemoryRow:
    """One device's memory as its backend (or JAX's live buffers) reports it."""

    worker: int
    device: str
    device_id: int
    """the device's id in the plan (a mesh worker's local devices mapped to the plan's ids)"""
    bytes_in_use: int
    bytes_limit: int | None
    source: str
    """"backend" (``Device.memory_stats``) or "live buffers" (``jax.live_arrays``, where the backend has no stats)"""


@dataclass(frozen=True)
class MonitorSnapshot:
    """A consistent copy of what the monitor holds, for drawing."""

    version: int
    status: str
    error: str
    steps_done: int
    steps_total: int | None
    recent: tuple[StepRecord, ...]
    """the last steps' records (up to the monitor's cap), oldest first"""
    events: tuple[Event, ...]
    """the detailed window: every event of the last ``window_steps`` steps"""
    memory: tuple[MemoryRow, ...]
    durations: Mapping[tuple[int, str, str], tuple[float, ...]]
    transfer_bytes: Mapping[int, tuple[int, ...]]
    last_event_at: float
    """driver clock when the newest event reached the monitor"""
    samples_total: int
    seconds_total: float


def event_key(e: Event) -> tuple[int, str, str] | None:
    """The (stage, kind, phase) an event's duration counts toward (as ``views.stage_costs`` keys bars)."""
    if e.kind == "run":
        return (e.stage, "UPDATE", "apply") if e.phase == "apply" else (e.stage, "RUN", e.phase)
    if e.kind == "recv":
        return (e.mesh, "TRANSFER", "")
    return None


class RunMonitor:
    """A run's recorder: written by the run thread, read by any other (every method takes the lock)."""

    def __init__(self, window_steps: int = 4, max_steps: int = 10_000, durations_kept: int = 256, skip_first_step: bool = True):
        self.window_steps = window_steps
        self.durations_kept = durations_kept
        self.skip_first_step = skip_first_step
        """the first step compiles: its spans are shown but left out of the medians"""
        self._lock = threading.Lock()
        self._steps: deque[StepRecord] = deque(maxlen=max_steps)
        self._events: deque[Event] = deque()
        self._durations: dict[tuple[int, str, str], deque[float]] = {}
        self._transfer_bytes: dict[int, deque[int]] = {}
        self._memory: tuple[MemoryRow, ...] = ()
        self.version = 0
        self.status = "starting"
        self.error = ""
        self.steps_total: int | None = None
        self.samples_total = 0
        self.seconds_total = 0.0
        self.steps_done = 0
        self.last_event_at = 0.0

    # ----- writing (the run thread) ---------------------------------------------------------
    def add_events(self, events: Sequence[Event]) -> None:
        """One step's events (or several steps'), as the runtime recorded them.

        A phase can run as several programs (a stage's update as one per group of its
        variables): its pieces on one worker are summed into one duration, so each sample is
        a whole phase, as the plan predicts it. Workers of one mesh run the same phase side
        by side: each gives its own sample. A transfer is priced per message: one sample each.
        """
        if not events:
            return
        now = time.time()
        with self._lock:
            phases: dict[tuple[Any, ...], float] = {}  # (key, worker, step, micro-batch) -> seconds, in first-seen order
            for e in events:
                self._events.append(e)
                key = event_key(e)
                if key is None or (self.skip_first_step and e.step == 0):
                    continue
                if e.kind == "recv":
                    self._durations.setdefault(key, deque(maxlen=self.durations_kept)).append(e.end - e.start)
                    self._transfer_bytes.setdefault(e.mesh, deque(maxlen=self.durations_kept)).append(e.nbytes)
                else:
                    piece = (key, e.worker, e.step, e.microbatch)
                    phases[piece] = phases.get(piece, 0.0) + (e.end - e.start)
            for (key, *_), seconds in phases.items():
                self._durations.setdefault(key, deque(maxlen=self.durations_kept)).append(seconds)
            newest = max(e.step for e in events)
            while self._events and self._events[0].step <= newest - self.window_steps:
                self._events.popleft()
            self.last_event_at = now
            self.version += 1

    def add_step(self, record: StepRecord) -> None:
        with self._lock:
            self._steps.append(record)
            self.steps_done = max(self.steps_done, record.step + 1)
            if not (self.skip_first_step and record.step == 0):
                self.samples_total += record.samples
                self.seconds_total += record.seconds
            self.version += 1

    def set_memory(self, rows: Sequence[MemoryRow]) -> None:
        with self._lock:
            self._memory = tuple(rows)
            self.version += 1

    def set_status(self, status: str, error: str = "") -> None:
        with self._lock:
            self.status, self.error = status, error
            self.version += 1

    # ----- reading --------------------------------------------------------------------------
    def snapshot(self, recent: int = 500) -> MonitorSnapshot:
        with self._lock:
            steps = tuple(self._steps)[-recent:] if recent else tuple(self._steps)
            return MonitorSnapshot(
                version=self.version,
                status=self.status,
                error=self.error,
                steps_done=self.steps_done,
                steps_total=self.steps_total,
                recent=steps,
                events=tuple(self._events),
                memory=self._memory,
                durations={k: tuple(v) for k, v in self._durations.items()},
                transfer_bytes={k: tuple(v) for k, v in self._transfer_bytes.items()},
                last_event_at=self.last_event_at,
                samples_total=self.samples_total,
                seconds_total=self.seconds_total,
            )

    def steps(self) -> tuple[StepRecord, ...]:
        with self._lock:
            return tuple(self._steps)


def median_step(records: Sequence[StepRecord]) -> float:
    """Median step seconds, the first (compiling) step left out when there are others."""
    steady = [r.seconds for r in records if r.step > 0] or [r.seconds for r in records]
    return float(np.median(steady)) if steady else 0.0


def profile(plan: Any, monitor: RunMonitor, serial: bool = False) -> Profile:
    """The run's measured medians against the plan's predicted parts (``cost.profile``); ``serial``: the run ran
    its unit tasks one at a time (the in-process runtime), so its step is also compared with the plan's so."""
    from alpa_lab.plan import PipelinePlan

    snap = monitor.snapshot(recent=0)
    if not snap.recent:
        raise ProfileError("the run has not finished a step yet: nothing to profile")
    cluster = ClusterSpec(**plan.cluster)
    measured: dict[tuple[int, str, str], Sequence[float]] = dict(snap.durations)
    collectives: dict[str, float] = {}
    figures: dict[tuple[int, str, str], float] = {}
    if isinstance(plan, PipelinePlan):
        parts = pipeline_parts(plan, snap.transfer_bytes)
        for st in plan.stages:  # the plan's own figures (measured ones, under the profiling cost model)
            figures[(st.index, "RUN", "forward")] = st.forward_time
            figures[(st.index, "RUN", "backward")] = st.backward_time
            figures[(st.index, "RUN", "backward_weight")] = st.weight_gradient_time
            figures[(st.index, "RUN", "backward_input")] = st.backward_input_time
            figures[(st.index, "UPDATE", "apply")] = st.apply_time
        for st in plan.stages:
            for o in st.plan.ops:
                for c in o.collectives:
                    collectives[c.kind] = collectives.get(c.kind, 0.0) + c.cost
    else:
        compute = plan.compute_cost
        # no launch term: the planner charges a single-mesh plan no task overhead (its objective is compute + communication)
        parts = {(0, "STEP", "step"): CostParts(compute, plan.objective - compute, 0.0)}
        steady = [r.seconds for r in snap.recent if r.step > 0] or [r.seconds for r in snap.recent]
        measured[(0, "STEP", "step")] = steady
        for o in plan.ops:
            for c in o.collectives:
                collectives[c.kind] = collectives.get(c.kind, 0.0) + c.cost
    rows = rows_from(parts, measured, cluster, figures)
    if not rows:
        raise ProfileError(
            "no measured span matches the plan's stages (the first step compiles and is left out): run two steps or more"
        )
    return Profile(
        fingerprint=plan.fingerprint,
        cluster_spec=dict(plan.cluster),
        rows=rows,
        steps=snap.steps_done,
        step_predicted=plan.estimated_step_time,
        step_measured=median_step(snap.recent),
        collectives=collectives,
        step_serial_predicted=plan.serial_step_time if serial and isinstance(plan, PipelinePlan) else 0.0,
    )


def pipeline_parts(plan: Any, transfer_bytes: Mapping[int, Sequence[int]] | None = None) -> dict[tuple[int, str, str], CostParts]:
    """Per (stage, kind, phase) the predicted parts of one span, as the runtimes' events key them.

    Zero-bubble schedules run the backward as B and W: the stage's backward is shared out in
    the plan's ratio (W is the weight-gradient ops' share). Transfers into a mesh are priced
    per message (each tensor is one), from the median bytes measured into it.
    """
    from alpa_lab.passes.pipeline import stage_parts
    from alpa_lab.passes.schedule import BACKWARD_INPUT, BACKWARD_WEIGHT
    from alpa_lab.passes.stages import APPLY, BACKWARD, FORWARD

    problem = plan.problem
    if problem is None:
        raise ProfileError("the plan has no planner state (loaded from JSON?): make it current with step.use(plan, ...) first")
    cluster = ClusterSpec(**plan.cluster)
    out: dict[tuple[int, str, str], CostParts] = {}
    for st in plan.stages:
        sp = stage_parts(problem, st.plan, st.layers)
        out[(st.index, "RUN", FORWARD)] = sp[FORWARD]
        out[(st.index, "RUN", BACKWARD)] = sp[BACKWARD]
        out[(st.index, "UPDATE", APPLY)] = sp[APPLY]
        b = sp[BACKWARD]
        w = st.weight_gradient_time / st.backward_time if st.backward_time > 0 else 0.0
        out[(st.index, "RUN", BACKWARD_WEIGHT)] = CostParts(b.compute * w, b.communication * w, 1.0)
        out[(st.index, "RUN", BACKWARD_INPUT)] = CostParts(b.compute * (1 - w), b.communication * (1 - w), 1.0)
    hosts = {st.index: {d // cluster.devices_per_host for d in st.device_ids} for st in plan.stages}
    one_host = len(set().union(*hosts.values())) == 1
    for mesh, sizes in (transfer_bytes or {}).items():
        if sizes:
            bw = cluster.intra_host_bandwidth if one_host else cluster.host_link
            out[(mesh, "TRANSFER", "")] = CostParts(communication=float(np.median(sizes)) / bw, transfers=1.0)
    return out
