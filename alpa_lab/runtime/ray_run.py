"""Launch a plan on a Ray cluster of mesh workers, run steps there, read state and events back.

The driver (this process, e.g. the notebook's kernel) owns a ``RayRun``: the mesh-worker
actors (one per mesh, placed with a Ray placement group, one bundle per worker), a small
record per worker (host, pid, devices, stages), and the last state it fetched. ``step(batch)``
sends one ``run_step`` message per worker carrying only the batch leaves that worker reads;
the workers exchange activations and gradients among themselves and return only the
step's non-state results (the loss). A worker that dies or raises fails the step at once
with an error naming its host, worker, mesh and stages; the other workers are stopped, and
the last state the driver fetched stays available to launch again from.

A step's seconds (``last_step_seconds``, what the monitor compares with the plan's
prediction) are the step alone: the copy of the state back to the driver (every
``keep_state_every`` steps) is a separate call after it, timed on its own
(``last_state_seconds``). Events come back in the driver's clock: each worker's offset to it is
measured at launch, and a transfer's RECV starts when its sender sent it (the sender's clock)
and ends when the receiver had it (the receiver's clock).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import jax
import numpy as np

from alpa_lab.graph.trace import leaf_aval
from alpa_lab.passes.schedule import INFERENCE
from alpa_lab.runtime.mesh_worker import EVENTS_KEPT, INLINE_BYTES, Event, MeshWorker, host_data, typed
from alpa_lab.runtime.program import ProgramError, WorkerProgram, mesh_placements, predicted_traffic, worker_programs
from alpa_lab.runtime.ray_cluster import RayCluster, _ray

__all__ = ["LaunchError", "MeshWorkerError", "RayRun", "WorkerInfo", "align_events", "launch"]


class LaunchError(ValueError):
    """The plan cannot be launched on this cluster (nothing was started, or what was started is stopped again)."""


class MeshWorkerError(RuntimeError):
    """A mesh worker failed a step; ``worker`` names it. The run is closed; the last state is kept."""

    def __init__(self, message: str, worker: WorkerInfo | None = None):
        super().__init__(message)
        self.worker = worker


def _room_shortage(ray: Any, bundles: list[dict[str, float]], wait: float = 0.0) -> str | None:
    """Why the mesh workers' ``bundles`` cannot be placed now, or None if they can: the cluster has too few CPUs
    (GPUs) in all, or another run holds them (its workers are freed by ``run.close()``; one just closed frees them
    within ``wait`` seconds, which are waited for)."""
    need = {k: sum(b.get(k, 0) for b in bundles) for k in ("CPU", "GPU")}
    total = ray.cluster_resources()
    short = {k: (n, total.get(k, 0)) for k, n in need.items() if n and total.get(k, 0) < n}
    if short:
        what = ", ".join(f"{n:g} {k} (it has {have:g})" for k, (n, have) in short.items())
        return (f"the plan needs {len(bundles)} mesh workers, {what} on this Ray cluster: plan for a cluster of its "
                "shape (RayCluster.local(hosts, devices_per_host) starts one) or add nodes")
    until = time.monotonic() + wait
    while True:
        free = ray.available_resources()
        lacking = {k: (n, free.get(k, 0)) for k, n in need.items() if n and free.get(k, 0) < n}
        if not lacking or time.monotonic() > until:
            break
        time.sleep(0.2)
    if lacking:
        what = ", ".join(f"{n:g} {k} ({have:g} of the cluster's {total.get(k, 0):g} free)" for k, (n, have) in lacking.items())
        return (f"the plan's {len(bundles)} mesh workers need {what}: another run holds the rest; close it (run.close()) "
                "or let it finish, then launch again")
    return None


@dataclass(frozen=True)
class WorkerInfo:
    """The driver's record of one mesh worker."""

    worker: int
    mesh: int
    hosts: tuple[int, ...]
    stages: tuple[int, ...]
    device_ids: tuple[int, ...]
    pid: int
    hostname: str
    devices: tuple[str, ...]
    clock_offset: float
    """worker clock minus driver clock, seconds (subtracted from its events)"""

    def describe(self) -> str:
        host = self.hosts[0] if len(self.hosts) == 1 else list(self.hosts)
        return f"mesh worker {self.worker} (host {host}, pid {self.pid} on {self.hostname}, mesh {self.mesh}, stages {list(self.stages)})"


@dataclass(eq=False)
class RayRun:
    """A plan running on mesh workers; the state lives on the workers between steps."""

    cluster: RayCluster
    plan: Any
    programs: tuple[WorkerProgram, ...]
    workers: tuple[WorkerInfo, ...]
    actors: list[Any] = field(repr=False)
    placement_group: Any = field(repr=False)
    in_tree: Any = field(repr=False)
    out_tree: Any = field(repr=False)
    state_tree: Any = field(repr=False)
    num_state: int = 0
    arg_avals: tuple[Any, ...] = field(default=(), repr=False)
    host_leaves: dict[int, Any] = field(default_factory=dict, repr=False)
    """flat result index -> value the driver knows without the workers (constants, unchanged leaves)"""
    keep_state_every: int = 1
    """the driver keeps a copy of the state every this many steps (0: never); it comes back with the step's reply"""
    step_timeout: float | None = None
    launch_seconds: dict[str, float] = field(default_factory=dict)
    steps_done: int = 0
    last_state: Any = field(default=None, repr=False)
    last_state_step: int = 0
    traffic: list[dict[str, Any]] = field(default_factory=list, repr=False)
    """per step: {"step", "sent": {(worker, peer): bytes}, "seconds": the slowest worker's own seconds,
    "step_seconds": the step as the driver saw it, "state_seconds": copying the state back (0: not copied)}"""
    last_step_seconds: float = 0.0
    """the last step's seconds on the driver, from sending it to every worker's reply; without the state's copy back"""
    last_state_seconds: float = 0.0
    """seconds the last step's copy of the state back to the driver took (0 when that step kept none)"""
    closed: bool = False
    owns_cluster: bool = False
    """the Ray cluster was started for this run (``ParallelizedStep.launch(plan, state)``): closing the run stops it"""
    _event_cursor: list[int] = field(default_factory=list, repr=False)
    _events: deque[Event] = field(default_factory=lambda: deque(maxlen=EVENTS_KEPT), repr=False)
    _events_lock: Any = field(default_factory=threading.RLock, repr=False)
    """held while events are polled and read: a dashboard and a training thread may poll at once"""
    _invars: tuple[int, ...] = ()
    _outvars: tuple[int, ...] = ()
    _out_dtypes: tuple[str, ...] = ()
    """the results' dtype names: a typed PRNG key comes back as its key data and is wrapped again"""

    def __repr__(self) -> str:  # the dataclass's would print the plan and every worker program (~100 KB)
        stages = len(getattr(self.plan, "stages", ())) or 1
        where = getattr(self.cluster, "address", None) or "Ray"
        state = "closed" if self.closed else "open"
        return (f"RayRun({state}, {self.steps_done} step(s) done, {stages} stage(s) on {len(self.workers)} mesh worker(s) "
                f"of {where})")

    # ----- stepping ------------------------------------------------------------------------
    def step(self, *batch: Any) -> Any:
        """One training step on the workers with these arguments after the state; returns the step's other results."""
        self._check_open()
        ray = _ray()
        leaves = jax.tree_util.tree_leaves(batch)
        avals = self.arg_avals[self.num_state :]
        if len(leaves) != len(avals):
            raise ValueError(f"the step takes {len(avals)} array leaves after the state; got {len(leaves)}")
        for i, (x, a) in enumerate(zip(leaves, avals)):
            if tuple(np.shape(x)) != tuple(a.shape):
                raise ValueError(
                    f"argument leaf {i} after the state has shape {tuple(np.shape(x))}; the plan was made for {tuple(a.shape)}"
                )
        batch_vars = self._invars[self.num_state :]
        t0 = time.perf_counter()
        # a small leaf rides inline in each worker's message; a big one is one object-store copy for all readers
        refs = {v: (a if a.nbytes <= INLINE_BYTES else ray.put(a)) for v, a in ((v, host_data(x)) for v, x in zip(batch_vars, leaves))}
        keep = bool(self.keep_state_every) and (self.steps_done + 1) % self.keep_state_every == 0
        calls = []
        for prog, actor in zip(self.programs, self.actors):
            mine = {v: refs[v] for v in batch_vars if v in prog.inputs}
            calls.append(actor.run_step.remote(self.steps_done, mine))
        # the first step runs each worker's programs for the first time (XLA compiles them there): not timed out
        replies = self._gather(calls, f"step {self.steps_done}", timed=self.steps_done > 0)
        self.last_step_seconds = time.perf_counter() - t0
        self.steps_done += 1
        state_seconds = 0.0
        if keep:  # the state is copied back after the step, timed apart: the step's seconds are the step's alone
            t1 = time.perf_counter()
            parts = self._gather([a.state.remote() for a in self.actors], f"copying the state of step {self.steps_done - 1} back")
            self.last_state = self._assemble_state(parts)
            self.last_state_step = self.steps_done
            state_seconds = time.perf_counter() - t1
        self.last_state_seconds = state_seconds
        sent = {}
        results: dict[int, Any] = dict(self.host_leaves)
        for info, rep in zip(self.workers, replies):
            results.update(rep["results"])
            for peer, n in rep["sent"].items():
                sent[(info.worker, peer)] = n
        self.traffic.append({"step": self.steps_done - 1, "sent": sent, "seconds": max(r["seconds"] for r in replies),
                             "step_seconds": self.last_step_seconds, "state_seconds": state_seconds})
        del self.traffic[:-TRAFFIC_KEPT]
        flat = [typed(results[i], self._out_dtypes[i]) for i in range(self.num_state, len(self._outvars))]
        rest = jax.tree_util.tree_unflatten(self._rest_tree, flat)
        return rest[0] if len(rest) == 1 else rest

    def __call__(self, *batch: Any) -> Any:
        return self.step(*batch)

    def _gather(self, calls: list[Any], what: str, timed: bool = True) -> list[Any]:
        """Wait for every worker's reply; the first failure closes the run and is raised by name, and so is
        waiting past ``step_timeout`` (when ``timed``)."""
        ray = _ray()
        pending = {c: i for i, c in enumerate(calls)}
        replies: list[Any] = [None] * len(calls)
        deadline = None if self.step_timeout is None or not timed else time.monotonic() + self.step_timeout
        while pending:
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=1.0)
            for ref in ready:
                i = pending.pop(ref)
                try:
                    replies[i] = ray.get(ref)
                except Exception as e:  # noqa: BLE001 - translated into a named worker error
                    self._fail(i, e, what)
            if deadline is not None and time.monotonic() > deadline and pending:
                waiting = ", ".join(self.workers[i].describe() for i in pending.values())
                self.close()
                raise MeshWorkerError(
                    f"{what} did not finish within step_timeout={self.step_timeout:g} s; still waiting on {waiting}; the run was closed"
                )
        return replies

    def _fail(self, i: int, error: BaseException, what: str) -> None:
        ray = _ray()
        info = self.workers[i]
        if isinstance(error, ray.exceptions.ActorDiedError) or isinstance(error, ray.exceptions.ActorUnavailableError):
            cause = "its process died (killed, out of memory, or crashed)"
        elif isinstance(error, ray.exceptions.RayTaskError):
            inner = error.cause if error.cause is not None else error
            cause = f"{type(inner).__name__}: {inner}"
        else:
            cause = f"{type(error).__name__}: {error}"
        self.close()
        kept = "no state was kept"
        if self.last_state is not None:
            kept = f"the last state kept on the driver is from step {self.last_state_step}"
        raise MeshWorkerError(f"{what} failed on {info.describe()}: {cause}. The run was closed; {kept} (run.last_state).", info) from error

    # ----- reading back ---------------------------------------------------------------------
    def state(self) -> Any:
        """The current state fetched from the workers, in the structure of the state launched with."""
        self._check_open()
        return self._assemble_state(self._gather([a.state.remote() for a in self.actors], "fetching the state"))

    def _assemble_state(self, parts: list[dict[int, Any]]) -> Any:
        """The state pytree from the leaves each worker holds (leaves no worker holds: unchanged since launch)."""
        held: dict[int, Any] = {}
        for p in parts:
            held.update(p)
        leaves = []
        for i, v in enumerate(self._invars[: self.num_state]):
            if v in held:
                leaves.append(typed(held[v], str(self.arg_avals[i].dtype)))
            elif self.last_state is not None:  # a leaf no worker reads or makes: unchanged since launch
                leaves.append(jax.tree_util.tree_leaves(self.last_state)[i])
            else:
                raise MeshWorkerError(f"no worker holds state leaf {i}")
        return jax.tree_util.tree_unflatten(self.state_tree, leaves)

    def events(self) -> list[Event]:
        """The workers' instructions so far (the last EVENTS_KEPT), in the driver's clock (readable mid-step)."""
        with self._events_lock:
            self.poll_events()
            return list(self._events)

    def poll_events(self) -> list[Event]:
        """The workers' instructions executed since the last poll, in the driver's clock (one message per worker).

        Safe to call from several threads: each event is returned by exactly one of the calls.
        """
        ray = _ray()
        new: list[Event] = []
        with self._events_lock:
            if self.closed:
                return new
            try:
                replies = ray.get([a.events.remote(c) for a, c in zip(self.actors, self._event_cursor)])
            except Exception:
                if self.closed:  # closed by another thread meanwhile (a failed step): nothing more to read
                    return new
                raise
            offsets = [w.clock_offset for w in self.workers]
            for k, (cursor, evs) in enumerate(replies):
                self._event_cursor[k] = cursor
                new.extend(align_events(evs, offsets, k))
            self._events.extend(new)
        return new

    def memory(self) -> list[Any]:
        """Each worker's devices' memory (``MemoryRow``s): the backend's figures, or JAX's live buffers there."""
        from alpa_lab.runtime.monitor import MemoryRow

        self._check_open()
        replies = self._gather([a.memory.remote() for a in self.actors], "reading memory")
        out = []
        for w, rows in zip(self.workers, replies):
            for k, r in enumerate(rows):  # the worker's k-th local device is the k-th of its plan devices
                out.append(MemoryRow(w.worker, **{**r, "device_id": w.device_ids[k] if k < len(w.device_ids) else -1}))
        return out

    def bytes_per_step(self, step: int = -1) -> dict[str, dict[tuple[int, int], int]]:
        """Bytes of one step's traffic, (sender, receiver) -> bytes, as counted by the senders and by the receivers.

        Each side counts on its own: the senders report with the step, the receivers are asked here.
        ``step`` counts from 0 (negative: from the last); the last TRAFFIC_KEPT steps are kept.
        """
        self._check_open()
        k = step + self.steps_done if step < 0 else step
        entry = next((t for t in self.traffic if t["step"] == k), None)
        if entry is None:
            raise ValueError(f"no traffic kept for step {step} (steps done: {self.steps_done}; the last {TRAFFIC_KEPT} are kept)")
        per_worker = self._gather([a.received.remote(k) for a in self.actors], "reading the traffic")
        received = {(s, w.worker): n for w, got in zip(self.workers, per_worker) for s, n in got.items()}
        return {"sent": dict(entry["sent"]), "received": received}

    def predicted_bytes(self) -> dict[tuple[int, int], int]:
        """Bytes per step (sender worker, receiver worker) the plan's unit tasks say will move."""
        per_mesh = {p.worker: p for p in self.programs}
        worker_of = {(w.mesh, w.hosts[0]): w.worker for w in self.workers}
        return {(worker_of[a], worker_of[b]): n for (a, b), n in predicted_traffic(tuple(per_mesh.values())).items()}

    # ----- ending ---------------------------------------------------------------------------
    def close(self) -> None:
        """Stop the mesh workers and free their placement group; the Ray cluster keeps running, unless
        it was started for this run (``owns_cluster``)."""
        if self.closed:
            return
        self.closed = True
        _release(_ray(), self.actors, self.placement_group)
        if self.owns_cluster:
            self.cluster.shutdown()

    def _check_open(self) -> None:
        if self.closed:
            raise MeshWorkerError("this run is closed; launch the plan again (step.launch(cluster, run.last_state))")

    def __enter__(self) -> RayRun:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    _rest_tree: Any = field(default=None, repr=False)


def align_events(events: Iterable[Event], offsets: Sequence[float], worker: int) -> list[Event]:
    """``worker``'s events moved to the driver's clock; ``offsets[k]`` is worker k's clock minus the driver's.

    A RECV's start is when its sender sent it, read on the sender's clock (``peer``), its end
    on the receiver's; both are moved by their own worker's offset. Offsets are estimates
    (within half a round trip), so a transfer that would end before it starts is cut to start
    at its end.
    """
    own = offsets[worker]
    out = []
    for e in events:
        end = e.end - own
        sender = e.peer if e.kind == "recv" and 0 <= e.peer < len(offsets) else worker
        start = min(e.start - offsets[sender], end)
        out.append(Event(**{**e.__dict__, "start": start, "end": end}))
    return out


TRAFFIC_KEPT = 64
"""steps whose traffic the driver keeps (``bytes_per_step``)"""

KEEP_EVERY_STEP_BYTES = 256 * 2**20
"""States up to this size are copied back to the driver after every step by default."""


def launch(
    step: Any,
    cluster: RayCluster,
    state: Any,
    *example: Any,
    keep_state_every: int | None = None,
    step_timeout: float | None = None,
) -> RayRun:
    """Place the step's current plan on ``cluster``'s mesh workers and ship programs and state once.

    ``example``: the step's other arguments (shapes only) if the plan was not made with them.
    """
    from alpa_lab.plan import PipelinePlan

    ray = _ray()
    if cluster._closed or not ray.is_initialized():
        raise LaunchError("the Ray cluster was shut down; start one with RayCluster.local(...) or connect(...)")
    plan = step.current_plan
    if plan is None:
        raise LaunchError("the step has no plan yet: call step.plan(state, batch) first")
    if isinstance(plan, PipelinePlan) and plan.schedule == INFERENCE:
        raise LaunchError(
            "an inference pipeline (a step without gradients, schedule='inference') runs in this process, its stages on "
            "this process's devices: step.on_ray(None); the mesh workers run training steps, which return the new state")
    args = (state, *example) if example else step.last_args(state)
    need = (plan.cluster["hosts"], plan.cluster["devices_per_host"]) if isinstance(plan, PipelinePlan) else None
    have = (cluster.hosts, cluster.devices_per_host)
    if need is None:
        used = max(plan.device_ids) + 1
        if used > cluster.hosts * cluster.devices_per_host:
            raise LaunchError(
                f"the plan uses {used} devices ({plan.mesh_shape[0]}x{plan.mesh_shape[1]} mesh) but the Ray cluster has "
                f"{have[0]} hosts x {have[1]} devices = {have[0] * have[1]}; plan for cluster.spec"
            )
    elif need[0] > have[0] or need[1] > have[1]:
        raise LaunchError(
            f"the plan was made for {need[0]} hosts x {need[1]} devices but the Ray cluster has {have[0]} hosts x {have[1]} devices; "
            "plan with parallelize(..., cluster=ray_cluster.spec), or for part of it (ray_cluster.spec.part(hosts, devices_per_host))"
        )
    t0 = time.perf_counter()
    graph = step.trace(*args)
    compiled = step.compiled(*args)
    t_compile = time.perf_counter() - t0
    # a pipeline planned for part of the cluster (fewer hosts, fewer devices on each) numbers its devices by its own
    # hosts: device d is on the plan's host d // (its devices per host), a worker there takes that many devices
    placements = mesh_placements(compiled, need[1] if need is not None else cluster.devices_per_host)
    state_leaves, state_tree = jax.tree_util.tree_flatten(state)
    num_state = len(state_leaves)
    if keep_state_every is None:  # every step for a small state; a big one is not copied to the driver each step
        state_bytes = sum(np.asarray(x).nbytes if not hasattr(x, "nbytes") else x.nbytes for x in state_leaves)
        keep_state_every = 1 if state_bytes <= KEEP_EVERY_STEP_BYTES else 100
    if isinstance(keep_state_every, bool) or not isinstance(keep_state_every, int) or keep_state_every < 0:
        raise LaunchError(f"keep_state_every must be a number of steps (0: never), got {keep_state_every!r}")
    if graph.returns_state_alone:  # ``return new_state``: the state and nothing else (run.step then returns ())
        out_children = [state_tree]
    else:
        out_children = graph.out_tree.children() if graph.out_tree.num_nodes > 1 else []
    if not out_children or out_children[0] != state_tree:
        raise LaunchError(
            "on a Ray cluster the step must return new_state or (new_state, ...) with the same structure as the state "
            "it takes (the state stays on the mesh workers between steps); a step that returns something else (only "
            "gradients) runs in this process: step.on_ray(None), or without alpa_lab.init('ray')")
    rest_tree = jax.tree_util.treedef_tuple(out_children[1:])  # the results after the state, nested as returned
    t1 = time.perf_counter()
    try:
        programs = worker_programs(compiled, graph, placements, num_state)
    except ProgramError as e:
        raise LaunchError(str(e)) from e
    t_export = time.perf_counter() - t1

    # everything that can refuse the plan is checked before anything starts on the cluster
    # one mesh worker per (mesh, host): a mesh within a host is one worker, a mesh spanning hosts a jax.distributed group
    members = [(prog, pl, rank, h) for prog, pl in zip(programs, placements) for rank, h in enumerate(pl.hosts)]
    worker_progs = tuple(m[0] for m in members)  # per actor, in the order of ``actors`` and ``workers``
    host_leaves: dict[int, Any] = {}
    made = {o for p in worker_progs for o in [*(o for o, _, _ in p.state_out), *(o for _, o in p.results)]}
    for i, o in enumerate(graph.outvars):
        if o in made:
            continue
        var = graph.vars[o]
        if var.kind == "const":  # as the workers' results: a typed key as its key data, typed again with them
            host_leaves[i] = host_data(graph.consts[o])
        elif var.kind == "literal":
            host_leaves[i] = host_data(graph.literals[o])
        elif var.kind == "input" and i >= num_state:
            raise LaunchError(f"result {i} returns an input unchanged; the Ray runtime returns only computed results")
    bundles = [
        {"CPU": 1} if cluster.platform == "cpu" else {"CPU": 1, "GPU": len(pl.devices_on(h))} for _, pl, _, h in members
    ]

    if cluster.started_here:  # a Ray started here has no autoscaler: what is missing now stays missing, so say it at once
        shortage = _room_shortage(ray, bundles, wait=5.0)
        if shortage:
            raise LaunchError(shortage)
    t2 = time.perf_counter()
    pg = ray.util.placement_group(bundles, strategy="PACK")
    actors: list[Any] = []
    run: RayRun | None = None
    try:
        if not pg.wait(timeout_seconds=60):  # a cluster joined at an address may grow (an autoscaler): waited for
            raise LaunchError(
                f"Ray could not place {len(bundles)} mesh workers ({bundles}) within 60 s: "
                + (_room_shortage(ray, bundles) or f"the cluster has {ray.available_resources()}")
            )
        actor_cls = ray.remote(MeshWorker)
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        for k, (prog, pl, rank, h) in enumerate(members):
            n = len(pl.devices_on(h))
            opts: dict[str, Any] = {
                "num_cpus": 1,
                "max_concurrency": 8,
                "scheduling_strategy": PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=k),
            }
            if cluster.platform == "cpu":
                opts["runtime_env"] = {"env_vars": {"XLA_FLAGS": f"--xla_force_host_platform_device_count={n}", "JAX_PLATFORMS": "cpu"}}
            else:
                opts["num_gpus"] = n
            actors.append(actor_cls.options(**opts).remote(k, h, n, cluster.platform, rank))
        try:
            joins = []
            for prog, pl in zip(programs, placements):
                if len(pl.hosts) > 1:
                    group = [a for a, m in zip(actors, members) if m[0] is prog]
                    ip = "127.0.0.1" if cluster.started_here else ray.get(group[0].node_ip.remote())
                    port = ray.get(group[0].free_port.remote(ip))
                    joins += [a.join_group.remote(f"{ip}:{port}", len(group)) for a in group]
            ray.get(joins, timeout=120)
            infos = ray.get([a.info.remote() for a in actors], timeout=120)
            offsets = []
            for a in actors:
                before = time.time()
                t_worker = ray.get(a.clock.remote())
                offsets.append(t_worker - (before + time.time()) / 2)
        except Exception as e:
            raise LaunchError(f"the mesh workers did not start: {e}") from e
        t_start = time.perf_counter() - t2

        t3 = time.perf_counter()
        invars = tuple(graph.invars)
        host_state = [host_data(x) for x in state_leaves]
        loads = []
        state_refs = {v: ray.put(x) for v, x in zip(invars[:num_state], host_state)}
        peers = {(pl.mesh, h): (k, a) for k, ((_, pl, _, h), a) in enumerate(zip(members, actors))}
        for (p, _, _, _), a in zip(members, actors):
            mine = {v: ref for v, ref in state_refs.items() if v in p.inputs or any(v == sv for _, sv, _ in p.state_out)}
            loads.append(a.load.remote(p, peers, mine))
        workers = tuple(
            WorkerInfo(
                worker=k,
                mesh=pl.mesh,
                hosts=(h,),
                stages=pl.stages,
                device_ids=pl.devices_on(h),
                pid=info["pid"],
                hostname=info["hostname"],
                devices=tuple(info["devices"]),
                clock_offset=off,
            )
            for k, ((_, pl, _, h), info, off) in enumerate(zip(members, infos, offsets))
        )
        run = RayRun(
            cluster=cluster,
            plan=plan,
            programs=worker_progs,
            workers=workers,
            actors=actors,
            placement_group=pg,
            in_tree=graph.in_tree,
            out_tree=graph.out_tree,
            state_tree=state_tree,
            num_state=num_state,
            arg_avals=tuple(leaf_aval(x) for x in jax.tree_util.tree_leaves(args)),
            host_leaves=host_leaves,
            keep_state_every=keep_state_every,
            step_timeout=step_timeout,
            _event_cursor=[0] * len(actors),
            _invars=invars,
            _outvars=tuple(graph.outvars),
            _out_dtypes=tuple(graph.vars[o].dtype for o in graph.outvars),
            _rest_tree=rest_tree,
        )
        run._gather(loads, "loading the programs", timed=False)  # launching has its own limits; step_timeout is for steps
        run.last_state = jax.tree_util.tree_unflatten(state_tree, host_state)
    except BaseException:  # whatever failed after the placement group was made: stop what started, free the group
        if run is not None:
            run.close()
        _release(ray, actors, pg)
        raise
    run.launch_seconds = {
        "compile": t_compile,
        "export": t_export,
        "start_workers": t_start,
        "load": time.perf_counter() - t3,
        "total": time.perf_counter() - t0,
    }
    return run


def _release(ray: Any, actors: Sequence[Any], pg: Any) -> None:
    """Kill ``actors`` and remove the placement group ``pg`` (each step on its own: one failing stops not the rest)."""
    for a in actors:
        try:
            ray.kill(a, no_restart=True)
        except Exception:  # noqa: BLE001 - an actor already gone
            pass
    if pg is not None:
        try:
            ray.util.remove_placement_group(pg)
        except Exception:  # noqa: BLE001 - a group already removed
            pass
