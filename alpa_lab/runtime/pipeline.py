"""Run a pipeline plan on this process's devices: stages on sub-meshes, micro-batches, schedule.

Each stage's ops are split into *unit tasks* (the cross-mesh resharding paper's term):
the stage's forward and its backward (for zero-bubble schedules, the backward's input
gradient B and weight gradient W), run once per micro-batch, and pieces of the weight
update, run once per step. Every unit task is one ``jax.jit`` on the stage's sub-mesh with
the stage plan's shardings (``compile_graph``). The driver walks each stage's instruction
list of the schedule: a stage runs its next RUN as soon as the tensors it needs exist, a
tensor from another stage is moved to the consumer's mesh and sharding with
``jax.device_put`` (the SEND/RECV pair), and a micro-batch's activations are dropped after
their last reader (FREE). Tensors the update reads (gradients, the loss, batch statistics)
are summed over micro-batches where they are produced and divided by their number: the
step's gradient is the mean of the micro-batch gradients, which for a loss that is a mean
over the batch is the full batch's gradient.
"""

from __future__ import annotations

import functools
import time
from collections import defaultdict, deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Callable

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding

from alpa_lab.graph.opgraph import OpGraph
from alpa_lab.graph.subgraph import subgraph
from alpa_lab.passes.pipeline import StageResult, stage_tensor_specs
from alpa_lab.passes.schedule import BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT, FORWARD, Schedule
from alpa_lab.passes.stages import APPLY, ProgramSlicing, weight_gradient_ops
from alpa_lab.runtime.accumulate import accumulate, averaged
from alpa_lab.runtime.apply import DeviceError, compile_graph
from alpa_lab.sharding.spec import ShardingSpec

__all__ = ["CompiledPipeline", "PipelineRunError", "compile_pipeline", "split_microbatches", "walk_schedule"]

TRACE_RECORDS = 100_000
"""unit-task runs whose records ``CompiledPipeline.trace`` keeps, whole calls (Alpa's ``get_stage_execution_info``):
a long training loop keeps its last calls in a bounded memory (about 14 MB), at least one however many runs a call has"""


class PipelineRunError(RuntimeError):
    """The pipeline cannot run as planned (the state passed in is left untouched)."""


@dataclass(frozen=True, eq=False)
class UnitTask:
    """A piece of one stage run as one jitted call: reads ``invars``, writes ``outvars``."""

    stage: int
    phase: str
    fn: Callable[..., Any]
    invars: tuple[int, ...]
    outvars: tuple[int, ...]
    in_shardings: tuple[NamedSharding, ...]


@dataclass(eq=False)
class CompiledPipeline:
    """A pipeline plan bound to devices: call it with the step's flat arguments (full batch)."""

    graph: OpGraph
    slicing: ProgramSlicing
    stages: tuple[StageResult, ...]
    schedule: Schedule
    num_microbatches: int
    split: tuple[bool, ...]
    """per flat argument: is it split into micro-batches (axis 0)?"""
    meshes: tuple[Mesh, ...]
    tasks: dict[tuple[int, str], UnitTask]
    update: tuple[UnitTask, ...]
    stage_of_op: tuple[int, ...]
    input_sharding: dict[tuple[int, int], NamedSharding]
    needs: dict[tuple[int, str], set[tuple[int, str]]]
    """per-micro-batch task -> the tasks of the same micro-batch it reads from."""
    readers: dict[int, int]
    """per-micro-batch tensor -> how many tasks read it (FREE after the last)."""
    plan: Any = None
    """the PipelinePlan this was compiled from (set by ``ParallelizedStep``)."""
    last_timings: dict[str, Any] = field(default_factory=dict)
    """the last call's seconds, per-task dispatch seconds, (stage, phase, micro-batch, start, end) records and, when
    profiled, (stage, var, micro-batch, bytes, start, end) transfers: each tensor a stage got from another mesh, and
    ``link_bytes``: (sending stage, receiving stage) -> the bytes that landed on the receiving stage's devices in the
    step (each device's shard, counted from the arrays: what the Traffic view predicts from the unit tasks)."""
    trace: deque = field(init=False)
    """the last calls' (start, records), as many as hold ``TRACE_RECORDS`` runs: the call's start (``time.time()``, as
    a mesh worker's events) and its ``last_timings["records"]``, whose times count from it. Empty in every new
    CompiledPipeline, one made by ``dataclasses.replace`` for another plan included: its runs are its own"""
    profile: bool = False
    """wait for each unit task's inputs to arrive and for it to finish, so the records are run times, not dispatch
    or transfer times; and for each tensor from another mesh on its own, as a mesh worker's RECV (its span is its
    transfer, not the puts issued beside it)."""

    def __post_init__(self) -> None:
        runs = len(self.tasks) * self.num_microbatches + len(self.update)  # the records of one call
        self.trace = deque(maxlen=max(1, TRACE_RECORDS // max(runs, 1)))

    def __call__(self, *flat_args: Any) -> list[Any]:
        return _run(self, flat_args)

    @functools.cached_property
    def stage_of_tensor(self) -> dict[int, int]:
        """Tensor -> the stage whose unit task (or update piece) makes it: where a profiled transfer comes from."""
        return {v: task.stage for task in (*self.tasks.values(), *self.update) for v in task.outvars}

    @functools.cached_property
    def state_sources(self) -> dict[int, int]:
        """State argument -> the stage whose update makes its next value (read there next step)."""
        made = self.stage_of_tensor
        return {v: made[o] for o, v in self.graph.state_carries() if o in made}

    def task_hlo(self) -> dict[tuple[int, str], str]:
        """XLA's optimised HLO of every unit task, (stage, phase) -> text (the update's pieces as (stage, "apply"),
        joined): what each mesh really runs, to count the collectives XLA inserted. Lowered on abstract arguments
        with the tasks' shardings, so nothing is allocated."""
        from alpa_lab.graph.opgraph import dtype_of

        def text(task: UnitTask) -> str:
            args = [jax.ShapeDtypeStruct(self.graph.vars[v].shape, dtype_of(self.graph.vars[v].dtype), sharding=sh)
                    for v, sh in zip(task.invars, task.in_shardings)]
            return task.fn.lower(*args).compile().as_text()

        out = {key: text(task) for key, task in self.tasks.items() if task.invars or task.outvars}
        for task in self.update:
            key = (task.stage, APPLY)
            out[key] = out[key] + "\n" + text(task) if key in out else text(task)
        return out

    def lower_text(self, *flat_args: Any) -> str:
        """Every unit task's optimised HLO, one after another under a ``// stage s phase`` line (the arguments are
        not needed: the tasks' shapes are the plan's; accepted as the single-mesh ``CompiledPlan.lower_text``)."""
        return "\n".join(f"// stage {s} {phase}\n{hlo}" for (s, phase), hlo in sorted(self.task_hlo().items()))


def _mesh(device_ids: Sequence[int], shape: tuple[int, int], devices: list) -> Mesh:
    return Mesh(np.array([devices[i] for i in device_ids], dtype=object).reshape(shape), ("x", "y"))


def _check_devices(stages: Sequence[StageResult], devices: list) -> None:
    """Every stage's devices exist here, checked for all stages at once so the count asked for is enough."""
    need = max(d for st in stages for d in st.device_ids) + 1
    if len(devices) < need:
        raise DeviceError(
            f"the pipeline's {len(stages)} stages use devices 0..{need - 1} but JAX sees {len(devices)}; for simulated "
            f"CPU devices set XLA_FLAGS=--xla_force_host_platform_device_count={need} before JAX is first imported "
            "(in a notebook: restart the kernel after setting it), or plan for the devices you have"
        )


def compile_pipeline(
    graph: OpGraph,
    slicing: ProgramSlicing,
    stages: Sequence[StageResult],
    schedule: Schedule,
    split: Sequence[bool],
    devices: list | None = None,
    pieces: Sequence[Any] | None = None,
) -> CompiledPipeline:
    """Unit tasks of every stage, jitted on their sub-meshes with the stage plans' shardings.

    ``pieces``: the stages' programs if already cut (``PipelineProblem.piece``).
    """
    for st in stages:  # interleaved: stage j's devices are mesh j % P's
        first = stages[schedule.stages_of(schedule.mesh(st.index))[0]]
        if st.device_ids != first.device_ids:
            raise PipelineRunError(
                f"stage {st.index} runs on devices {list(st.device_ids)} but the schedule puts it on the mesh of stage "
                f"{first.index} (devices {list(first.device_ids)})"
            )
    devices = list(jax.devices()) if devices is None else list(devices)
    _check_devices(stages, devices)
    meshes = tuple(_mesh(st.device_ids, st.logical_shape, devices) for st in stages)
    stage_of_op = slicing.stage_of_ops([st.layers for st in stages])

    # the sharding each stage gives every tensor it touches (its plan, by op name and path)
    op_plans = [{o.name: o for o in st.plan.ops if o.kind == "op"} for st in stages]
    spec = stage_tensor_specs(graph, slicing, stages, pieces)

    def unit(stage: int, phase: str, ops: list[int]) -> UnitTask:
        piece = subgraph(graph, ops)
        in_specs = [spec[stage][v] for v in piece.invars]
        out_specs = [spec[stage][v] for v in piece.outvars]
        fn, ins, _ = compile_graph(piece.graph, op_plans[stage], in_specs, out_specs, meshes[stage])
        return UnitTask(stage, phase, fn, piece.invars, piece.outvars, ins)

    tasks = {}
    deferred = weight_gradient_ops(graph, slicing, stage_of_op) if schedule.split_backward else frozenset()
    for st in stages:
        mine = [i for i, s in enumerate(stage_of_op) if s == st.index]
        tasks[(st.index, FORWARD)] = unit(st.index, FORWARD, [i for i in mine if slicing.phase[i] == FORWARD])
        backward = [i for i in mine if slicing.phase[i] == BACKWARD]
        if schedule.split_backward:  # zero-bubble: B now, W (weight gradients) later
            tasks[(st.index, BACKWARD_INPUT)] = unit(st.index, BACKWARD_INPUT, [i for i in backward if i not in deferred])
            tasks[(st.index, BACKWARD_WEIGHT)] = unit(st.index, BACKWARD_WEIGHT, [i for i in backward if i in deferred])
        else:
            tasks[(st.index, BACKWARD)] = unit(st.index, BACKWARD, backward)
    update = tuple(unit(s, APPLY, ops) for s, ops in _update_pieces(graph, slicing, stage_of_op))
    input_sharding = {}
    for st in stages:
        for v, text in spec[st.index].items():
            if graph.vars[v].kind == "input":
                input_sharding[(v, st.index)] = NamedSharding(meshes[st.index], ShardingSpec.parse(text).to_partition_spec())
    producer_task = {v: key for key, t in tasks.items() for v in t.outvars}
    needs = {key: {producer_task[v] for v in t.invars if v in producer_task} for key, t in tasks.items()}
    readers: dict[int, int] = defaultdict(int)
    for t in tasks.values():
        for v in t.invars:
            if v in producer_task:
                readers[v] += 1
    return CompiledPipeline(
        graph, slicing, tuple(stages), schedule, schedule.num_microbatches, tuple(split), meshes, tasks, update,
        stage_of_op, input_sharding, needs, dict(readers),
    )


def _update_pieces(graph: OpGraph, slicing: ProgramSlicing, stage_of_op: Sequence[int]) -> list[tuple[int, list[int]]]:
    """The weight update cut into per-stage pieces, in an order that respects its dataflow.

    Kahn's order, staying on one stage while it can: a global-norm clip (every stage's sum,
    then the scale back to every stage) becomes a handful of pieces, not one per op.
    """
    ops = [i for i, p in enumerate(slicing.phase) if p == APPLY]
    inside = set(ops)
    waiting = {i: {graph.vars[v].producer for v in graph.ops[i].inputs} & inside for i in ops}
    readers = defaultdict(list)
    for i in ops:
        for p in waiting[i]:
            readers[p].append(i)
    ready = sorted(i for i in ops if not waiting[i])
    pieces: list[tuple[int, list[int]]] = []
    current = None
    while ready:
        same = [i for i in ready if stage_of_op[i] == current]
        if not same:
            current = stage_of_op[ready[0]]
            pieces.append((current, []))
            same = [i for i in ready if stage_of_op[i] == current]
        i = same[0]
        ready.remove(i)
        pieces[-1][1].append(i)
        for r in readers[i]:
            waiting[r].discard(i)
            if not waiting[r]:
                ready.append(r)
        ready.sort()
    return pieces


def split_microbatches(x: Any, num_microbatches: int) -> list[Any]:
    """``x`` cut along axis 0 into equal micro-batches."""
    n = x.shape[0]
    if n % num_microbatches:
        raise PipelineRunError(
            f"a batch of {n} cannot be split into {num_microbatches} equal micro-batches; "
            "choose a micro-batch count that divides the batch size"
        )
    b = n // num_microbatches
    return [x[m * b : (m + 1) * b] for m in range(num_microbatches)]


def walk_schedule(
    pending: dict[int, list[tuple[str, int]]],
    ready: Callable[[int, str, int], bool],
    execute: Callable[[int, str, int], None],
    wait: Callable[[], None] | None = None,
) -> None:
    """Run each stage's instruction list in order; a RUN goes as soon as ``ready`` says its inputs exist.

    The one walk of the schedule, shared by the in-process runtime (where every input is
    made by a stage of this process, so no progress means a deadlock) and the Ray mesh
    workers (where ``wait`` blocks until a tensor arrives from another worker).
    ``pending``: stage -> its (phase, micro-batch) RUNs still to go; emptied as they run.
    """
    while any(pending.values()):
        progress = False
        for s, queue in pending.items():
            while queue and ready(s, *queue[0]):
                execute(s, *queue[0])
                queue.pop(0)
                progress = True
        if not progress and any(pending.values()):
            if wait is None:
                stuck = {s: q[0] for s, q in pending.items() if q}
                raise PipelineRunError(f"the schedule deadlocked with stages waiting on {stuck}")
            wait()


def _devices(x: Any) -> set | None:
    """The devices an array is on (None: a host value)."""
    sharding = getattr(x, "sharding", None)
    return None if sharding is None else set(sharding.device_set)


def _run(cp: CompiledPipeline, flat_args: Sequence[Any]) -> list[Any]:
    graph, sl, M = cp.graph, cp.slicing, cp.num_microbatches
    if len(flat_args) != len(graph.invars):
        raise PipelineRunError(f"the step takes {len(flat_args)} flat arguments; the plan was made for {len(graph.invars)}")
    t0 = time.perf_counter()
    args = dict(zip(graph.invars, flat_args))
    micro = {v: split_microbatches(x, M) for v, x, s in zip(graph.invars, flat_args, cp.split) if s}
    placed: dict[tuple, Any] = {}  # (var, micro-batch or -1, stage) -> array on that stage's mesh
    store: dict[tuple[int, int], Any] = {}  # (var, micro-batch) -> value on its producer's mesh
    stacked = set(sl.stacked)  # an inference step's per-example results: put back together, not averaged
    accumulated = set(sl.accumulated) - stacked
    dtypes = {v: graph.vars[v].dtype for v in accumulated}
    sums: dict[int, Any] = {}
    pieces: dict[int, dict[int, Any]] = defaultdict(dict)  # stacked var -> micro-batch -> its rows
    step_values: dict[int, Any] = {}  # once-per-step tensors: averages and update results

    def put(x: Any, sharding: NamedSharding) -> Any:
        # an array already laid out as wanted (this stage's own tensors, weights from the last
        # step) needs no transfer; skipping device_put saves its dispatch
        return x if getattr(x, "sharding", None) == sharding else jax.device_put(x, sharding)

    def fetch(v: int, mb: int, stage: int, sharding: NamedSharding) -> Any:
        var = graph.vars[v]
        if var.kind == "input":
            if v in micro:
                key = (v, mb, stage)
                if key not in placed:
                    placed[key] = put(micro[v][mb], sharding)
                return placed[key]
            key = (v, -1, stage)
            if key not in placed:
                placed[key] = put(args[v], sharding)
                src = cp.state_sources.get(v) if cp.profile else None  # a state leaf last made on another mesh
                if src is not None and _devices(args[v]) == set(cp.meshes[src].devices.flat) != set(sharding.device_set):
                    land(src, stage, placed[key])
            return placed[key]
        value = step_values[v] if mb < 0 else store[(v, mb)]
        key = (v, mb, stage)
        if key not in placed:
            crosses = cp.profile and _devices(value) != set(sharding.device_set)  # a SEND/RECV
            if crosses and mb >= 0:  # a micro-batch's, timed alone: its span is its transfer, as a mesh worker's RECV
                jax.block_until_ready(value)
                sent = time.perf_counter()
                placed[key] = jax.block_until_ready(put(value, sharding))
                transfers.append((stage, v, mb, var.nbytes, sent - t0, time.perf_counter() - t0))
            else:
                placed[key] = put(value, sharding)
            if crosses:
                land(cp.stage_of_tensor[v], stage, placed[key])
        return placed[key]

    def land(src: int, dst: int, x: Any) -> None:
        """Count the bytes that landed on ``dst``'s devices, from the array itself (each device's shard)."""
        link_bytes[(src, dst)] = link_bytes.get((src, dst), 0) + sum(sh.data.nbytes for sh in x.addressable_shards)

    pending = {st.index: list(cp.schedule.runs(st.index)) for st in cp.stages}
    done: set[tuple[int, str, int]] = set()
    needs, readers = cp.needs, cp.readers
    left = {}  # (var, micro-batch) -> reads still to come; at 0 the tensor is freed (FREE)
    records: list[tuple[int, str, int, float, float]] = []  # (stage, phase, micro-batch, start, end)
    transfers: list[tuple[int, int, int, int, float, float]] = []  # (stage, var, micro-batch, bytes, start, end): RECVs
    link_bytes: dict[tuple[int, int], int] = {}  # profiled: (sending stage, receiving stage) -> bytes received this step

    def ready(s: int, phase: str, mb: int) -> bool:
        return all((ps, pp, mb) in done for ps, pp in needs[(s, phase)])

    def execute(s: int, phase: str, mb: int) -> None:
        task = cp.tasks[(s, phase)]
        if not task.invars and not task.outvars:  # an inference step's backward: nothing to run
            done.add((s, phase, mb))
            return
        ins = [fetch(v, mb, s, sh) for v, sh in zip(task.invars, task.in_shardings)]
        if cp.profile:  # the record is the RUN alone, as the plan prices it: the puts above (RECVs) have arrived
            jax.block_until_ready(ins)
        t = time.perf_counter()
        outs = task.fn(*ins)
        made = [(v, x) for v, x in zip(task.outvars, outs) if v in accumulated]
        if made:  # the RUN instruction includes its accumulation (one program, runtime.accumulate)
            accumulate(sums, made, dtypes)
        if cp.profile:
            jax.block_until_ready((outs, [sums[v] for v, _ in made]))
        end = time.perf_counter()
        records.append((s, phase, mb, t - t0, end - t0))
        for v, x in zip(task.outvars, outs):
            if v in stacked:
                pieces[v][mb] = x
            if readers.get(v, 0):  # kept until its last reader (FREE); the sums hold what the step needs
                store[(v, mb)] = x
                left[(v, mb)] = readers[v]
        for v in task.invars:
            if (v, mb) in left:
                left[(v, mb)] -= 1
                if left[(v, mb)] == 0:
                    del store[(v, mb)]
                    for st in cp.stages:
                        placed.pop((v, mb, st.index), None)
        done.add((s, phase, mb))

    walk_schedule(pending, ready, execute)
    step_values.update(averaged(sums, M, dtypes))
    for v, parts in pieces.items():  # on the mesh that made them, in micro-batch order
        step_values[v] = jax.numpy.concatenate([parts[m] for m in range(M)])
    for task in cp.update:
        ins = [fetch(v, -1, task.stage, sh) for v, sh in zip(task.invars, task.in_shardings)]
        t = time.perf_counter()
        outs = task.fn(*ins)
        if cp.profile:
            jax.block_until_ready(outs)
        records.append((task.stage, APPLY, -1, t - t0, time.perf_counter() - t0))
        for v, x in zip(task.outvars, outs):
            step_values[v] = x
    out = []
    for v in graph.outvars:  # JAX arrays, as jax.jit returns (a constant result too, a passed-through argument)
        var = graph.vars[v]
        if var.kind == "input":
            out.append(jax.numpy.asarray(args[v]))
        elif var.kind == "const":
            out.append(jax.numpy.asarray(graph.consts[v]))
        elif var.kind == "literal":
            out.append(jax.numpy.asarray(graph.literals[v]))
        else:
            out.append(step_values[v])
    per_task: dict[tuple[int, str], float] = defaultdict(float)  # (stage, phase) -> seconds, from the records
    for stage, phase, mb, start, end in records:
        if mb >= 0:
            per_task[(stage, phase)] += end - start
    cp.trace.append((time.time() - (time.perf_counter() - t0), tuple(records)))  # the call's start, wall clock
    cp.last_timings = {
        "seconds": time.perf_counter() - t0, "dispatch_seconds": dict(per_task), "records": records, "transfers": transfers,
        "link_bytes": link_bytes,
    }
    return out
