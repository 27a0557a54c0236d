"""A ``PipelinePlan``: stages on sub-meshes, a ``Plan`` per stage, and the schedule that runs them.

Plain data, as ``Plan`` is: it saves to JSON (``to_json``, every field but the planner state)
and imports no pass. Its edits (``pin``, ``pin_stages``, ``unpin_stages``, ``with_schedule``,
``recalibrated``) ask the planner state a plan made in this session keeps, ``problem``
(``passes.pipeline.PipelineProblem``, which does the work: ``PipelinePlanProblem`` says what
it offers); a loaded plan gets it back through ``ParallelizedStep.use`` (``attach``).
"""

from __future__ import annotations

import dataclasses
import functools
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Protocol, Sequence

import jax
import numpy as np

from alpa_lab.cost.cluster import _fmt_bytes
from alpa_lab.graph.opgraph import OpGraph, did_you_mean
from alpa_lab.plan.schema import (
    PIPELINE_PLAN_TYPE,
    SCHEMA_VERSION,
    PlanFormatError,
    _array,
    _cluster,
    _flag,
    _from_dict,
    _integer,
    _MissingField,
    _number,
    _optional,
    _plan_json,
    _read_plan_file,
    _seconds,
    _text,
    _with_path,
)
from alpa_lab.plan.single import Explanation, OpPlan, PinError, Plan, _plan_from_dict, _signed_pct, placement_tree
from alpa_lab.plan.timeline import SCHEDULE_NAMES, Timeline, TimelineRecord, pipeline_latency
from alpa_lab.sharding.constraints import DeviceError, spec_sharding
from alpa_lab.sharding.spec import ShardingSpec

Stages = Sequence[tuple[tuple[int, int], tuple[int, int], tuple[int, int], tuple[int, ...]]]
"""Stages as the planner places them: (layers [start, end), sub-mesh, logical mesh, device ids) each."""


class PipelinePlanProblem(Protocol):
    """What a ``PipelinePlan``'s planner state does for it: ``passes.pipeline.PipelineProblem``.

    Each method returns a new plan (or raises, leaving ``plan`` as it was); the plan stays data.
    """

    def replan(
        self, plan: PipelinePlan, stages: Stages, pins: Mapping[str, str], stage_pins: bool, schedule: str | None = None
    ) -> PipelinePlan:
        """``plan`` with ``stages`` (each re-planned with ``pins``), simulated under ``schedule``; memory checked."""
        ...

    def with_schedule(self, plan: PipelinePlan, schedule: str, chunks: int) -> PipelinePlan: ...

    def pin_stages(self, plan: PipelinePlan, layers: Any, submeshes: Any, logical_shapes: Any) -> PipelinePlan: ...

    def unpin_stages(self, plan: PipelinePlan) -> PipelinePlan: ...

    def recalibrated(self, plan: PipelinePlan, profile: Any) -> PipelinePlan: ...

    def attach(self, plan: PipelinePlan) -> PipelinePlan:
        """``plan`` (loaded from JSON) with this problem as its planner state, after checking it fits."""
        ...


@dataclass(frozen=True)
class StageResult:
    """A planned stage: its layers [start, end), where it runs, its plan and figures."""

    index: int
    layers: tuple[int, int]
    submesh_shape: tuple[int, int]
    logical_shape: tuple[int, int]
    device_ids: tuple[int, ...]
    plan: Plan
    forward_time: float
    backward_time: float
    apply_time: float
    weight_memory: float
    activation_memory: float
    in_flight: int
    weight_gradient_time: float = 0.0
    """the part of ``backward_time`` a zero-bubble schedule defers (W); 0 when not split."""

    @property
    def backward_input_time(self) -> float:
        """The rest of the backward when a zero-bubble schedule splits it (B): ``backward_time`` less W.
        Never negative: a stage whose backward is all weight gradients (the first) leaves a rounding error."""
        return max(self.backward_time - self.weight_gradient_time, 0.0)

    @property
    def memory_per_device(self) -> float:
        """Eq. 5: weights and optimizer state plus the activations of every micro-batch in flight."""
        return self.weight_memory + self.in_flight * self.activation_memory


def memory_per_mesh(stages: Sequence[StageResult]) -> dict[tuple[int, ...], float]:
    """Bytes per device of each mesh (by its device ids): eq. 5 summed over the stages on it
    (one stage, or an interleaved plan's virtual stages)."""
    on_mesh: dict[tuple[int, ...], float] = {}
    for st in stages:
        on_mesh[st.device_ids] = on_mesh.get(st.device_ids, 0.0) + st.memory_per_device
    return on_mesh


@dataclass(frozen=True)
class PipelinePlan:
    """Stages on sub-meshes, a ``Plan`` per stage, and the schedule that runs them.

    ``stages[i].layers`` is the half-open layer range [start, end); ``pin_stages`` takes
    inclusive [first, last] pairs, as a user reads them. Made by ``ParallelizedStep.plan``
    when the step is pipelined (``microbatches=``); its edits return new plans.
    """

    fingerprint: str
    method: str
    cluster: Mapping[str, Any]
    num_microbatches: int
    schedule: str
    num_layers: int
    stages: tuple[StageResult, ...]
    timeline: Timeline
    split_inputs: tuple[str, ...]
    """argument paths cut into micro-batches along axis 0 (the batch)."""
    stage_pins: bool = False
    planning_seconds: Mapping[str, float] = field(default_factory=dict)
    schema_version: int = SCHEMA_VERSION
    problem: PipelinePlanProblem | None = field(default=None, compare=False, repr=False)
    """the planner state (``passes.pipeline.PipelineProblem``) edits ask: not saved; ``ParallelizedStep.use`` re-attaches it."""
    max_stages: int | None = None
    """the stage DP's bound this plan was solved with (``parallelize(max_stages=)``): saved, so that a
    re-solve (``unpin_stages``, ``recalibrated``) searches the same space."""
    submesh_space: str = "all"
    """the stage DP's sub-mesh shapes (``parallelize(submesh_space=)``): saved for the same reason."""

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    @property
    def estimated_step_time(self) -> float:
        """Predicted seconds per step: the schedule's makespan, then the slowest stage's update."""
        return self.timeline.makespan + max(st.apply_time for st in self.stages)

    @functools.cached_property  # the dashboard and the workbench's table ask on every redraw; a plan never changes
    def serial_step_time(self) -> float:
        """Predicted seconds per step with its instructions one at a time: every RUN, every cross-mesh message
        and every stage's update, summed. A profiled step of the in-process runtime runs so (it waits for each
        unit task and each message, to time them), so that is the figure its measured step compares with, not
        ``estimated_step_time`` (every mesh at work at once, as mesh workers are)."""
        tl = self.timeline
        runs = sum(r.end - r.start for r in tl.records if r.kind == "RUN")
        messages = sum(arrival - start for _, _, start, arrival in tl.transfers())
        return runs + messages + sum(st.apply_time for st in self.stages)

    @property
    def latency(self) -> float:
        """Eq. 2 of the Alpa paper: sum of stage times + (B - 1) x the slowest stage."""
        times = [st.forward_time + st.backward_time for st in self.stages]
        return pipeline_latency(times, self.num_microbatches)

    @property
    def memory_per_device(self) -> float:
        """Bytes on the fullest device (eq. 5 per stage; interleaved stages on one mesh add up)."""
        return max(memory_per_mesh(self.stages).values())

    @property
    def bubble_fraction(self) -> float:
        return self.timeline.bubble_fraction

    @property
    def pins(self) -> tuple[tuple[str, str], ...]:
        return tuple(p for st in self.stages for p in st.plan.pins)

    def stage_of(self, op: str) -> int:
        """The stage whose plan holds op (or argument) ``op``."""
        for st in self.stages:
            if any(o.name == op for o in st.plan.ops):
                return st.index
        names = [o.name for st in self.stages for o in st.plan.ops]
        raise PinError(f"no op or argument named {op!r} in this plan{did_you_mean(op, names)}", (op,))

    @property
    def ops(self) -> tuple[OpPlan, ...]:
        """Every stage's ops and arguments, stage by stage, as ``Plan.ops`` lists one mesh's (an argument
        that several stages read is listed in each, with the spec that stage gives it)."""
        return tuple(o for st in self.stages for o in st.plan.ops)

    def op(self, name: str) -> OpPlan:
        """The op (or argument) ``name`` as the stage that holds it planned it (``stage_of``)."""
        return self.stages[self.stage_of(name)].plan.op(name)

    def explain(self, op: str) -> Explanation:
        """Every strategy of ``op`` with its cost, the rest of its stage held as planned (``Plan.explain``)."""
        return self.stages[self.stage_of(op)].plan.explain(op)

    def jit(self, fn: Any, devices: Sequence[Any] | None = None) -> Any:
        """Not for a pipeline plan: its stages run on different sub-meshes, one program per stage and
        micro-batch, which one ``jax.jit`` cannot express (``Plan.jit`` is for single-mesh plans)."""
        raise PlanFormatError(
            f"a pipeline plan ({self.num_stages} stages on sub-meshes, {self.num_microbatches} micro-batches) is not one "
            "jax.jit program: run it with parallelize(fn, cluster=..., microbatches=...) and step.use(plan), or take "
            "its shardings with plan.shardings(*args); Plan.jit is for single-mesh plans"
        )

    def summary(self) -> str:
        lines = [
            f"Pipeline plan ({self.method}) for program {self.fingerprint} on {self.cluster.get('name', '?')}: "
            f"{self.num_stages} stages, {self.num_layers} layers, {self.num_microbatches} micro-batches, "
            f"schedule {self.schedule}",
            f"  predicted step time {self.estimated_step_time * 1e3:.3f} ms (eq. 2 latency {self.latency * 1e3:.3f} ms, "
            f"bubble {self.bubble_fraction:.0%}); memory/device up to {_fmt_bytes(self.memory_per_device)}",
            f"  {'stage':<6} {'layers':<9} {'sub-mesh':<9} {'logical':<8} {'devices':<18} {'fwd ms':>8} {'bwd ms':>8} "
            f"{'update ms':>9} {'memory':>10}",
        ]
        for st in self.stages:
            devs = ",".join(map(str, st.device_ids))
            lines.append(
                f"  {st.index:<6} {f'{st.layers[0]}..{st.layers[1] - 1}':<9} "
                f"{f'{st.submesh_shape[0]}x{st.submesh_shape[1]}':<9} {f'{st.logical_shape[0]}x{st.logical_shape[1]}':<8} "
                f"{devs[:18]:<18} {st.forward_time * 1e3:8.3f} {st.backward_time * 1e3:8.3f} {st.apply_time * 1e3:9.3f} "
                f"{_fmt_bytes(st.memory_per_device):>10}"
                + (f"  ({st.plan.method} layout to fit memory)" if st.plan.method != self.method else "")
            )
        if self.pins:
            lines.append("  pins: " + ", ".join(f"{k}={v!r}" for k, v in self.pins))
        return "\n".join(lines)

    # ----- editing -------------------------------------------------------------------
    def _require_problem(self) -> PipelinePlanProblem:
        if self.problem is None:
            raise PlanFormatError(
                "this pipeline plan has no planner state attached (loaded from JSON?); call "
                "step.use(plan, *example_args) with the ParallelizedStep it belongs to, then edit the plan it returns"
            )
        return self.problem

    def _replan(self, stages: Stages, pins: Mapping[str, str], stage_pins: bool, schedule: str | None = None) -> PipelinePlan:
        return self._require_problem().replan(self, stages, pins, stage_pins, schedule)

    def with_schedule(self, schedule: str, chunks: int = 2) -> PipelinePlan:
        """The same stages run with another schedule (re-simulated; memory re-checked, eq. 5).

        ``"interleaved_1f1b"`` keeps the stages' meshes and cuts the layers into ``chunks``
        virtual stages per mesh (Megatron-LM's interleaving); each is planned on its mesh.
        """
        return self._require_problem().with_schedule(self, schedule, chunks)

    @property
    def num_meshes(self) -> int:
        """Distinct sub-meshes: ``num_stages``, or fewer when stages are interleaved."""
        return len({st.device_ids for st in self.stages})

    def _current_stages(self) -> list[tuple]:
        return [(st.layers, st.submesh_shape, st.logical_shape, st.device_ids) for st in self.stages]

    def pin_stages(
        self,
        layers: Any,
        submeshes: Any = None,
        logical_shapes: Any = None,
    ) -> PipelinePlan:
        """A new plan with the stage boundaries fixed: ``layers`` is ``[[first, last], ...]``.

        ``submeshes`` (e.g. ``[(1, 4), (1, 4)]``) default to an even split of the cluster;
        each stage's logical mesh is the cheapest unless ``logical_shapes`` says. Each
        stage is re-planned (cached stages are reused); memory is checked (eq. 5).
        """
        return self._require_problem().pin_stages(self, layers, submeshes, logical_shapes)

    def unpin_stages(self) -> PipelinePlan:
        """A new plan whose stages the DP chooses again (layer costs come from the cache); op pins are kept.

        An interleaved plan is re-planned with 1F1B's stages, then interleaved with as many chunks.
        """
        return self._require_problem().unpin_stages(self)

    def recalibrated(self, profile: Any) -> PipelinePlan:
        """This plan re-solved from scratch with the costs a run measured (``run.profile()``).

        The cluster becomes ``profile.cluster()`` (the fitted compute and communication scales
        and launch and transfer overheads, ``cost.profile``); the stage DP and every stage's ILP
        run again with it, as ``parallelize(step, cluster=profile.cluster(), ...)`` would plan:
        the same layering, ``max_stages`` and cost model (a profiling plan's stage timer).
        Op pins are kept, and the stages too when they were pinned (an interleaved plan's
        chunks as they are); an unpinned interleaved plan is re-planned as 1F1B and
        interleaved again with as many chunks.
        """
        return self._require_problem().recalibrated(self, profile)

    def pin(self, op: str, strategy: str) -> PipelinePlan:
        """A new plan with ``op`` fixed to ``strategy``; only ``op``'s stage is re-solved."""
        self.stage_of(op)  # a clear error for an unknown name
        return self._replan(self._current_stages(), {**dict(self.pins), op: strategy}, self.stage_pins)

    def unpin(self, op: str) -> PipelinePlan:
        pins = dict(self.pins)
        if op not in pins:
            raise PinError(f"{op!r} is not pinned; pinned: {', '.join(pins) or 'nothing'}", (op,))
        del pins[op]
        return self._replan(self._current_stages(), pins, self.stage_pins)

    def diff(self, other: PipelinePlan) -> str:
        """Changes from ``other`` (the older plan) to this one, as ``Plan.diff``: stages, then op strategies."""
        if not isinstance(other, PipelinePlan):
            raise PlanFormatError(
                f"cannot diff a pipeline plan with a {type(other).__name__}: diff two pipeline plans of one step "
                "(plan.diff(older_plan)); a single-mesh plan's diff is Plan.diff"
            )
        lines = []
        if self._current_stages() != other._current_stages():
            for a, b in zip(other.stages, self.stages):
                if (a.layers, a.submesh_shape, a.logical_shape) != (b.layers, b.submesh_shape, b.logical_shape):
                    lines.append(
                        f"stage {a.index}: layers {a.layers[0]}..{a.layers[1] - 1} on {a.submesh_shape} as {a.logical_shape} "
                        f"-> layers {b.layers[0]}..{b.layers[1] - 1} on {b.submesh_shape} as {b.logical_shape}"
                    )
            if len(self.stages) != len(other.stages):
                lines.append(f"{_count(len(other.stages), 'stage')} -> {_count(len(self.stages), 'stage')}")
        else:
            for a, b in zip(other.stages, self.stages):
                d = b.plan.diff(a.plan)
                if d.changes or d.pins_added or d.pins_removed:
                    lines.append(f"stage {a.index}: {d}")
        if self.schedule != other.schedule:
            lines.append(f"schedule {other.schedule} -> {self.schedule}")
        if not lines:
            lines.append("no changes: the same stages, schedule and op strategies")
        lines.append(
            f"predicted step time {other.estimated_step_time * 1e3:.3f} ms -> {self.estimated_step_time * 1e3:.3f} ms "
            f"({_signed_pct(other.estimated_step_time, self.estimated_step_time)})"
        )
        return "\n".join(lines)

    # ----- persistence ---------------------------------------------------------------
    def to_json(self) -> str:
        """Plain JSON: every field (each stage's ``Plan``, the timeline's records) but ``problem``."""
        data: dict[str, Any] = {"plan_type": PIPELINE_PLAN_TYPE, "schema_version": self.schema_version}
        for f in dataclasses.fields(self):
            if f.name in ("problem", "schema_version"):
                continue
            value = getattr(self, f.name)
            if f.name == "stages":
                value = [_stage_to_dict(st) for st in value]
            elif f.name == "timeline":
                value = dataclasses.asdict(value)
            elif isinstance(value, Mapping):
                value = dict(value)
            data[f.name] = value
        return json.dumps(data, indent=1)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_json())

    @classmethod
    def from_json(cls, text: str) -> PipelinePlan:
        """The plan ``to_json`` wrote; its planner state comes back with ``ParallelizedStep.use``."""
        data = _plan_json(text, "pipeline plan")
        if data.get("plan_type") != PIPELINE_PLAN_TYPE:
            if "plan_type" not in data and "ops" in data and "mesh_shape" in data:
                raise PlanFormatError(
                    "this JSON is a single-mesh Plan, not a pipeline plan: load it with alpa_lab.Plan.load "
                    "(or Plan.from_json)"
                )
            raise PlanFormatError(
                f"this JSON is not a pipeline plan (plan_type {data.get('plan_type')!r}, expected {PIPELINE_PLAN_TYPE!r})"
            )
        try:
            return _pipeline_plan_from_dict(data)
        except _MissingField as exc:
            raise PlanFormatError(f"pipeline plan JSON is missing or has malformed fields: no {exc.args[0]!r}") from exc
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise PlanFormatError(f"pipeline plan JSON is missing or has malformed fields: {exc}") from exc

    @classmethod
    def load(cls, path: str | Path) -> PipelinePlan:
        return cls.from_json(_read_plan_file(path))

    def check_program(self, graph: OpGraph) -> None:
        """Raise if this plan was made for another program than ``graph`` (traced at micro-batch size)."""
        if graph.fingerprint != self.fingerprint:
            raise PlanFormatError(
                f"this pipeline plan was made for another program (plan fingerprint {self.fingerprint}, "
                f"traced program {graph.fingerprint}): the function, its argument shapes or dtypes, the number "
                "of micro-batches or the layering (layers=) differ; re-plan with step.plan(...)"
            )

    def _homes(self) -> dict[str, dict[str, list[tuple[int, str]]]]:
        """Per argument path every stage reading it, in stage order, and per result path the stage computing it:
        (stage index, sharding spec) pairs."""
        homes: dict[str, dict[str, list[tuple[int, str]]]] = {"argument": {}, "result": {}}
        for st in self.stages:
            for t in st.plan.inputs:
                homes["argument"].setdefault(t.path, []).append((st.index, t.spec))
            for t in st.plan.outputs:
                if not t.path.startswith("<") and t.path not in homes["result"]:  # not a tensor passed between stages
                    homes["result"][t.path] = [(st.index, t.spec)]
        return homes

    def _leaf_homes(self, tree: Any, side: str, homes: Mapping[str, Mapping[str, list[tuple[int, str]]]]) -> tuple[list, Any]:
        """(each leaf's homes, the tree's structure) for the step's arguments or results (``side``); an argument
        no stage reads has none."""
        flat, treedef = jax.tree_util.tree_flatten_with_path(tree)
        keys = [jax.tree_util.keystr(path) or "[]" for path, _ in flat]
        if side == "argument" and not set(keys) & set(homes[side]):
            raise ValueError(
                "none of the arguments given is one this pipeline plan's stages read: pass the step's arguments "
                f"as it was planned with (the stages read e.g. {', '.join(sorted(homes['argument'])[:3])})"
            )
        missing = [key for key in keys if key not in homes[side]] if side == "result" else []
        if missing:
            raise ValueError(
                f"no stage of this pipeline plan computes a result {missing[0]}: pass the step's results "
                "(or jax.eval_shape(step, *args)) as it was planned with"
            )
        return [homes[side].get(key, []) for key in keys], treedef

    def shardings(self, *args: Any, results: Any = None, devices: Sequence[Any] | None = None) -> tuple[Any, Any]:
        """(argument shardings, result shardings): each leaf's ``NamedSharding`` on the
        sub-mesh of the stage that keeps it, as ``Plan.shardings`` gives them for one mesh.

        An argument goes to the first stage that reads it (the stage whose update owns a
        weight; an argument no stage reads: replicated on the first stage), a result to the
        stage that computes it: where the pipeline runtime keeps the state between steps,
        so it can be placed, saved or restored there without alpa_lab. The result shardings
        take the structure of ``results`` (the step's results, or ``jax.eval_shape(step,
        *args)``); without it they are a dict from result path (``jax.tree_util.keystr``).
        """
        meshes = [st.plan.mesh(devices) for st in self.stages]
        homes = self._homes()
        unread = jax.sharding.NamedSharding(meshes[0], jax.sharding.PartitionSpec())

        def placed(tree: Any, side: str) -> Any:
            found, treedef = self._leaf_homes(tree, side, homes)
            return jax.tree_util.tree_unflatten(treedef, [spec_sharding(meshes[h[0][0]], h[0][1]) if h else unread for h in found])

        ins = placed(args, "argument")
        if results is None:
            return ins, {path: spec_sharding(meshes[h[0][0]], h[0][1]) for path, h in homes["result"].items()}
        return ins, placed(results, "result")

    def placement_specs(self, *args: Any, results: Any = None, devices: Sequence[Any] | None = None) -> tuple[Any, Any]:
        """(argument placements, result placements): ``PlacementSpec`` pytrees, Alpa's view of ``shardings``.

        An argument lists every stage that reads it (the first is where ``shardings`` keeps it), a result the
        stage that computes it; an argument no stage reads is replicated on stage 0. ``results``: the step's
        results (or ``jax.eval_shape(step, *args)``); without it, None. Each mesh is its stage's ``plan.mesh(devices)``."""
        homes = self._homes()
        try:
            meshes: list[Any] | None = [st.plan.mesh(devices) for st in self.stages]
        except DeviceError:  # planned for devices this process does not have (a Ray cluster's)
            meshes = None

        def placed(tree: Any, side: str) -> Any:
            found, treedef = self._leaf_homes(tree, side, homes)
            leaves = jax.tree_util.tree_leaves(tree)
            pairs = [(tuple(i for i, _ in h), tuple(sp for _, sp in h)) if h else ((0,), (str(ShardingSpec.replicated(np.ndim(x))),))
                     for h, x in zip(found, leaves)]
            return placement_tree(leaves, treedef, pairs, meshes)

        return placed(args, "argument"), (None if results is None else placed(results, "result"))

    def attach(self, problem: PipelinePlanProblem) -> PipelinePlan:
        """This plan with ``problem`` (the ``PipelineProblem`` of its program) as its planner state.

        What ``ParallelizedStep.use`` does for a loaded plan, so that it runs and can be edited
        again: each stage's ``Plan`` gets its strategy graph (``problem.stage_graph``, cached
        there), the problem learns the layout each stage was planned with (a DP-chosen
        memory-saving one stays on re-plans) and caches the stage plans, so an edit re-solves
        only the stages it touches, as on the original plan. Raises ``PlanFormatError`` when
        the plan does not fit it (another program, another cluster, stage plans that are not
        that program's), before recording anything in ``problem`` but strategy graphs.
        """
        return problem.attach(self)


# ----- pipeline plan JSON ------------------------------------------------------------------


def _stage_to_dict(st: StageResult) -> dict[str, Any]:
    data = {f.name: getattr(st, f.name) for f in dataclasses.fields(st) if f.name != "plan"}
    plan = dataclasses.asdict(dataclasses.replace(st.plan, problem=None))
    plan.pop("problem")
    data["plan"] = plan
    return data



_RECORD_FIELDS = {
    "stage": _integer, "kind": _text, "phase": _text, "microbatch": _integer,
    "start": _number, "end": _number, "mesh": _optional(_integer),
}


@_with_path
def _timeline(d: Any, where: str) -> Timeline:
    @_with_path
    def records(items: Any, path: str) -> tuple[TimelineRecord, ...]:
        if not isinstance(items, list):
            raise TypeError(f"expected a list, got {items!r}")
        return tuple(_from_dict(TimelineRecord, r, f"{path}[{i}]", _RECORD_FIELDS) for i, r in enumerate(items))

    return _from_dict(
        Timeline, d, where,
        {
            "records": records, "makespan": _number, "bubble_fraction": _number, "transfer_time": _number,
            "transfer_times": _array(_number),
            "peak_in_flight": _array(_integer), "mesh_peak_in_flight": _array(_integer),
            "peak_unfreed": _array(_integer), "mesh_peak_unfreed": _array(_integer),
            "mesh_bubble_fractions": _array(_number),
        },
    )



@_with_path
def _stage_plan(d: Any, where: str) -> Plan:
    if not isinstance(d, dict):
        raise TypeError(f"expected a JSON object, got {type(d).__name__}")
    try:
        return _plan_from_dict(d)
    except KeyError as exc:
        raise _MissingField(f"{where}.{exc.args[0]}") from exc


_STAGE_FIELDS = {
    "index": _integer, "layers": _array(_integer), "submesh_shape": _array(_integer),
    "logical_shape": _array(_integer), "device_ids": _array(_integer), "plan": _stage_plan,
    "forward_time": _number, "backward_time": _number, "apply_time": _number, "weight_memory": _number,
    "activation_memory": _number, "in_flight": _integer, "weight_gradient_time": _number,
}


@_with_path
def _stages(items: Any, where: str) -> tuple[StageResult, ...]:
    if not isinstance(items, list) or not items:
        raise ValueError(f"expected a non-empty list of stages, got {items!r}")
    return tuple(_from_dict(StageResult, s, f"{where}[{i}]", _STAGE_FIELDS) for i, s in enumerate(items))



def _pipeline_plan_from_dict(d: dict) -> PipelinePlan:
    plan = _from_dict(
        PipelinePlan, d, "",
        {
            "fingerprint": _text, "method": _text, "cluster": _cluster, "num_microbatches": _integer,
            "schedule": _text, "num_layers": _integer, "stages": _stages, "timeline": _timeline,
            "split_inputs": _array(_text), "stage_pins": _flag, "planning_seconds": _seconds,
            "schema_version": _integer, "max_stages": _optional(_integer), "submesh_space": _text,
        },
    )
    if plan.schedule not in SCHEDULE_NAMES:
        raise ValueError(f"schedule: unknown pipeline schedule {plan.schedule!r}")
    start = 0
    for i, st in enumerate(plan.stages):
        if st.index != i or len(st.layers) != 2 or st.layers[0] != start or st.layers[1] <= start:
            raise ValueError(f"stages[{i}]: index {st.index} with layers {list(st.layers)} does not follow stage {i - 1}")
        start = st.layers[1]
    if start != plan.num_layers:
        raise ValueError(f"stages: the stages cover layers 0..{start - 1} but the plan has {plan.num_layers}")
    return plan


def _count(n: int, what: str) -> str:
    return f"{n} {what}" if n == 1 else f"{n} {what}s"
