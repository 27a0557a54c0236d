"""Alpa's profiling cost model: each stage's unit tasks compiled and timed on the devices they run on.

The analytic model prices a stage from FLOPs, bytes and link speeds; this one runs it. The
stages the planner chose are compiled exactly as the runtime will run them
(``runtime.pipeline.compile_pipeline``: the same unit tasks, shardings and sub-meshes), fed
zeros of the right shapes, and timed (the median of a few runs after a warm-up); a stage's
forward, backward (for zero-bubble schedules B and W) and update times replace the analytic
ones, and the schedule is simulated again with them. Timings are cached on disk (under
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


def _time_task(task: Any, graph: Any, repeats: int, cache: dict[str, float], hardware: str) -> tuple[float, bool]:
    """Median seconds of one unit task on its mesh, and whether it came from the cache.

    ``hardware``: the ``hardware_key`` of the process's devices; the task's own mesh (its device count) is in
    its lowered program and added to the key here too.
    """
    args = [jax.device_put(_example(graph.vars[v]), sh) for v, sh in zip(task.invars, task.in_shardings)]
    text = task.fn.lower(*args).as_text() if hasattr(task.fn, "lower") else repr(task)
    mesh_devices = len({d for sh in task.in_shardings for d in getattr(sh, "device_set", ())})
    key = hashlib.sha256(f"{hardware}\nmesh_devices={mesh_devices}\n{text}".encode()).hexdigest()
    if key in cache:
        return cache[key], True
    jax.block_until_ready(task.fn(*args))  # compile and warm up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(task.fn(*args))
        times.append(time.perf_counter() - t0)
    cache[key] = statistics.median(times)
    return cache[key], False


def time_stages(compiled: Any, repeats: int = REPEATS, cache_path: Path | None = None) -> dict[tuple[int, str], float]:
    """(stage, phase) -> measured seconds of each unit task of a compiled pipeline (the update: its pieces summed)."""
    from alpa_lab.passes.stages import APPLY

    path = cache_path or profile_cache_path()
    cache = _load_cache(path)
    before = dict(cache)
    devices = hardware_key(list({d.id: d for m in compiled.meshes for d in m.devices.flat}.values()))
    out: dict[tuple[int, str], float] = {}
    for key, task in compiled.tasks.items():
        if task.invars or task.outvars:
            out[key] = _time_task(task, compiled.graph, repeats, cache, devices)[0]
    for task in compiled.update:
        out[(task.stage, APPLY)] = out.get((task.stage, APPLY), 0.0) + _time_task(task, compiled.graph, repeats, cache, devices)[0]
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
