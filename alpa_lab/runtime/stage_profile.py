"""Alpa's profiling cost model: each stage's unit tasks compiled and timed on the devices they run on.

The analytic model prices a stage from FLOPs, bytes and link speeds; this one runs it. The
stages the planner chose are compiled exactly as the runtime will run them
(``runtime.pipeline.compile_pipeline``: the same unit tasks, shardings and sub-meshes), fed
zeros of the right shapes, and timed (the median of a few runs after a warm-up); a stage's
forward, backward (for zero-bubble schedules B and W) and update times replace the analytic
ones, and the schedule is simulated again with them. Timings are cached on disk (under
``$ALPA_LAB_CACHE`` or ~/.cache/alpa_lab), keyed by the unit task's lowered program (which
holds the shardings and the mesh shape) and the devices' kind, so re-plans and new sessions
re-time only what changed. The stage DP's candidates are still priced by the analytic model.

``stage_timer(split)`` makes the function a ``PipelineProblem`` calls (its ``stage_timer``):
``parallelize(..., cost_model="profile")`` sets it, and every plan and re-plan of that step
uses it.
"""

from __future__ import annotations

import hashlib
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import jax
import numpy as np

__all__ = ["profile_cache_path", "stage_timer", "time_stages"]

REPEATS = 5


def profile_cache_path() -> Path:
    root = Path(os.environ.get("ALPA_LAB_CACHE") or Path.home() / ".cache" / "alpa_lab")
    return root / "stage-profiles.json"


def _load_cache(path: Path) -> dict[str, float]:
    try:
        data = json.loads(path.read_text())
        return {str(k): float(v) for k, v in data.items()} if isinstance(data, dict) else {}
    except (OSError, ValueError, TypeError):
        return {}


def _time_task(task: Any, graph: Any, repeats: int, cache: dict[str, float], devices: str) -> tuple[float, bool]:
    """Median seconds of one unit task on its mesh, and whether it came from the cache."""
    args = [
        jax.device_put(np.zeros(graph.vars[v].shape, dtype=graph.vars[v].dtype), sh) for v, sh in zip(task.invars, task.in_shardings)
    ]
    text = task.fn.lower(*args).as_text() if hasattr(task.fn, "lower") else repr(task)
    key = hashlib.sha256(f"{devices}\n{text}".encode()).hexdigest()
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
    before = len(cache)
    devices = ",".join(sorted({d.device_kind for m in compiled.meshes for d in m.devices.flat}))
    out: dict[tuple[int, str], float] = {}
    for key, task in compiled.tasks.items():
        if task.invars or task.outvars:
            out[key] = _time_task(task, compiled.graph, repeats, cache, devices)[0]
    for task in compiled.update:
        out[(task.stage, APPLY)] = out.get((task.stage, APPLY), 0.0) + _time_task(task, compiled.graph, repeats, cache, devices)[0]
    if len(cache) != before:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(cache))
        tmp.replace(path)
    return out


def stage_timer(split: Sequence[bool], repeats: int = REPEATS) -> Callable[..., dict[tuple[int, str], float]]:
    """The timer a ``PipelineProblem`` calls with (problem, stage results, schedule): its stages' measured times."""
    from alpa_lab.runtime.pipeline import compile_pipeline

    def timer(problem: Any, stages: Sequence[Any], schedule: Any) -> dict[tuple[int, str], float]:
        pieces = [problem.piece(st.layers) for st in stages]
        compiled = compile_pipeline(problem.graph, problem.slicing, stages, schedule, split, pieces=pieces)
        return time_stages(compiled, repeats)

    return timer
