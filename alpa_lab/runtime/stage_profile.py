"""Alpa's profiling cost model: each stage's unit tasks compiled and timed on the devices they run on.

The analytic model prices a stage from FLOPs, bytes and link speeds; this one runs it. The
stages the planner chose are compiled exactly as the runtime will run them
(``runtime.pipeline.compile_pipeline``: the same unit tasks, shardings and sub-meshes), fed
zeros of the right shapes, and timed (the median of 5-50 runs after a warm-up: ``PROFILE_SECONDS``); a stage's
forward, backward (for zero-bubble schedules B and W) and update times replace the analytic
ones, and the schedule is simulated again with them. A unit task is timed as the runtime's RUN
instruction runs it: its program, then the program that adds the tensors it makes every
micro-batch into their sums (``runtime.accumulate``; for the tiny GPT's backward on simulated
CPU devices, half as long again as the backward program). The tasks are timed in turns, one
run of each per round, so that each run follows another program, as in a pipeline, not a run
of itself with the devices' threads still warm. Timings are cached on disk (under
``$ALPA_LAB_CACHE`` or ~/.cache/alpa_lab), keyed by the unit task's lowered program (which
holds the shardings and the mesh shape) and the hardware and software that timed it (platform,
device kind and count, the CPU for simulated devices, the jax and jaxlib versions:
``hardware_key``), so re-plans and new sessions re-time only what changed and a profile taken
elsewhere is never reused. The stage DP's candidates are still priced by the analytic model.

The cache file is shared by every process that plans: a write merges its new timings into
what is on disk at that moment (under a lock file where the OS has ``flock``) and replaces the
file atomically (a unique temporary file in the same folder, then ``os.replace``), so
concurrent planners neither lose each other's timings nor leave a half-written file. A cache
that cannot be read or written (a read-only folder, a broken file) costs a warning, never the
plan: the stages are then timed afresh.

``stage_timer(split)`` makes the function a ``PipelineProblem`` calls (its ``stage_timer``):
``parallelize(..., cost_model="profile")`` sets it, and every plan and re-plan of that step
uses it.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import math
import os
import platform
import statistics
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any, Callable, Sequence

import jax
import numpy as np

from alpa_lab.graph.opgraph import key_impl

__all__ = ["hardware_key", "profile_cache_path", "stage_timer", "time_stages"]

REPEATS = 5
"""rounds of timed runs at least (each task once per round)"""
MAX_REPEATS = 50
"""rounds at most: what short tasks get, so that their median is not one noisy sample of five"""
PROFILE_SECONDS = 0.25
"""the timed rounds last about this long together, within [REPEATS, MAX_REPEATS] rounds: a task of 0.5 ms on a
busy 2-core machine varies by 2x run to run, so five runs of it gave medians 1.5-2.3x the runtime's (a 1 s GPU
stage keeps its five)"""


def profile_cache_path() -> Path:
    root = Path(os.environ.get("ALPA_LAB_CACHE") or Path.home() / ".cache" / "alpa_lab")
    return root / "stage-profiles.json"


def _load_cache(path: Path) -> dict[str, float]:
    """The timings on disk; a missing file is an empty cache, an unreadable or broken one too (with a warning)."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return {}
    except OSError as e:
        warnings.warn(f"cannot read the stage-profile cache {str(path)!r} ({e}); the stages are timed afresh", stacklevel=3)
        return {}
    try:
        data = json.loads(text)
        return {str(k): float(v) for k, v in data.items()} if isinstance(data, dict) else {}
    except (ValueError, TypeError, AttributeError):
        return {}  # a half-written file of an older version, or another program's: timed again, then overwritten


@contextlib.contextmanager
def _locked(path: Path):
    """Hold an exclusive lock on ``path``.lock while reading, merging and replacing the cache (where flock exists)."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not POSIX: the atomic replace alone (a concurrent write may win)
        yield
        return
    fd = os.open(path.with_name(path.name + ".lock"), os.O_RDWR | os.O_CREAT, 0o666)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def _store(path: Path, new: dict[str, float]) -> bool:
    """Merge ``new`` timings into the cache file atomically; False (and a warning) when it cannot be written."""
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with _locked(path):
            merged = {**_load_cache(path), **new}  # what other processes wrote since we read it stays
            fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
            with os.fdopen(fd, "w") as f:
                json.dump(merged, f)
            os.replace(tmp, path)
            tmp = None
        return True
    except OSError as e:
        warnings.warn(f"cannot write the stage-profile cache {str(path)!r} ({e}); the timings are not kept", stacklevel=3)
        return False
    finally:
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)


@functools.lru_cache(maxsize=None)
def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def hardware_key(devices: Sequence[Any]) -> str:
    """What a unit task's timing depends on besides its program: the devices that ran it and the software.

    The platform and its version, the devices' kinds and count, the process's device count (simulated CPU
    devices share the host's cores), for CPU devices the processor and its core count, and the jax and
    jaxlib versions: a timing taken on other hardware or another jax is never reused.
    """
    import jaxlib

    devices = list(devices)
    d0 = devices[0]
    client = getattr(d0, "client", None)
    parts = [
        f"platform={d0.platform}",
        f"platform_version={getattr(client, 'platform_version', '')}",
        f"kinds={','.join(sorted({d.device_kind for d in devices}))}",
        f"devices={len(devices)}",
        f"process_devices={jax.device_count()}",
        f"jax={jax.__version__}",
        f"jaxlib={getattr(jaxlib, '__version__', '')}",
    ]
    if d0.platform == "cpu":
        parts += [f"cpu={_cpu_model()}", f"cores={os.cpu_count()}", f"machine={platform.machine()}"]
    return ";".join(parts)


def _example(var: Any) -> Any:
    """An array of ``var``'s shape and dtype to time a task with: zeros, or a PRNG key for a typed key."""
    impl = key_impl(var.dtype)
    if impl is not None:
        return jax.numpy.broadcast_to(jax.random.key(0, impl=impl), var.shape)
    return np.zeros(var.shape, dtype=var.dtype)


TIMING = "run+sums/3"
"""what a cached timing is of, in its key: a timing taken another way (the program alone, back to back, or the
median of five runs however short) is not reused"""


class _Timed:
    """One unit task made ready to time as a RUN instruction: its example inputs (made only if it is timed), and
    its sums' starting values."""

    def __init__(self, task: Any, graph: Any, accumulated: frozenset[int]):
        self.task, self.graph = task, graph
        self.summed = [i for i, v in enumerate(task.outvars) if v in accumulated]
        self.dtypes = {task.outvars[i]: graph.vars[task.outvars[i]].dtype for i in self.summed}
        self.sums: dict[int, Any] = {}

    @functools.cached_property
    def args(self) -> list[Any]:
        return [jax.device_put(_example(self.graph.vars[v]), sh) for v, sh in zip(self.task.invars, self.task.in_shardings)]

    def key(self, hardware: str) -> str:
        """The cache key: the lowered program (shardings and mesh shape in it; lowered on abstract arguments, so
        nothing is allocated for a cached task), its mesh's size, which results it sums, the hardware."""
        from alpa_lab.graph.opgraph import dtype_of

        task = self.task
        if hasattr(task.fn, "lower"):
            abstract = [jax.ShapeDtypeStruct(self.graph.vars[v].shape, dtype_of(self.graph.vars[v].dtype), sharding=sh)
                        for v, sh in zip(task.invars, task.in_shardings)]
            text = task.fn.lower(*abstract).as_text()
        else:
            text = repr(task)
        mesh_devices = len({d for sh in task.in_shardings for d in getattr(sh, "device_set", ())})
        sums = ",".join(f"{i}:{self.dtypes[task.outvars[i]]}" for i in self.summed)
        return hashlib.sha256(f"{hardware}\n{TIMING}\nmesh_devices={mesh_devices}\nsums={sums}\n{text}".encode()).hexdigest()

    def run(self) -> float:
        """Seconds of the program and its sums (``accumulate``, as ``runtime.pipeline`` runs them), to the last result."""
        from alpa_lab.runtime.accumulate import accumulate

        t0 = time.perf_counter()
        outs = self.task.fn(*self.args)
        if self.summed:
            accumulate(self.sums, [(self.task.outvars[i], outs[i]) for i in self.summed], self.dtypes)
        jax.block_until_ready((outs, list(self.sums.values())))
        return time.perf_counter() - t0


def _time_tasks(tasks: Sequence[Any], graph: Any, accumulated: frozenset[int], repeats: int, cache: dict[str, float],
                hardware: str) -> list[float]:
    """Median seconds of each unit task's RUN on its mesh (cached ones from ``cache``), the uncached timed in turns:
    at least ``repeats`` rounds, more (to ``MAX_REPEATS``) while they fill less than ``PROFILE_SECONDS``.

    ``hardware``: the ``hardware_key`` of the process's devices; each task's own mesh (its device count) is in
    its lowered program and added to the key here too.
    """
    timed = [_Timed(task, graph, accumulated) for task in tasks]
    keys = [t.key(hardware) for t in timed]
    todo = [i for i, k in enumerate(keys) if k not in cache]
    for i in todo:  # compile, warm up, and make the sums a later run adds into (the runtime's steady state)
        timed[i].run()
        timed[i].run()
    seconds: dict[int, list[float]] = {i: [] for i in todo}
    for i in todo:  # the first round says how many fit in PROFILE_SECONDS
        seconds[i].append(timed[i].run())
    per_round = sum(seconds[i][0] for i in todo)
    rounds = max(repeats, min(MAX_REPEATS, math.ceil(PROFILE_SECONDS / per_round))) if per_round > 0 else repeats
    for _ in range(rounds - 1):  # in turns: each run follows another task's, not a run of itself
        for i in todo:
            seconds[i].append(timed[i].run())
    for i in todo:
        cache[keys[i]] = statistics.median(seconds[i])
    return [cache[k] for k in keys]


def time_stages(compiled: Any, repeats: int = REPEATS, cache_path: Path | None = None) -> dict[tuple[int, str], float]:
    """(stage, phase) -> measured seconds of each unit task of a compiled pipeline, as the runtime's RUN
    instruction runs it (with its sums); the update: its pieces summed."""
    from alpa_lab.passes.stages import APPLY

    path = cache_path or profile_cache_path()
    cache = _load_cache(path)
    before = dict(cache)
    devices = hardware_key(list({d.id: d for m in compiled.meshes for d in m.devices.flat}.values()))
    runs = [(key, task) for key, task in compiled.tasks.items() if task.invars or task.outvars]
    accumulated = frozenset(compiled.slicing.accumulated) - frozenset(compiled.slicing.stacked)  # stacked: not summed
    found = _time_tasks([task for _, task in runs] + list(compiled.update), compiled.graph, accumulated, repeats, cache, devices)
    out: dict[tuple[int, str], float] = dict(zip((key for key, _ in runs), found))
    for task, seconds in zip(compiled.update, found[len(runs):]):  # an update sums nothing: the sums are its inputs
        out[(task.stage, APPLY)] = out.get((task.stage, APPLY), 0.0) + seconds
    new = {k: v for k, v in cache.items() if k not in before}
    if new:
        _store(path, new)
    return out


def stage_timer(split: Sequence[bool], repeats: int = REPEATS) -> Callable[..., dict[tuple[int, str], float]]:
    """The timer a ``PipelineProblem`` calls with (problem, stage results, schedule): its stages' measured times."""
    from alpa_lab.runtime.pipeline import compile_pipeline

    def timer(problem: Any, stages: Sequence[Any], schedule: Any) -> dict[tuple[int, str], float]:
        pieces = [problem.piece(st.layers) for st in stages]
        compiled = compile_pipeline(problem.graph, problem.slicing, stages, schedule, split, pieces=pieces)
        return time_stages(compiled, repeats)

    return timer
