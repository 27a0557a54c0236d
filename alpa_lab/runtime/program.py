"""What each mesh worker runs: a compiled plan cut by mesh, as plain data the driver ships once.

The in-process runtime (``runtime/pipeline.py``) and the Ray runtime read the same compiled
program: the unit tasks of ``compile_pipeline`` (or the one jitted program of
``compile_plan``), the schedule's instruction lists and the FREE counts. This module cuts
that description by mesh (Alpa sec. 6: one static instruction list per mesh) and adds what
a worker needs to run its part without the driver:

- its unit tasks as ``jax.export`` serialisations (StableHLO with the plan's shardings;
  deserialised on the worker and called on its own devices: the driver never runs them);
- its RUN lists (``schedule.runs`` of the stages on its mesh);
- every cross-mesh tensor it sends or receives as a ``Move``: the plan's unit tasks
  (``sharding.cross_mesh``, MLSys'23 broadcast: each region a receiving host needs crosses
  to it once, from the sender device the load balancing chose), per micro-batch, once per
  step, or as new state for the next step. The worker on a sender's host slices the region
  from that device's shard; the worker on the receiving host assembles its devices' tiles;
  so a mesh spanning hosts (a ``jax.distributed`` group, one worker per host) sends and
  receives like any other;
- which step results (the new state, the loss) it produces, and where the new state goes.

A single-mesh plan is the degenerate case: no micro-batch tasks, one "apply" task that is the
whole step. Nothing here holds live JAX objects except in ``export_task``.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import jax
from jax.sharding import PartitionSpec

from alpa_lab.graph.opgraph import dtype_of
from alpa_lab.sharding.cross_mesh import CrossMeshResharding

__all__ = ["MeshPlacement", "Move", "ProgramTask", "WorkerProgram", "worker_programs", "mesh_placements", "predicted_traffic"]

STATE = -2
"""The micro-batch index under which a new state leaf travels to the workers that read it next step."""
STEP = -1
"""The micro-batch index of once-per-step tensors (averaged gradients, update results)."""

MICROBATCH, PER_STEP, NEXT_STEP = "microbatch", "step", "state"
"""When a ``Move`` happens: every micro-batch, once per step, or at the end of a step (new state)."""


def move_kind(tag: int) -> str:
    """The kind of move a message's micro-batch tag stands for."""
    return NEXT_STEP if tag == STATE else PER_STEP if tag == STEP else MICROBATCH


class ProgramError(ValueError):
    """The compiled plan cannot be cut into mesh-worker programs (says why and what to do)."""


@dataclass(frozen=True)
class MeshPlacement:
    """One mesh of the plan on the cluster: its devices (global ids), the host(s) they are on."""

    mesh: int
    device_ids: tuple[int, ...]
    hosts: tuple[int, ...]
    stages: tuple[int, ...]
    devices_per_host: int = 0

    def host_of(self, device: int) -> int:
        return device // self.devices_per_host if self.devices_per_host else self.hosts[0]

    def devices_on(self, host: int) -> tuple[int, ...]:
        """This mesh's devices on ``host``, sorted: the order of that host's worker's local devices."""
        return tuple(sorted(d for d in self.device_ids if self.host_of(d) == host))

    def local_position(self, device: int) -> tuple[int, int]:
        """(rank of the device's host in the mesh's worker group, index among that worker's devices)."""
        host = self.host_of(device)
        return self.hosts.index(host), self.devices_on(host).index(device)


@dataclass(frozen=True)
class ProgramTask:
    """A unit task as shipped: its exported program, the tensors it reads and writes, their specs."""

    stage: int
    phase: str
    exported: bytes = field(repr=False)
    invars: tuple[int, ...]
    outvars: tuple[int, ...]
    in_specs: tuple[PartitionSpec, ...]


@dataclass(frozen=True)
class Move:
    """One tensor going from the mesh that makes it to a mesh that reads it, as the plan's unit tasks.

    ``var`` is the tensor as messages name it (for new state, the state argument it
    becomes). ``resharding`` is the same ``cross_mesh_resharding`` the planner and the
    Traffic view price: each unit task's ``groups`` give, per receiving host, the sender
    device whose shard the region is cut from.
    """

    var: int
    kind: str
    src_mesh: int
    dst_mesh: int
    src_stage: int
    dst_stage: int
    src_spec: PartitionSpec
    dst_spec: PartitionSpec
    resharding: CrossMeshResharding = field(repr=False)

    def host_pairs(self) -> dict[tuple[int, int], tuple[tuple[int, int], ...]]:
        """(sender host, receiving host) -> (unit task, sender device) of each region crossing between them.

        One message per pair and move carries them all; a region reaches a receiving host once.
        """
        out: dict[tuple[int, int], list[tuple[int, int]]] = defaultdict(list)
        rs = self.resharding
        for k, t in enumerate(rs.tasks):
            for s, chain in t.groups:
                out[(rs.host_of(s), rs.host_of(chain[0]))].append((k, s))
        return {pair: tuple(ks) for pair, ks in out.items()}

    def bytes_between_hosts(self) -> dict[tuple[int, int], int]:
        """(sender host, receiving host) -> bytes of one move."""
        tasks = self.resharding.tasks
        return {pair: sum(tasks[k].nbytes for k, _ in ks) for pair, ks in self.host_pairs().items()}


@dataclass(frozen=True)
class WorkerProgram:
    """Everything one mesh worker needs to run its meshes' part of every step."""

    worker: int
    placement: MeshPlacement
    stage_shapes: dict[int, tuple[int, int]]
    """stage -> logical mesh shape (all on this worker's devices, in the stage's device order)"""
    stage_devices: dict[int, tuple[int, ...]]
    tasks: dict[tuple[int, str], ProgramTask]
    runs: dict[int, tuple[tuple[str, int], ...]]
    update: tuple[ProgramTask, ...]
    num_microbatches: int
    inputs: dict[int, bool]
    """step arguments (flat var ids) read here -> is it cut into micro-batches"""
    var_dtypes: dict[int, str]
    accumulated: frozenset[int]
    local_readers: dict[int, int]
    """per-micro-batch tensor -> how many of this worker's tasks read it (FREE after the last)"""
    state_out: tuple[tuple[int, int, tuple[int, ...]], ...]
    """(result var, state argument var, workers that read that argument) for new state made here"""
    remote_state: frozenset[int]
    """state arguments read here whose new value another worker makes each step"""
    results: tuple[tuple[int, int], ...]
    """(flat result index, var) of the non-state results made here, returned to the driver"""
    moves_out: dict[tuple[int, str], tuple[Move, ...]] = field(default_factory=dict)
    """(tensor, kind) made here -> its move to each other mesh that reads it"""
    moves_in: dict[tuple[int, str], Move] = field(default_factory=dict)
    """(tensor, kind) made on another mesh and read here -> its move"""

    @property
    def num_tasks(self) -> int:
        return len(self.tasks) + len(self.update)


def mesh_placements(compiled: Any, devices_per_host: int) -> tuple[MeshPlacement, ...]:
    """The plan's meshes: their devices, hosts and stages (a pipeline's, or the one mesh of a plan)."""
    if hasattr(compiled, "schedule"):
        sched = compiled.schedule
        out = []
        for p in range(sched.num_meshes):
            stages = sched.stages_of(p)
            ids = tuple(compiled.stages[stages[0]].device_ids)
            out.append(MeshPlacement(p, ids, tuple(sorted({d // devices_per_host for d in ids})), tuple(stages), devices_per_host))
        return tuple(out)
    ids = tuple(compiled.plan.device_ids)
    return (MeshPlacement(0, ids, tuple(sorted({d // devices_per_host for d in ids})), (0,), devices_per_host),)


def export_task(fn: Any, graph: Any, invars: Sequence[int], in_shardings: Sequence[Any]) -> bytes:
    """``fn`` (jitted with the plan's shardings) serialised with ``jax.export`` for these inputs."""
    avals = [jax.ShapeDtypeStruct(graph.vars[v].shape, dtype_of(graph.vars[v].dtype), sharding=s) for v, s in zip(invars, in_shardings)]
    return bytes(jax.export.export(fn)(*avals).serialize())


def worker_programs(compiled: Any, graph: Any, placements: Sequence[MeshPlacement], num_state: int) -> tuple[WorkerProgram, ...]:
    """Cut a ``CompiledPipeline`` (or ``CompiledPlan``) into one program per mesh worker.

    ``num_state``: how many leading flat arguments are the state, which the step returns as
    its leading results (``step(state, batch) -> (state, ...)``) and which stays on the workers.
    """
    pipelined = hasattr(compiled, "schedule")
    worker_of_stage = {s: pl.mesh for pl in placements for s in pl.stages}

    # every unit task, the stage it runs on, and whether it runs per micro-batch
    per_mb: list[tuple[tuple[int, str], Any]] = list(compiled.tasks.items()) if pipelined else []
    if pipelined:
        update = list(compiled.update)
    else:
        update = [_WholeStep(compiled, graph)]
    producer: dict[int, int] = {}  # var -> worker making it
    for (s, _), t in per_mb:
        for v in t.outvars:
            producer[v] = worker_of_stage[s]
    for t in update:
        for v in t.outvars:
            producer.setdefault(v, worker_of_stage[t.stage])
    arg_readers: dict[int, set[int]] = defaultdict(set)  # step argument -> the workers that read it
    invars = set(graph.invars)
    for t in [*(t for _, t in per_mb), *update]:
        for v in t.invars:
            if v in invars:
                arg_readers[v].add(worker_of_stage[t.stage])

    split = dict(zip(graph.invars, compiled.split)) if pipelined else {v: False for v in graph.invars}
    state_args = graph.invars[:num_state]
    results = graph.outvars
    if len(results) < num_state:
        raise ProgramError(
            f"the step returns {len(results)} results but takes {num_state} state leaves; it must return the new state first"
        )
    for i, (o, v) in enumerate(zip(results[:num_state], state_args)):
        kind = graph.vars[o].kind
        if o in producer:
            continue
        if kind == "input" and o == v:
            continue  # a leaf the step returns unchanged stays where it is
        raise ProgramError(
            f"state leaf {graph.in_paths[i] if i < len(graph.in_paths) else i} comes back as a {kind} "
            "(not computed by the step, not the same leaf): the Ray runtime keeps the state on the workers and cannot "
            "follow it; return the state leaf itself or a value computed from it"
        )

    moves = _moves(compiled, placements) if pipelined else []
    programs = []
    for pl in placements:
        w = pl.mesh
        mine = set(pl.stages)
        tasks = {}
        for (s, phase), t in per_mb:
            if s in mine:
                tasks[(s, phase)] = _ship(t, graph)
        ups = tuple(_ship(t, graph) for t in update if t.stage in mine)
        touched = {v for t in list(tasks.values()) + list(ups) for v in (*t.invars, *t.outvars)}
        local_readers: dict[int, int] = defaultdict(int)
        for t in tasks.values():
            for v in t.invars:
                if v not in invars:
                    local_readers[v] += 1
        made_here = {v for v, p in producer.items() if p == w}
        accumulated = frozenset(v for v in compiled.slicing.accumulated if v in made_here) if pipelined else frozenset()
        state_out = []
        remote_state = set()
        for o, v in zip(results[:num_state], state_args):
            readers = tuple(sorted(arg_readers.get(v, ())))
            if producer.get(o) == w:
                state_out.append((o, v, readers))
            elif w in readers and o in producer and producer[o] != w:
                remote_state.add(v)
        moves_out: dict[tuple[int, str], list[Move]] = defaultdict(list)
        for m in moves:
            if m.src_mesh == w:
                moves_out[(m.var, m.kind)].append(m)
        programs.append(
            WorkerProgram(
                worker=w,
                placement=pl,
                stage_shapes={s: tuple(compiled.stages[s].logical_shape) for s in pl.stages}
                if pipelined
                else {0: tuple(compiled.plan.mesh_shape)},
                stage_devices={s: tuple(compiled.stages[s].device_ids) for s in pl.stages}
                if pipelined
                else {0: tuple(compiled.plan.device_ids)},
                tasks=tasks,
                runs={s: tuple(compiled.schedule.runs(s)) for s in pl.stages} if pipelined else {},
                update=ups,
                num_microbatches=compiled.num_microbatches if pipelined else 1,
                inputs={v: split[v] for v in graph.invars if w in arg_readers.get(v, ())},
                var_dtypes={v: graph.vars[v].dtype for v in touched},
                accumulated=accumulated,
                local_readers=dict(local_readers),
                state_out=tuple(state_out),
                remote_state=frozenset(remote_state),
                results=tuple((i, o) for i, o in enumerate(results) if i >= num_state and producer.get(o) == w),
                moves_out={k: tuple(ms) for k, ms in moves_out.items()},
                moves_in={(m.var, m.kind): m for m in moves if m.dst_mesh == w},
            )
        )
    return tuple(programs)


def _moves(compiled: Any, placements: Sequence[MeshPlacement]) -> list[Move]:
    """Every tensor a mesh sends another: the plan's own cross-mesh transfers (``passes.transfers``, what the
    Traffic view shows), one per tensor, kind and reading mesh.

    With interleaving, two stages on one mesh may read the same tensor: it moves once, in
    the spec of the first of them, and the other reshards it on the mesh.
    """
    from alpa_lab.passes.transfers import STATE as STATE_PHASE
    from alpa_lab.passes.transfers import stage_transfers
    from alpa_lab.passes.stages import APPLY

    mesh_of = {s: pl.mesh for pl in placements for s in pl.stages}
    per_host = placements[0].devices_per_host or None
    out: dict[tuple[int, str, int], Move] = {}
    for t in stage_transfers(compiled.graph, compiled.slicing, compiled.stages, devices_per_host=per_host):
        src, dst = mesh_of[t.src_stage], mesh_of[t.dst_stage]
        kind = NEXT_STEP if t.phase == STATE_PHASE else PER_STEP if t.phase == APPLY else MICROBATCH
        if src == dst or (t.var, kind, dst) in out:
            continue
        rs = t.resharding
        out[(t.var, kind, dst)] = Move(
            t.var, kind, src, dst, t.src_stage, t.dst_stage, rs.src_spec.to_partition_spec(), rs.dst_spec.to_partition_spec(), rs
        )
    return list(out.values())


def predicted_traffic(programs: Sequence[WorkerProgram]) -> dict[tuple[tuple[int, int], tuple[int, int]], int]:
    """Bytes per step from each mesh worker to each other, ``((mesh, host), (mesh, host))``, as the unit tasks say.

    Every region crosses once into each receiving host that needs it (MLSys'23 broadcast),
    every micro-batch or once per step; computed from the plan's moves, independently of
    what the workers count.
    """
    out: dict[tuple[tuple[int, int], tuple[int, int]], int] = defaultdict(int)
    for p in programs:
        for moves in p.moves_out.values():
            for m in moves:
                times = p.num_microbatches if m.kind == MICROBATCH else 1
                for (hs, hr), n in m.bytes_between_hosts().items():
                    out[((m.src_mesh, hs), (m.dst_mesh, hr))] += n * times
    return dict(out)


@dataclass(frozen=True, eq=False)
class _WholeStep:
    """A single-mesh plan's one program, seen as the one once-per-step unit task of stage 0."""

    compiled: Any
    graph: Any
    stage: int = 0
    phase: str = "apply"

    @property
    def invars(self) -> tuple[int, ...]:
        return tuple(self.graph.invars)

    @property
    def outvars(self) -> tuple[int, ...]:
        return tuple(self.graph.outvars)

    @property
    def fn(self) -> Any:
        return self.compiled.fn

    @property
    def in_shardings(self) -> tuple[Any, ...]:
        return tuple(self.compiled.in_shardings)


def _ship(task: Any, graph: Any) -> ProgramTask:
    return ProgramTask(
        stage=task.stage,
        phase=task.phase,
        exported=export_task(task.fn, graph, task.invars, task.in_shardings),
        invars=tuple(task.invars),
        outvars=tuple(task.outvars),
        in_specs=tuple(s.spec for s in task.in_shardings),
    )
