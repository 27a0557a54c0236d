"""What a pipeline schedule does, as data: the simulated timeline a pipeline plan keeps, the
schedules' names, and eq. 2.

``passes.schedule`` builds schedules and simulates them into a ``Timeline``; a
``PipelinePlan`` holds that timeline and saves it, so the records live here, below both.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

SCHEDULE_NAMES = ("gpipe", "1f1b", "eager_1f1b", "interleaved_1f1b", "zb_h1", "inference")
"""The pipeline schedules (``passes.schedule.SCHEDULES`` builds each): what a plan's ``schedule`` may be."""


def pipeline_latency(times: Sequence[float], num_microbatches: int) -> float:
    """Eq. 2: sum of stage latencies plus (B - 1) times the slowest stage."""
    return float(sum(times)) + (num_microbatches - 1) * float(max(times))


@dataclass(frozen=True)
class TimelineRecord:
    """When one instruction ran. SEND/RECV/FREE have start == end (zero duration)."""

    stage: int
    kind: str
    phase: str
    microbatch: int
    start: float
    end: float
    mesh: int | None = None  # the mesh that ran it (simulate always sets it)


@dataclass(frozen=True)
class Timeline:
    """Result of ``simulate``: records per instruction, in each mesh's program order.

    ``peak_in_flight`` is per stage: micro-batches whose forward ran and whose backward
    (or B) has not. ``mesh_peak_in_flight`` sums that over each mesh's stages (the mesh's
    activation memory, in micro-batch chunks). ``peak_unfreed`` is per stage: forward ran,
    FREE not yet (adds ZB's micro-batches waiting for W); ``mesh_peak_unfreed`` sums it
    per mesh. ``bubble_fraction`` is idle time
    over all meshes' makespan; ``mesh_bubble_fractions`` the same per mesh.
    """

    records: tuple[TimelineRecord, ...]
    makespan: float
    bubble_fraction: float
    peak_in_flight: tuple[int, ...]
    mesh_peak_in_flight: tuple[int, ...] = ()
    peak_unfreed: tuple[int, ...] = ()
    mesh_bubble_fractions: tuple[float, ...] = ()
    mesh_peak_unfreed: tuple[int, ...] = ()
    transfer_time: float = 0.0
    """seconds the slowest cross-mesh SEND takes to arrive (every SEND's, in a plan made before ``transfer_times``)."""
    transfer_times: tuple[float, ...] = ()
    """per boundary b (between stages b and b + 1, both directions), seconds its SENDs take to arrive:
    a boundary inside a host is faster than one between hosts."""

    def link_time(self, boundary: int) -> float:
        """Seconds a SEND across ``boundary`` (stage b to b + 1 or back) takes to arrive."""
        return self.transfer_times[boundary] if self.transfer_times else self.transfer_time

    def transfers(self) -> list[tuple[TimelineRecord, int, float, float]]:
        """Each cross-mesh message: (its RECV record, the sending stage, when its SEND started, when it arrives)."""
        sends = {(r.stage, r.phase, r.microbatch): r for r in self.records if r.kind == "SEND"}
        out = []
        for r in self.records:
            if r.kind != "RECV":
                continue
            peer = r.stage - 1 if r.phase == "forward" else r.stage + 1
            send = sends.get((peer, r.phase, r.microbatch))
            if send is not None:
                out.append((r, peer, send.start, send.start + self.link_time(min(peer, r.stage))))
        return out

    def run(self, stage: int, phase: str, microbatch: int) -> TimelineRecord:
        """The RUN record of (stage, phase, micro-batch)."""
        for r in self.records:
            if r.kind == "RUN" and (r.stage, r.phase, r.microbatch) == (stage, phase, microbatch):
                return r
        raise KeyError((stage, phase, microbatch))
