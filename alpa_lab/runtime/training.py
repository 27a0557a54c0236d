"""A training run in a background thread: the step's current plan, stepped until done or stopped.

``TrainingRun`` is what ``Workbench.launch`` (and ``ParallelizedStep.train``) start: on the
step's Ray cluster when it has one (a ``RayRun`` launched in the thread, closed at the end so
the next run can have the workers' devices), otherwise in this process. The run trains the
plan current at launch to the end: it compiles that plan once and calls the program itself,
so re-planning or ``step.use(other)`` while it goes changes the next run, not this one. After each step it
writes the step's figures, the new instruction events and, about once a second, the devices'
memory into its ``RunMonitor``; the notebook stays free while it goes. ``stop()`` ends it after
the step in progress; a failure ends it too, and says why. Either way the plan and the last
good state stay (``run.state``), and ``run.profile()`` gives what was measured against the
plan's prediction, for ``plan.recalibrated(profile)``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import jax
import numpy as np

from alpa_lab.cost.profile import Profile
from alpa_lab.graph.trace import args_signature
from alpa_lab.runtime.apply import call_compiled
from alpa_lab.runtime.mesh_worker import Event, memory_rows
from alpa_lab.runtime.monitor import MemoryRow, RunMonitor, StepRecord, median_step, profile

__all__ = ["TrainingRun"]

MEMORY_EVERY = 1.0
"""seconds between two memory samples"""


def batch_stream(batches: Any, num_args: int) -> Callable[[int], tuple]:
    """Step index -> the step's arguments after the state.

    ``batches`` is one batch (used for every step), a ``list`` of batches (cycled), an iterator
    or generator (one batch per step), or a function of the step index. A batch is the step's
    argument after the state, or a tuple of them when the step takes several; a mapping (a dict
    or Flax ``FrozenDict`` of arrays) is one batch, never an iterable of its keys.
    """

    def args(b: Any) -> tuple:
        return tuple(b) if num_args > 1 else (b,)

    if isinstance(batches, Mapping):
        return lambda i: args(batches)
    if callable(batches) and not hasattr(batches, "shape"):
        return lambda i: args(batches(i))
    if isinstance(batches, list):
        if not batches:
            raise ValueError("the list of batches is empty")
        return lambda i: args(batches[i % len(batches)])
    if isinstance(batches, Iterator):
        it = iter(batches)

        def nxt(i: int) -> tuple:
            try:
                return args(next(it))
            except StopIteration:
                raise StopIteration(f"the batches ran out after {i} steps") from None

        return nxt
    if isinstance(batches, Iterable) and not isinstance(batches, tuple) and not hasattr(batches, "shape"):
        return batch_stream(iter(batches), num_args)
    return lambda i: args(batches)


def _loss(out: Any) -> float | None:
    """The first scalar among the step's results after the state (the loss, as train steps return it)."""
    for leaf in jax.tree_util.tree_leaves(out):
        if np.ndim(leaf) == 0:
            try:
                return float(leaf)
            except (TypeError, ValueError):
                return None
    return None


def _samples(args: tuple) -> int:
    leaves = jax.tree_util.tree_leaves(args)
    return int(np.shape(leaves[0])[0]) if leaves and np.ndim(leaves[0]) else 1


def step_flops(step: Any, state: Any, batch: tuple, plan: Any = None) -> float:
    """FLOPs of one training step of ``plan`` (default: the step's current plan).

    The program's ops; a pipeline's per micro-batch ops x M, its update once.
    """
    from alpa_lab.plan import PipelinePlan

    plan = step.current_plan if plan is None else plan
    with step._serving((state, *batch), passed_on=True) as args:  # a run's arguments: the program's, all of them
        graph = step.trace(*args)
    if isinstance(plan, PipelinePlan) and plan.problem is not None:
        from alpa_lab.passes.stages import APPLY

        phase = plan.problem.slicing.phase
        once = sum(op.flops for op in graph.ops if phase[op.index] == APPLY)
        return (graph.total_flops - once) * plan.num_microbatches + once
    return graph.total_flops


def _new_state(step: Any, state: Any) -> Callable[[Any], Any]:
    """The default ``update``: the result's first element, or the result itself for a step that returns its new
    state alone (Alpa's ``return state.apply_gradients(...)``: a result with the state's structure)."""
    tree = jax.tree_util.tree_structure(state)

    def update(res: Any) -> Any:
        return res if jax.tree_util.tree_structure(res) == tree else res[0]

    return update


class TrainingRun:
    """``steps`` training steps of ``step``'s current plan, in a background thread (module docstring)."""

    def __init__(
        self,
        step: Any,
        state: Any,
        batches: Any,
        *,
        steps: int = 100,
        update: Callable[[Any], Any] | None = None,
        monitor: RunMonitor | None = None,
        memory_every: float = MEMORY_EVERY,
        start: bool = True,
    ):
        """``update(result)`` gives the next state (default: the result's first element)."""
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise ValueError(f"steps must be a positive number of steps, got {steps!r}")
        step._refuse_static_run("a training run")  # its steps take (state, batch) of arrays only
        step._refuse_nnx_run("a training run")  # it keeps the state: changes made in place could not reach it
        if step.current_plan is None:
            raise ValueError("the step has no plan yet: call step.plan(state, batch) first")
        self.step = step
        self.plan = step.current_plan
        self.steps = steps
        self.state = state
        """the last good state: the one launched with, then each step's new state"""
        self.state_step = 0
        """the steps ``state`` is after (0: the launch state)"""
        self.result: Any = None
        self.error = ""
        self.ray_run: Any = None
        self.on_ray = getattr(step, "ray_cluster", None) is not None
        self.backend = f"Ray: {step.ray_cluster!r}" if self.on_ray else "this process"
        self.monitor = monitor or RunMonitor()
        self.monitor.steps_total = steps
        self._update = update or _new_state(step, state)
        num_args = len(getattr(step, "_last_args", None) or (None, None)) - 1
        self._batch = batch_stream(batches, max(num_args, 1))
        self._memory_every = memory_every
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._work, name="alpa_lab-training", daemon=True)
        if start:
            self._thread.start()

    # ----- control ----------------------------------------------------------------------------
    @property
    def status(self) -> str:
        """"starting", "launching" (Ray), "running", "finished", "stopped" or "failed"."""
        return self.monitor.status

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def start(self) -> TrainingRun:
        if not self._thread.is_alive() and self.status == "starting":
            self._thread.start()
        return self

    def stop(self) -> None:
        """End the run after the step in progress; the state after it is kept (``run.state``)."""
        self._stop.set()

    def wait(self, timeout: float | None = None) -> TrainingRun:
        """Wait for the run to end (or ``timeout`` seconds); returns the run."""
        self._thread.join(timeout)
        return self

    def profile(self) -> Profile:
        """Measured against predicted per stage and phase (medians), for ``plan.recalibrated``."""
        return profile(self.plan, self.monitor, serial=not self.on_ray)

    def step_time(self) -> float:
        """Median measured step seconds (the compiling first step left out)."""
        return median_step(self.monitor.steps())

    def __repr__(self) -> str:
        snap = self.monitor
        return f"TrainingRun({snap.status}, step {snap.steps_done}/{self.steps} on {self.backend})"

    # ----- the loop ---------------------------------------------------------------------------
    def _work(self) -> None:
        """Launch and step; the final status is set last, once the state is fetched (or fetching it is known to have failed)."""
        mon = self.monitor
        status, error = "finished", ""
        try:
            first = self._batch(0)
            if self.on_ray:
                mon.set_status("launching")
                self._check_plan()
                self.ray_run = self.step.launch(self.step.ray_cluster, self.state, *first)
                if self.ray_run.plan is not self.plan:  # re-planned while it launched: not the plan the run shows
                    raise RuntimeError(self._changed())
                program = None
            else:
                program = self._compile((self.state, *first))
            self._flops = step_flops(self.step, self.state, first, self.plan)
            mon.set_status("running")
            self._loop(first, program)
            if self._stop.is_set() and mon.steps_done < self.steps:
                status = "stopped"
        except Exception as err:  # noqa: BLE001 - shown where the run is watched; the plan and the state stay
            if self.ray_run is not None and self.ray_run.last_state is not None:
                self.state, self.state_step = self.ray_run.last_state, self.ray_run.last_state_step
            status, error = "failed", self._describe(err)
        finally:
            rr = self.ray_run
            if rr is not None and not rr.closed:
                try:
                    self.state, self.state_step = rr.state(), rr.steps_done
                except Exception as err:  # noqa: BLE001 - keep the last state the driver holds, and say the run failed
                    if rr.last_state is not None:
                        self.state, self.state_step = rr.last_state, rr.last_state_step
                    status, error = "failed", error or self._describe(err, "fetching the state from the mesh workers failed: ")
                finally:
                    rr.close()
            self.error = error
            mon.set_status(status, error)  # last: whoever sees the run end finds run.state and run.error final

    def _check_plan(self) -> None:
        if self.step.current_plan is not self.plan:
            raise RuntimeError(self._changed())

    def _changed(self) -> str:
        return "the step's plan changed while the run was starting (re-planned or step.use): nothing was trained; launch again"

    def _compile(self, args: tuple) -> tuple[Any, Any, Any]:
        """The launch plan's compiled program, its traced graph and argument signature, for the whole run."""
        self._check_plan()
        with self.step._serving(args, passed_on=True):  # a run's arguments: the program's, all of them (no static ones)
            graph = self.step.trace(*args)
            compiled = self.step.compiled(*args)
        if compiled.plan is not self.plan:
            if compiled.plan != self.plan:
                raise RuntimeError(self._changed())
            self.plan = compiled.plan  # a loaded plan, with the planner state compiling attached to it
        return compiled, graph, args_signature(args)

    def _describe(self, err: BaseException, prefix: str = "") -> str:
        """The error as the run shows it; a mesh worker's also says where this run keeps the last good state."""
        from alpa_lab.runtime.ray_run import MeshWorkerError

        if not isinstance(err, MeshWorkerError):
            return f"{prefix}{type(err).__name__}: {err}"
        # its own text names the worker and what failed; run.last_state there is the RayRun's, this run's is run.state
        return f"{type(err).__name__}: {err} This run keeps the last good state, after step {self.state_step}, in run.state."

    def _loop(self, batch: tuple, program: tuple[Any, Any, Any] | None) -> None:
        """``steps`` steps on the Ray run, or of ``program`` (compiled at launch) in this process."""
        from alpa_lab.runtime.pipeline import CompiledPipeline

        mon = self.monitor
        compiled, graph, signature = program if program is not None else (None, None, None)
        if isinstance(compiled, CompiledPipeline):
            compiled.profile = True  # wait for each unit task: the records are run times, not dispatch times
        last_memory = 0.0
        try:
            for i in range(self.steps):
                if self._stop.is_set():
                    return
                if i:
                    batch = self._batch(i)
                start = time.time()
                t0 = time.perf_counter()
                if self.on_ray:
                    out = self.ray_run.step(*batch)
                    # the step alone: the state's copy back to the driver is not what the plan predicts
                    seconds = self.ray_run.last_step_seconds or time.perf_counter() - t0
                    events = self.ray_run.poll_events()
                    links = dict(self.ray_run.traffic[-1]["sent"]) if self.ray_run.traffic else {}
                    if self.ray_run.last_state_step == self.ray_run.steps_done:
                        self.state, self.state_step = self.ray_run.last_state, self.ray_run.steps_done
                    self.result = (self.state, *(out if isinstance(out, tuple) else (out,)))  # as step(state, batch) returns
                else:
                    args = (self.state, *batch)
                    if args_signature(args) != signature:  # the program is for the first step's shapes
                        raise ValueError(
                            f"step {i}'s arguments differ in structure, shape or dtype from the first step's: "
                            "a run trains one compiled program; launch a run per shape"
                        )
                    res = call_compiled(compiled, graph, args)
                    jax.block_until_ready(res)
                    seconds = time.perf_counter() - t0
                    out = res[1:] if isinstance(res, tuple) else res
                    self.result = res
                    self.state, self.state_step = self._update(res), i + 1
                    events = _process_events(compiled, self.plan, i, start, seconds)
                    # a profiled pipeline counts what landed on each stage's devices from another's
                    links = dict(compiled.last_timings.get("link_bytes", {})) if isinstance(compiled, CompiledPipeline) else {}
                mon.add_events(events)
                mon.add_step(StepRecord(i, start, seconds, _loss(out), _samples(batch), self._flops, links))
                if time.monotonic() - last_memory >= self._memory_every or i == self.steps - 1:
                    last_memory = time.monotonic()
                    mon.set_memory(self.ray_run.memory() if self.on_ray else _local_memory())
        finally:
            if isinstance(compiled, CompiledPipeline):
                compiled.profile = False


def _process_events(compiled: Any, plan: Any, step: int, start: float, seconds: float) -> list[Event]:
    """The in-process runtime's records of one step as mesh-worker events (a pipeline) or one event (one mesh)."""
    from alpa_lab.runtime.pipeline import CompiledPipeline

    if isinstance(compiled, CompiledPipeline):
        mesh_of = {st.index: compiled.schedule.mesh(st.index) for st in compiled.stages}
        runs = [
            Event(mesh_of[s], mesh_of[s], s, "run", phase, mb, step, start + a, start + b)
            for s, phase, mb, a, b in compiled.last_timings.get("records", ())
        ]
        # each tensor a mesh got from another, as a mesh worker records its RECV (the worker is the mesh here)
        recvs = [
            Event(mesh_of[s], mesh_of[s], -1, "recv", "", mb, step, start + a, start + b, nbytes,
                  mesh_of.get(compiled.stage_of_tensor.get(v), -1), v)
            for s, v, mb, nbytes, a, b in compiled.last_timings.get("transfers", ())
        ]
        return runs + recvs
    return [Event(0, 0, 0, "run", "step", -1, step, start, start + seconds)]


def _local_memory() -> list[MemoryRow]:
    return [MemoryRow(-1, **r) for r in memory_rows()]
