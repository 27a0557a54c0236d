"""The mesh worker: a Ray actor that owns one mesh's devices on one host and runs its program.

Alpa sec. 6 in today's terms. The driver sends a ``WorkerProgram`` once (``load``); a step is
one ``run_step`` message per worker carrying only the batch leaves this worker reads. The
worker then walks its stages' instruction lists with the same ``walk_schedule`` as the
in-process runtime: a RUN goes when its inputs exist, and a micro-batch tensor is freed
after its last local reader. A tensor another mesh reads moves as the plan's unit tasks
(``program.Move``): this worker cuts the regions its devices were chosen to send out of
their shards and sends each receiving host's worker one message (``receive`` on the peer,
inline or through Ray's object store, never through the driver); a receiving worker
waits for every region its host needs and assembles its devices' tiles in the
destination sharding. Every instruction is recorded as an event (RUN, SEND, RECV,
with its bytes) in this process's wall clock, except a RECV's start: when its sender sent it,
on the sender's clock (``peer``); the driver moves each time to its own clock with the offset
of the worker whose clock it is (``ray_run.align_events``).

This module imports no Ray and no JAX at import time: the actor sets its device count
before JAX is first imported in its process.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import numpy as np

from alpa_lab.graph.opgraph import key_impl
from alpa_lab.runtime.program import STATE, STEP, WorkerProgram, move_kind

__all__ = ["Event", "MeshWorker", "WorkerAborted"]


INLINE_BYTES = 64 * 1024
"""Messages carrying up to this many bytes are sent inline instead of through the object store."""


EVENTS_KEPT = 20_000
"""events a worker keeps (the driver reads them as they come; a long run drops the oldest)"""
STEPS_KEPT = 64
"""steps whose received bytes a worker keeps"""


class WorkerAborted(RuntimeError):
    """The driver aborted the step this worker was waiting in (another worker failed)."""


@dataclass(frozen=True)
class Event:
    """One executed instruction. ``start``/``end`` are seconds in the driver's clock once read by it."""

    worker: int
    """the mesh worker (one per mesh and host)"""
    mesh: int
    stage: int
    kind: str
    """"run" (a unit task), "send" or "recv" (a cross-mesh tensor)"""
    phase: str
    microbatch: int
    step: int
    start: float
    end: float
    nbytes: int = 0
    peer: int = -1
    """the other worker of a send or recv"""
    var: int = -1


class MeshWorker:
    """Owns the devices of one mesh on one host; runs the stages placed on that mesh."""

    def __init__(self, worker: int, host: int, num_devices: int, platform: str = "cpu", rank: int = 0):
        if platform == "cpu":  # simulated devices: the count must be set before JAX is imported here
            flags = os.environ.get("XLA_FLAGS", "")
            if "xla_force_host_platform_device_count" not in flags:
                os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={num_devices}".strip()
            os.environ.setdefault("JAX_PLATFORMS", "cpu")
        import jax  # noqa: F401  (first import in this process, after the flags)

        self.worker, self.host, self.platform, self.rank = worker, host, platform, rank
        self.num_devices = num_devices
        self._cv = threading.Condition(threading.RLock())
        """guards the inbox, the events and the received bytes (re-entrant: ``_record`` takes it inside ``receive``)"""
        self._inbox: dict[tuple[int, int, int], dict[int, np.ndarray]] = {}  # (step, var, tag) -> regions so far
        self._events: list[Event] = []
        self._events_base = 0  # index of self._events[0] among all events (old ones are dropped)
        self._received: dict[int, dict[int, int]] = {}  # step -> sender -> bytes (the last STEPS_KEPT steps)
        self._aborted = False
        self._program: WorkerProgram | None = None
        self._peers: dict[tuple[int, int], Any] = {}
        self._worker_ids: dict[tuple[int, int], int] = {}
        self.mesh = -1  # set by load
        self._state: dict[int, Any] = {}  # state argument var -> its current value (host array or on a mesh)
        self._placed: dict[tuple[int, int, int], Any] = {}

    # ----- facts --------------------------------------------------------------------------
    def info(self) -> dict[str, Any]:
        import jax

        return {
            "worker": self.worker,
            "host": self.host,
            "pid": os.getpid(),
            "hostname": socket.gethostname(),
            "ip": _node_ip(),
            "devices": [str(d) for d in jax.local_devices()],
            "platform": jax.devices()[0].platform,
            "jax": jax.__version__,
        }

    def clock(self) -> float:
        return time.time()

    def node_ip(self) -> str:
        """This node's address as Ray sees it (no JAX call: a group member may not have joined yet)."""
        return _node_ip()

    def free_port(self, ip: str = "127.0.0.1") -> int:
        """A free TCP port on ``ip`` for this mesh's coordination service (the group's rank 0 hosts it)."""
        with socket.socket() as s:
            s.bind((ip, 0))
            return s.getsockname()[1]

    def join_group(self, coordinator: str, num_processes: int) -> None:
        """Join this mesh's ``jax.distributed`` group (a mesh spanning hosts is one SPMD program over its workers).

        Must come before any other JAX call in this process; gloo carries the collectives on the CPU.
        """
        import jax

        if self.platform == "cpu":
            jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(coordinator, num_processes=num_processes, process_id=self.rank)

    # ----- calibration (RayCluster.calibrate) ----------------------------------------------
    def calibrate(self, repeats: int = 7) -> dict[str, Any]:
        """The cost model's microbenchmarks on this worker's devices (``cost.calibrate``), as a dict."""
        from alpa_lab.cost.calibrate import calibrate

        return dict(calibrate(repeats=repeats).__dict__)

    def offer(self, nbytes: int) -> list[Any]:
        """A ``nbytes`` array put in this worker's object store; its ref comes back in a list (not resolved)."""
        import ray

        self._offered = ray.put(np.ones(max(nbytes // 4, 1), dtype=np.float32))
        return [self._offered]

    def pull(self, refs: list[Any]) -> float:
        """Seconds to fetch another worker's offered array into this process (what a cross-mesh region costs).

        A copy, as the receiver's tiles are: on one machine Ray's ``get`` alone maps shared memory and moves nothing.
        """
        import ray

        t0 = time.perf_counter()
        x = np.array(ray.get(refs[0]), copy=True)
        seconds = time.perf_counter() - t0
        del x
        return seconds

    # ----- set-up, once -------------------------------------------------------------------
    def load(self, program: WorkerProgram, peers: dict[tuple[int, int], tuple[int, Any]], state: dict[int, np.ndarray]) -> dict[str, float]:
        """Deserialise the program's unit tasks onto this worker's devices and take the state.

        ``peers``: (mesh, host) -> (worker id, actor) of every mesh worker, where the moves' messages go.
        """
        import jax
        from jax.sharding import Mesh, NamedSharding

        t0 = time.perf_counter()
        pl = program.placement
        by_rank = {r: sorted((d for d in jax.devices() if d.process_index == r), key=lambda d: d.id) for r in range(len(pl.hosts))}
        for r, h in enumerate(pl.hosts):
            if len(by_rank[r]) < len(pl.devices_on(h)):
                raise RuntimeError(
                    f"worker {self.worker} (rank {r}, host {h}) has {len(by_rank[r])} devices but the mesh needs "
                    f"{len(pl.devices_on(h))} there"
                )

        def device(d: int) -> Any:
            r, j = pl.local_position(d)
            return by_rank[r][j]

        self._meshes = {
            s: Mesh(np.array([device(d) for d in ids], dtype=object).reshape(program.stage_shapes[s]), ("x", "y"))
            for s, ids in program.stage_devices.items()
        }
        self.mesh = pl.mesh
        self.host = pl.hosts[self.rank]
        self._plan_id = {device(d): d for d in pl.device_ids if pl.host_of(d) == self.host}
        # per incoming move, the unit tasks whose regions this host receives (one message per sender host);
        # per outgoing move, what this host sends each receiving host: worked out once, not on every send
        self._expect = {
            key: {k for (_, hr), ks in m.host_pairs().items() if hr == self.host for k, _ in ks} for key, m in program.moves_in.items()
        }
        self._outgoing = {
            key: tuple(
                (
                    m,
                    NamedSharding(self._meshes[m.src_stage], m.src_spec),
                    tuple((hr, ks) for (hs, hr), ks in m.host_pairs().items() if hs == self.host),
                )
                for m in moves
            )
            for key, moves in program.moves_out.items()
        }
        self._fns = {}
        for t in [*program.tasks.values(), *program.update]:
            exported = jax.export.deserialize(bytearray(t.exported))
            self._fns[(t.stage, t.phase, t.outvars)] = jax.jit(exported.call)
        self._shardings = {
            (t.stage, t.phase, t.outvars): [jax.sharding.NamedSharding(self._meshes[t.stage], p) for p in t.in_specs]
            for t in [*program.tasks.values(), *program.update]
        }
        self._program = program
        self._peers = {key: actor for key, (_, actor) in peers.items()}
        self._worker_ids = {key: w for key, (w, _) in peers.items()}
        self._state = {v: typed(x, program.var_dtypes.get(v, "")) for v, x in _resolve(state).items()}
        self._placed = {}
        return {"load_seconds": time.perf_counter() - t0}

    # ----- messages from peers ------------------------------------------------------------
    def receive(self, step: int, var: int, microbatch: int, parts: Any, sender: int, sent_at: float, sent_step: int) -> None:
        """Regions of a tensor another mesh made (RECV), ``[(unit task, array), ...]``: kept until complete and read.

        A big region comes as an object ref, read here with one ``ray.get`` for all of them. The event is filed
        under ``sent_step``, the step whose traffic it is (new state is sent at the end of one
        step and read in the next). ``sent_at`` is the sender's clock, the event's end this worker's.
        """
        big = [i for i, (_, a) in enumerate(parts) if type(a).__name__ == "ObjectRef"]
        if big:
            import ray

            parts = list(parts)
            for i, a in zip(big, ray.get([parts[i][1] for i in big])):
                parts[i] = (parts[i][0], a)
        now = time.time()
        with self._cv:
            self._inbox.setdefault((step, var, microbatch), {}).update(parts)
            nbytes = sum(int(a.nbytes) for _, a in parts)
            self._record(Event(self.worker, self.mesh, -1, "recv", "", microbatch, sent_step, sent_at, now, nbytes, sender, var))
            got = self._received.setdefault(sent_step, {})
            got[sender] = got.get(sender, 0) + nbytes
            for old in [k for k in self._received if k < sent_step - STEPS_KEPT]:
                del self._received[old]
            self._cv.notify_all()

    def abort(self) -> None:
        with self._cv:
            self._aborted = True
            self._cv.notify_all()

    def _has(self, step: int, var: int, microbatch: int) -> bool:
        """Every region of this tensor that this host receives has arrived."""
        with self._cv:
            got = self._inbox.get((step, var, microbatch))
            return got is not None and len(got) == len(self._expect[(var, move_kind(microbatch))])

    def _take(self, step: int, var: int, microbatch: int) -> Any:
        """The received tensor, its tiles assembled on this worker's devices in the destination sharding."""
        import jax
        from jax.sharding import NamedSharding

        with self._cv:
            parts = self._inbox.pop((step, var, microbatch))
        move = self._program.moves_in[(var, move_kind(microbatch))]
        tasks = move.resharding.tasks
        shape = move.resharding.shape
        sharding = NamedSharding(self._meshes[move.dst_stage], move.dst_spec)
        first = next(iter(parts.values()))
        dtype, trailing = first.dtype, first.shape[len(shape):]  # trailing: a typed key's data dimensions
        var_dtype = self._program.var_dtypes.get(var, "")
        if sharding.is_fully_addressable:  # the mesh lies in this host: its regions make the whole tensor, placed in one call
            whole = np.empty((*shape, *trailing), dtype)
            for k, a in parts.items():
                whole[tasks[k].slices] = a
            if sum(a.size for a in parts.values()) != whole.size:
                raise RuntimeError(
                    f"worker {self.worker}: the regions received for tensor {var} cover {sum(a.size for a in parts.values())} "
                    f"of its {whole.size} elements; the move's unit tasks do not match the plan's shardings"
                )
            return jax.device_put(typed(whole, var_dtype), sharding)
        arrays = []
        for dev, index in sharding.addressable_devices_indices_map(shape).items():
            d = self._plan_id[dev]
            lo = [sl.start or 0 for sl in index]
            tile = np.empty([*((sl.stop if sl.stop is not None else n) - a for sl, a, n in zip(index, lo, shape)), *trailing], dtype)
            filled = 0
            for k in self._expect[(var, move_kind(microbatch))]:
                if d in tasks[k].receivers:
                    tile[tuple(slice(a - o, b - o) for (a, b), o in zip(tasks[k].region, lo))] = parts[k]
                    filled += parts[k].size
            if filled != tile.size:
                raise RuntimeError(
                    f"worker {self.worker}: the regions received for tensor {var} cover {filled} of the {tile.size} elements "
                    f"device {d} holds under {move.dst_spec}; the move's unit tasks do not match the plan's shardings"
                )
            arrays.append(jax.device_put(typed(tile, var_dtype), dev))
        return jax.make_array_from_single_device_arrays(shape, sharding, arrays)

    def _wait(self) -> None:
        with self._cv:
            if self._aborted:
                raise WorkerAborted(f"worker {self.worker}: step aborted by the driver")
            self._cv.wait(timeout=0.5)

    # ----- one step -----------------------------------------------------------------------
    def run_step(self, step: int, batch: dict[int, np.ndarray], with_state: bool = False) -> dict[str, Any]:
        """Run this worker's part of one training step; returns its results and traffic (and its state leaves)."""
        import jax

        from alpa_lab.runtime.accumulate import accumulate, averaged
        from alpa_lab.runtime.pipeline import split_microbatches, walk_schedule

        prog = self._program
        if prog is None:
            raise RuntimeError(f"worker {self.worker} has no program: the driver must call load first")
        t_start = time.perf_counter()
        batch = {v: typed(x, prog.var_dtypes.get(v, "")) for v, x in _resolve(batch).items()}
        M = prog.num_microbatches
        sent: dict[int, int] = defaultdict(int)
        micro = {v: split_microbatches(x, M) for v, x in batch.items() if prog.inputs.get(v)}
        whole = {v: x for v, x in batch.items() if not prog.inputs.get(v)}
        store: dict[tuple[int, int], Any] = {}
        step_values: dict[int, Any] = {}
        sums: dict[int, Any] = {}
        left: dict[tuple[int, int], int] = {}
        made = {v for t in prog.tasks.values() for v in t.outvars}
        placed = self._placed  # (var, micro-batch or -1, stage) -> array on that stage's mesh; state persists
        for key in [k for k in placed if k[0] not in self._state or k[0] in whole]:
            del placed[key]  # only the state stays placed from one step to the next

        # new state made by other workers last step arrives under STATE
        for v in prog.remote_state:
            if step > 0:
                self._state.pop(v, None)
                for key in [k for k in placed if k[0] == v]:
                    del placed[key]

        def put(x: Any, sharding: Any) -> Any:
            return x if getattr(x, "sharding", None) == sharding else jax.device_put(x, sharding)

        def available(v: int, mb: int) -> bool:
            if v in prog.inputs:
                if v in micro or v in whole or v in self._state:
                    return True
                if self._has(step, v, STATE):
                    self._state[v] = self._take(step, v, STATE)
                    return True
                return False
            if mb >= 0:
                return (v, mb) in store if v in made else self._has(step, v, mb) or (v, mb, "in") in placed_in
            return v in step_values or self._has(step, v, STEP) or (v, -1, "in") in placed_in

        placed_in: dict[tuple, Any] = {}  # received host arrays, until their readers are done
        acks: list[Any] = []

        def value(v: int, mb: int) -> Any:
            if v in prog.inputs:
                if v in micro:
                    return micro[v][mb]
                return whole[v] if v in whole else self._state[v]
            if mb >= 0 and v in made:
                return store[(v, mb)]
            if mb < 0 and v in step_values:
                return step_values[v]
            key = (v, mb, "in")
            if key not in placed_in:
                placed_in[key] = self._take(step, v, mb if mb >= 0 else STEP)
            return placed_in[key]

        def fetch(v: int, mb: int, stage: int, sharding: Any) -> Any:
            key = (v, mb if v not in prog.inputs or v in micro else -1, stage)
            if key not in placed:
                placed[key] = put(value(v, mb), sharding)
            return placed[key]

        def send(v: int, mb: int, x: Any, tag: int) -> None:
            """Cut the regions of ``x`` this host sends out of its devices' shards; one message per receiving host."""
            import ray

            for move, src, to_hosts in self._outgoing.get((v, move_kind(tag)), ()):
                t = time.time()
                if not x.sharding.is_equivalent_to(src, x.ndim):  # the unit tasks cut the planned layout
                    x = jax.device_put(x, src)
                shards = {self._plan_id[sh.device]: sh for sh in x.addressable_shards}
                local: dict[int, np.ndarray] = {}
                for hr, regions in to_hosts:
                    parts = []
                    for k, d in regions:
                        if d not in local:
                            local[d] = host_data(shards[d].data)
                        lo = [sl.start or 0 for sl in shards[d].index]
                        box = tuple(slice(a - o, b - o) for (a, b), o in zip(move.resharding.tasks[k].region, lo))
                        parts.append((k, np.array(local[d][box])))
                    nbytes = sum(int(a.nbytes) for _, a in parts)
                    # small regions travel inline (Ray inlines small arguments); a big one is put in the object store
                    # once and read by the receiver with ray.get (a bare array: a list around it costs 16x at 128 MiB)
                    payload = [(k, a if a.nbytes <= INLINE_BYTES else ray.put(a)) for k, a in parts]
                    peer = self._peers[(move.dst_mesh, hr)]
                    call = peer.receive.remote(step + (1 if tag == STATE else 0), v, tag, payload, self.worker, t, step)
                    if tag == STATE:  # waited for below: when the step returns, the next step's state is in place
                        acks.append(call)
                    to = self._worker_ids[(move.dst_mesh, hr)]
                    sent[to] += nbytes
                    self._record(Event(self.worker, self.mesh, -1, "send", "", mb, step, t, time.time(), nbytes, to, v))

        def call(task: Any, mb: int) -> list[Any]:
            """Run a unit task; a per-micro-batch one adds its accumulated outputs into the sums, in its RUN."""
            key = (task.stage, task.phase, task.outvars)
            ins = [fetch(v, mb, task.stage, sh) for v, sh in zip(task.invars, self._shardings[key])]
            t = time.time()
            outs = list(self._fns[key](*ins))
            summed = [(v, x) for v, x in zip(task.outvars, outs) if v in prog.accumulated] if mb >= 0 else []
            if summed:
                accumulate(sums, summed, prog.var_dtypes)
            jax.block_until_ready((outs, [sums[v] for v, _ in summed]))
            self._record(Event(self.worker, self.mesh, task.stage, "run", task.phase, mb, step, t, time.time()))
            return outs

        def ready(s: int, phase: str, mb: int) -> bool:
            return all(available(v, mb) for v in prog.tasks[(s, phase)].invars)

        def execute(s: int, phase: str, mb: int) -> None:
            task = prog.tasks[(s, phase)]
            outs = call(task, mb)
            for v, x in zip(task.outvars, outs):
                store[(v, mb)] = x
                left[(v, mb)] = prog.local_readers.get(v, 0)
                send(v, mb, x, mb)
                if left[(v, mb)] == 0 and v not in prog.accumulated:
                    del store[(v, mb)]
            for v in task.invars:
                if v in prog.inputs:
                    continue
                if (v, mb) in left:
                    left[(v, mb)] -= 1
                    if left[(v, mb)] == 0 and v not in prog.accumulated:
                        store.pop((v, mb), None)
                        for st in prog.runs:
                            placed.pop((v, mb, st), None)
                else:  # a received tensor: count its local reads down too
                    k = (v, mb, "in")
                    n = left.get(k, prog.local_readers.get(v, 0)) - 1
                    left[k] = n
                    if n <= 0:
                        placed_in.pop(k, None)
                        for st in prog.runs:
                            placed.pop((v, mb, st), None)

        pending = {s: list(r) for s, r in prog.runs.items()}
        walk_schedule(pending, ready, execute, self._wait)

        step_values.update(averaged(sums, M, prog.var_dtypes))
        for v in sums:
            send(v, -1, step_values[v], STEP)
        for task in prog.update:  # once per step, in the plan's global order; remote inputs waited for
            while not all(available(v, -1) for v in task.invars):
                self._wait()
            outs = call(task, -1)
            for v, x in zip(task.outvars, outs):
                step_values[v] = x
                send(v, -1, x, STEP)
        for o, v, _ in prog.state_out:
            x = step_values[o]
            self._state[v] = x  # kept here too, so state() can read it from its maker
            for key in [k for k in placed if k[0] == v]:
                del placed[key]
            send(v, STATE, x, STATE)
        results = {i: _to_host(step_values[o]) for i, o in prog.results}
        if acks:
            import ray

            ray.get(acks)
        with self._cv:  # anything left for this step was not read: a planning bug worth seeing
            stale = [k for k in self._inbox if k[0] <= step and k[2] != STATE]
        if stale:
            raise RuntimeError(f"worker {self.worker}: step {step} left received tensors unread: {stale[:5]}")
        reply = {"results": results, "sent": dict(sent), "seconds": time.perf_counter() - t_start}
        if with_state:  # the driver copies the state with a call of its own (``state``), timed apart from the step
            reply["state"] = self.state()
        return reply

    def received(self, step: int) -> dict[int, int]:
        """Bytes received from each peer for ``step``'s traffic (complete once every worker finished it)."""
        with self._cv:
            return dict(self._received.get(step, {}))

    def _record(self, event: Event) -> None:
        """Keep an event; the oldest half goes once there are EVENTS_KEPT.

        Takes ``self._cv`` itself (re-entrant: ``receive`` records while holding it): the step's thread
        records RUNs and SENDs while peers' ``receive`` calls and the driver's ``events`` run on others.
        """
        with self._cv:
            self._events.append(event)
            if len(self._events) > EVENTS_KEPT:
                drop = len(self._events) // 2
                del self._events[:drop]
                self._events_base += drop

    # ----- reading back -------------------------------------------------------------------
    def state(self) -> dict[int, np.ndarray]:
        """The state leaves this worker holds (those made here, and those it reads), as host arrays."""
        prog = self._program
        own = {v for _, v, _ in prog.state_out} if prog else set()
        return {v: _to_host(x) for v, x in self._state.items() if v in own or v not in (prog.remote_state if prog else ())}

    def events(self, since: int = 0) -> tuple[int, list[Event]]:
        """Events from index ``since`` on (those still kept), and the index to ask from next time."""
        with self._cv:
            out = self._events[max(since - self._events_base, 0) :]
            return self._events_base + len(self._events), out

    def memory(self) -> list[dict[str, Any]]:
        """Per device: bytes in use and the limit, where the backend reports them (else JAX's live buffers)."""
        return memory_rows()


def memory_rows() -> list[dict[str, Any]]:
    """This process's devices' memory: the backend's figures, or the bytes of JAX's live arrays on each device.

    Simulated CPU devices report no memory statistics; the live arrays (every buffer JAX holds
    for this process) are then what the plan's eq. 5 figure predicts, without XLA's scratch space.
    """
    import jax

    devices = jax.local_devices()
    stats = {d: d.memory_stats() for d in devices}
    live: dict[Any, int] = {}
    if not all(stats.values()):
        for arr in jax.live_arrays():
            try:
                for shard in arr.addressable_shards:
                    live[shard.device] = live.get(shard.device, 0) + shard.data.nbytes
            except Exception:  # noqa: BLE001 - an array deleted meanwhile
                continue
    out = []
    for d in devices:
        st = stats[d] or {}
        if st.get("bytes_in_use") is not None:
            used, limit, source = int(st["bytes_in_use"]), st.get("bytes_limit"), "backend"
        else:
            used, limit, source = live.get(d, 0), None, "live buffers"
        out.append({"device": str(d), "device_id": d.id, "bytes_in_use": used, "bytes_limit": limit, "source": source})
    return out


def _resolve(refs: dict[int, Any]) -> dict[int, Any]:
    """Values of a dict of Ray object refs and values (Ray resolves only top-level arguments by itself)."""
    keys = [k for k, r in refs.items() if type(r).__name__ == "ObjectRef"]
    if not keys:
        return dict(refs)  # values already (small leaves inline, or a worker driven without Ray)
    import ray

    return {**refs, **dict(zip(keys, ray.get([refs[k] for k in keys])))}


def _to_host(x: Any) -> np.ndarray:
    """A host copy of ``x``; an array spread over a group of processes is gathered (every member calls this)."""
    if getattr(x, "is_fully_addressable", True):
        return host_data(x)
    from jax.experimental import multihost_utils

    return host_data(multihost_utils.process_allgather(x, tiled=True))


def host_data(x: Any) -> np.ndarray:
    """``x`` as a NumPy array to send (Ray, the object store, a peer): a typed PRNG key as its key data."""
    import jax

    if jax.dtypes.issubdtype(getattr(x, "dtype", np.float32), jax.dtypes.extended):
        x = jax.random.key_data(x)
    return np.asarray(x)


def typed(a: Any, dtype: str) -> Any:
    """``a`` received as ``host_data``, as the program takes it: key data wrapped back into a typed key."""
    impl = key_impl(dtype)
    if impl is None:
        return a
    import jax

    return jax.random.wrap_key_data(a, impl=impl)


def _node_ip() -> str:
    try:
        import ray

        return ray.util.get_node_ip_address()
    except Exception:  # noqa: BLE001 - outside Ray (tests of the class itself)
        return "127.0.0.1"
