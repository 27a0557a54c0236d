"""The mesh worker: a Ray actor that owns one mesh's devices on one host and runs its program.

Alpa sec. 6 in today's terms. The driver sends a ``WorkerProgram`` once (``load``); a step is
one ``run_step`` message per worker carrying only the batch leaves this worker reads. The
worker then walks its stages' instruction lists with the same ``walk_schedule`` as the
in-process runtime: a RUN goes when its inputs exist, a tensor another worker reads is sent
to it directly (``receive`` on the peer, the bytes through Ray's object store, never through
the driver), a tensor from another worker is waited for, and a micro-batch tensor is freed
after its last local reader. Every instruction is recorded as an event (RUN, SEND, RECV,
with its bytes) in this process's wall clock; the driver aligns clocks when it reads them.

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

from alpa_lab.runtime.program import STATE, STEP, WorkerProgram

__all__ = ["Event", "MeshWorker", "WorkerAborted"]


INLINE_BYTES = 64 * 1024
"""Tensors up to this size are sent inside the RECV message instead of through the object store."""


class WorkerAborted(RuntimeError):
    """The driver aborted the step this worker was waiting in (another worker failed)."""


@dataclass(frozen=True)
class Event:
    """One executed instruction. ``start``/``end`` are seconds in the driver's clock once read by it."""

    worker: int
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
        self._cv = threading.Condition()
        self._inbox: dict[tuple[int, int, int], Any] = {}
        self._events: list[Event] = []
        self._aborted = False
        self._program: WorkerProgram | None = None
        self._peers: list[Any] = []
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

    # ----- set-up, once -------------------------------------------------------------------
    def load(self, program: WorkerProgram, peers: list[Any], state: dict[int, np.ndarray]) -> dict[str, float]:
        """Deserialise the program's unit tasks onto this worker's devices and take the state."""
        import jax
        from jax.sharding import Mesh

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
        self._fns = {}
        for t in [*program.tasks.values(), *program.update]:
            exported = jax.export.deserialize(bytearray(t.exported))
            self._fns[(t.stage, t.phase, t.outvars)] = jax.jit(exported.call)
        self._shardings = {
            (t.stage, t.phase, t.outvars): [jax.sharding.NamedSharding(self._meshes[t.stage], p) for p in t.in_specs]
            for t in [*program.tasks.values(), *program.update]
        }
        self._program, self._peers = program, list(peers)
        self._state = _resolve(state)
        self._placed = {}
        return {"load_seconds": time.perf_counter() - t0}

    # ----- messages from peers ------------------------------------------------------------
    def receive(self, step: int, var: int, microbatch: int, value: Any, sender: int, sent_at: float, sent_step: int) -> None:
        """A tensor another worker made (RECV): kept until this worker's walk of ``step`` reads it.

        The event is filed under ``sent_step``, the step whose traffic it is (new state is
        sent at the end of one step and read in the next).
        """
        if isinstance(value, list):  # a big tensor: one object-store copy shared by every receiver
            import ray

            value = ray.get(value[0])
        now = time.time()
        with self._cv:
            self._inbox[(step, var, microbatch)] = value
            nbytes = int(value.nbytes)
            self._events.append(Event(self.worker, self.worker, -1, "recv", "", microbatch, sent_step, sent_at, now, nbytes, sender, var))
            self._cv.notify_all()

    def abort(self) -> None:
        with self._cv:
            self._aborted = True
            self._cv.notify_all()

    def _take(self, step: int, var: int, microbatch: int) -> Any:
        with self._cv:
            return self._inbox.pop((step, var, microbatch))

    def _has(self, step: int, var: int, microbatch: int) -> bool:
        return (step, var, microbatch) in self._inbox

    def _wait(self) -> None:
        with self._cv:
            if self._aborted:
                raise WorkerAborted(f"worker {self.worker}: step aborted by the driver")
            self._cv.wait(timeout=0.5)

    # ----- one step -----------------------------------------------------------------------
    def run_step(self, step: int, batch: dict[int, np.ndarray], with_state: bool = False) -> dict[str, Any]:
        """Run this worker's part of one training step; returns its results and traffic (and its state leaves)."""
        import jax

        from alpa_lab.runtime.pipeline import split_microbatches, walk_schedule

        prog = self._program
        if prog is None:
            raise RuntimeError(f"worker {self.worker} has no program: the driver must call load first")
        t_start = time.perf_counter()
        batch = _resolve(batch)
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

        def send(v: int, mb: int, x: Any, to: tuple[int, ...], tag: int) -> None:
            import ray

            t = time.time()
            host = _to_host(x)
            # small tensors travel inside the message (Ray inlines small arguments); a big one is put in the
            # object store once and every receiving worker reads that one copy
            # (wrapped in a list, so the receiver reads it with ray.get: 4x faster at 128 MiB than a top-level ref here)
            ref = host if host.nbytes <= INLINE_BYTES else [ray.put(host)]
            for peer in to:
                call = self._peers[peer].receive.remote(step + (1 if tag == STATE else 0), v, tag, ref, self.worker, t, step)
                if tag == STATE:  # waited for below: when the step returns, the next step's state is in place
                    acks.append(call)
                sent[peer] += int(host.nbytes)
                self._events.append(Event(self.worker, self.worker, -1, "send", "", mb, step, t, time.time(), int(host.nbytes), peer, v))

        def call(task: Any, mb: int) -> list[Any]:
            key = (task.stage, task.phase, task.outvars)
            ins = [fetch(v, mb, task.stage, sh) for v, sh in zip(task.invars, self._shardings[key])]
            t = time.time()
            outs = self._fns[key](*ins)
            jax.block_until_ready(outs)
            self._events.append(Event(self.worker, self.worker, task.stage, "run", task.phase, mb, step, t, time.time()))
            return list(outs)

        def ready(s: int, phase: str, mb: int) -> bool:
            return all(available(v, mb) for v in prog.tasks[(s, phase)].invars)

        def execute(s: int, phase: str, mb: int) -> None:
            task = prog.tasks[(s, phase)]
            outs = call(task, mb)
            for v, x in zip(task.outvars, outs):
                store[(v, mb)] = x
                left[(v, mb)] = prog.local_readers.get(v, 0)
                if v in prog.accumulated:
                    inexact = np.issubdtype(np.dtype(prog.var_dtypes[v]), np.inexact)
                    sums[v] = x if v not in sums or not inexact else sums[v] + x
                if v in prog.send_microbatch:
                    send(v, mb, x, prog.send_microbatch[v], mb)
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

        for v, total in sums.items():
            inexact = np.issubdtype(np.dtype(prog.var_dtypes[v]), np.inexact)
            step_values[v] = total / M if inexact else total
            if v in prog.send_step:
                send(v, -1, step_values[v], prog.send_step[v], STEP)
        for task in prog.update:  # once per step, in the plan's global order; remote inputs waited for
            while not all(available(v, -1) for v in task.invars):
                self._wait()
            outs = call(task, -1)
            for v, x in zip(task.outvars, outs):
                step_values[v] = x
                if v in prog.send_step:
                    send(v, -1, x, prog.send_step[v], STEP)
        for o, v, readers in prog.state_out:
            x = step_values[o]
            self._state[v] = x  # kept here too, so state() can read it from its maker
            for key in [k for k in placed if k[0] == v]:
                del placed[key]
            others = tuple(r for r in readers if r != self.worker)
            if others:
                send(v, STATE, x, others, STATE)
        results = {i: _to_host(step_values[o]) for i, o in prog.results}
        if acks:
            import ray

            ray.get(acks)
        with self._cv:  # anything left for this step was not read: a planning bug worth seeing
            stale = [k for k in self._inbox if k[0] <= step and k[2] != STATE]
        if stale:
            raise RuntimeError(f"worker {self.worker}: step {step} left received tensors unread: {stale[:5]}")
        reply = {"results": results, "sent": dict(sent), "seconds": time.perf_counter() - t_start}
        if with_state:
            reply["state"] = self.state()
        return reply

    def received(self, step: int) -> dict[int, int]:
        """Bytes received from each peer for ``step``'s traffic (complete once every worker finished it)."""
        out: dict[int, int] = defaultdict(int)
        with self._cv:
            for e in self._events:
                if e.kind == "recv" and e.step == step:
                    out[e.peer] += e.nbytes
        return dict(out)

    # ----- reading back -------------------------------------------------------------------
    def state(self) -> dict[int, np.ndarray]:
        """The state leaves this worker holds (those made here, and those it reads), as host arrays."""
        prog = self._program
        own = {v for _, v, _ in prog.state_out} if prog else set()
        return {v: _to_host(x) for v, x in self._state.items() if v in own or v not in (prog.remote_state if prog else ())}

    def events(self, since: int = 0) -> tuple[int, list[Event]]:
        """Events from index ``since`` on, and the index to ask from next time."""
        with self._cv:
            out = self._events[since:]
            return since + len(out), out

    def memory(self) -> list[dict[str, Any]]:
        """Per device: bytes in use and the limit, where the backend reports them."""
        import jax

        out = []
        for d in jax.local_devices():
            stats = d.memory_stats() or {}
            out.append({"device": str(d), "bytes_in_use": stats.get("bytes_in_use"), "bytes_limit": stats.get("bytes_limit")})
        return out


def _resolve(refs: dict[int, Any]) -> dict[int, Any]:
    """Values of a dict of Ray object refs (Ray resolves only top-level arguments by itself)."""
    if not any(type(r).__name__ == "ObjectRef" for r in refs.values()):
        return dict(refs)  # values already (a worker driven without Ray, as in a direct check)
    import ray

    keys = list(refs)
    values = ray.get([refs[k] for k in keys])
    return dict(zip(keys, values))


def _to_host(x: Any) -> np.ndarray:
    """A host copy of ``x``; an array spread over a group of processes is gathered (every member calls this)."""
    if getattr(x, "is_fully_addressable", True):
        return np.asarray(x)
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def _node_ip() -> str:
    try:
        import ray

        return ray.util.get_node_ip_address()
    except Exception:  # noqa: BLE001 - outside Ray (tests of the class itself)
        return "127.0.0.1"
