"""A ``Plan``: what the planner decided for one program on one logical mesh, as plain data.

A plan records, for every op and argument, the chosen strategy with its specs and costs;
the reshardings between ops; the mesh; the pins it honours; and a fingerprint of the traced
program it belongs to. It holds no live JAX objects, so it saves to JSON and loads back
anywhere, and it imports no pass. A plan made in this session also keeps the planner's
problem (the strategy graph, ``passes.intra_op.StrategyGraph``) beside it, and its edits
(``pin``, ``unpin``) and ``explain`` ask that problem (``PlanProblem``); a loaded plan gets it
back through ``ParallelizedStep.use``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping, Protocol, Sequence

import jax
import numpy as np

from alpa_lab.cost.cluster import Collective, _fmt_bytes
from alpa_lab.graph.opgraph import OpGraph, did_you_mean
from alpa_lab.plan.schema import (
    PIPELINE_PLAN_TYPE, SCHEMA_VERSION, PlanFormatError, _collectives, _flag, _plan_json, _read_plan_file,
)
from alpa_lab.sharding.constraints import ConstrainedStep, DeviceError, device_mesh, spec_sharding

if TYPE_CHECKING:
    from alpa_lab.plan.pipeline import PipelinePlan


class PinError(ValueError):
    """A pin that names no op, names a strategy the op does not have, or conflicts."""

    def __init__(self, message: str, pins: tuple[str, ...] = ()):
        super().__init__(message)
        self.pins = pins


class PlanProblem(Protocol):
    """What a ``Plan``'s planner state does for it: the passes' ``StrategyGraph`` (``passes.intra_op``).

    The plan stays data; re-solving and pricing alternatives are the passes' work.
    """

    def replan(self, plan: Plan, pins: Mapping[str, str]) -> Plan:
        """``plan`` re-solved with exactly ``pins`` (its method, memory budget and mesh kept)."""
        ...

    def explain(self, plan: Plan, op: str) -> Explanation:
        """Every strategy of ``op`` with its cost, the rest of ``plan`` held fixed."""
        ...


@dataclass(frozen=True)
class TensorPlan:
    """An argument or result of the step: where it lives between steps."""

    path: str
    shape: tuple[int, ...]
    dtype: str
    spec: str


@dataclass(frozen=True)
class PlacementSpec:
    """Where one argument or result of a step lives, as Alpa's executables report it
    (``get_input_placement_specs``): its abstract value, the meshes holding it (a single-mesh plan's one
    mesh is 0; a pipeline's are its stages) and its sharding spec on each of them (``ShardingSpec``'s
    text, e.g. ``"S0R"``)."""

    aval: jax.ShapeDtypeStruct
    mesh_ids: tuple[int, ...]
    sharding_specs: tuple[str, ...]
    shardings: tuple[Any, ...] = field(default=(), repr=False)
    """the ``NamedSharding`` on each mesh (this process's devices for the plan's device ids), so two specs are
    equal only on the same meshes; ``restore_checkpoint`` and ``CreateStateParallel`` put the leaf on the first
    (where the runtime keeps it; a stage reading it from another mesh gets it sent each step)"""


def placement_tree(
    leaves: Sequence[Any], tree: Any, homes: Sequence[tuple[tuple[int, ...], tuple[str, ...]]], meshes: Sequence[Any] | None
) -> Any:
    """The ``PlacementSpec`` pytree of ``leaves`` (arrays or ShapeDtypeStructs, in ``tree``'s order) with their
    (mesh ids, specs) ``homes``; ``meshes[i]`` is mesh i's ``jax.sharding.Mesh`` (None: this process lacks the
    plan's devices, e.g. a Ray cluster's driver: no shardings)."""
    specs = [
        PlacementSpec(jax.ShapeDtypeStruct(np.shape(x), jax.numpy.result_type(x)), tuple(ids), tuple(sp),
                      () if meshes is None else tuple(spec_sharding(meshes[i], one) for i, one in zip(ids, sp)))
        for x, (ids, sp) in zip(leaves, homes)
    ]
    return jax.tree_util.tree_unflatten(tree, specs)


@dataclass(frozen=True)
class OpPlan:
    """The strategy chosen for one op (or one argument, ``kind == "input"``)."""

    name: str
    kind: str
    primitive: str
    label: str
    strategy: str
    input_specs: tuple[str, ...]
    output_specs: tuple[str, ...]
    compute_cost: float
    communication_cost: float
    memory_cost: float
    collectives: tuple[Collective, ...]
    merged_into: str
    num_strategies: int


@dataclass(frozen=True)
class ReshardingPlan:
    """A tensor that changes spec between its producer and a consumer."""

    producer: str
    consumer: str
    shape: tuple[int, ...]
    dtype: str
    src: str
    dst: str
    collectives: tuple[Collective, ...]

    @property
    def cost(self) -> float:
        return sum(c.cost for c in self.collectives)


@dataclass(frozen=True)
class OpChange:
    name: str
    before: str
    after: str


@dataclass(frozen=True)
class PlanDiff:
    """What changed between two plans of the same program, and what it did to the cost."""

    changes: tuple[OpChange, ...]
    time_before: float
    time_after: float
    memory_before: float
    memory_after: float
    pins_added: tuple[str, ...]
    pins_removed: tuple[str, ...]

    def __str__(self) -> str:
        lines = [
            f"predicted step time {self.time_before * 1e3:.3f} ms -> {self.time_after * 1e3:.3f} ms "
            f"({_signed_pct(self.time_before, self.time_after)}), memory/device "
            f"{_fmt_bytes(self.memory_before)} -> {_fmt_bytes(self.memory_after)}",
        ]
        if self.pins_added:
            lines.append("pinned: " + ", ".join(self.pins_added))
        if self.pins_removed:
            lines.append("unpinned: " + ", ".join(self.pins_removed))
        lines.append(f"{len(self.changes)} ops changed strategy" + (":" if self.changes else ""))
        lines += [f"  {c.name}: {c.before} -> {c.after}" for c in self.changes]
        return "\n".join(lines)


@dataclass(frozen=True)
class Alternative:
    strategy: str
    own_cost: float
    resharding_cost: float
    chosen: bool

    @property
    def total(self) -> float:
        return self.own_cost + self.resharding_cost


@dataclass(frozen=True)
class Explanation:
    """Why an op got its strategy: every alternative's cost with its neighbours held fixed."""

    op: OpPlan
    alternatives: tuple[Alternative, ...]
    merged_into: str

    def __str__(self) -> str:
        what = ", ".join(x for x in (self.op.primitive or self.op.kind, self.op.label) if x)
        lines = [f"{self.op.name} ({what}): chose {self.op.strategy!r}"]
        if self.merged_into != self.op.name:
            lines.append(f"  merged into {self.merged_into!r}: it follows that op's layout (Alpa sec. 4.2)")
        lines.append("  strategy                              own cost    resharding  total")
        for a in sorted(self.alternatives, key=lambda a: a.total):
            mark = "*" if a.chosen else " "
            lines.append(f"{mark} {a.strategy:<36} {_us(a.own_cost)} {_us(a.resharding_cost)} {_us(a.total)}")
        lines.append("  (costs with every other op's strategy held as planned; * = chosen)")
        if any(not math.isfinite(a.total) for a in self.alternatives):
            lines.append("  (forbidden: it needs a collective the plan's AutoShardingOption forbids)")
        return "\n".join(lines)


def _us(seconds: float) -> str:
    """A cost column: microseconds, or 'forbidden' for a strategy a forbidden collective prices infinitely."""
    return f"{seconds * 1e6:9.2f}us" if math.isfinite(seconds) else f"{'forbidden':>11}"


@dataclass(frozen=True)
class CollectiveComparison:
    """Collectives the plan predicts next to those in XLA's compiled HLO, by kind."""

    predicted: Mapping[str, int]
    compiled: Mapping[str, int]

    def __str__(self) -> str:
        kinds = sorted(set(self.predicted) | set(self.compiled))
        rows = [f"  {k:<20} predicted {self.predicted.get(k, 0):4d}   compiled {self.compiled.get(k, 0):4d}" for k in kinds]
        return "collectives (XLA may combine several into one, or lower one kind as another):\n" + "\n".join(rows)



@dataclass(frozen=True)
class Plan:
    """The planner's decisions for one traced program on one logical mesh."""

    fingerprint: str
    method: str
    cluster: Mapping[str, Any]
    mesh_shape: tuple[int, int]
    device_ids: tuple[int, ...]
    ops: tuple[OpPlan, ...]
    inputs: tuple[TensorPlan, ...]
    outputs: tuple[TensorPlan, ...]
    reshardings: tuple[ReshardingPlan, ...]
    pins: tuple[tuple[str, str], ...]
    objective: float
    memory_budget: float | None = None
    solver: Mapping[str, Any] = field(default_factory=dict, compare=False)
    """the ILP's status and wall-clock seconds: not part of a plan's identity (two solves of one problem are equal)."""
    mesh_candidates: tuple[tuple[tuple[int, int], float], ...] = ()
    unplanned_primitives: tuple[str, ...] = ()
    rewrites: tuple[str, ...] = ()
    batch_inputs: tuple[str, ...] | None = None
    """the input paths the data-parallel methods split, where the user named the batch (``batch_argnums``):
    saved, so that a re-solve of the loaded plan splits the same ones; None: the data leaves leading with the
    batch size"""
    batch_mesh_axis: int | None = None
    """Alpa's ``force_batch_dim_to_mesh_dim``: the mesh axis every batch tensor was kept split over (saved, so a
    re-solve of the loaded plan keeps it); None: the ILP chose"""
    weight_update_sharding: bool = True
    """whether the plan's method may split the weight update (the paper's post-ILP rewrite; Alpa's ``ShardParallel``
    asks for it with ``prefer_reduce_scatter``): saved, so a re-solve of the loaded plan does as it did"""
    forbidden_collectives: tuple[str, ...] = ()
    """collective kinds the plan was made without (Alpa's ``allow_all_gather=False`` / ``allow_all_to_all=False``):
    saved, so a re-solve of the loaded plan forbids them too"""
    schema_version: int = SCHEMA_VERSION
    problem: PlanProblem | None = field(default=None, compare=False, repr=False)
    """the planner state (``passes.intra_op.StrategyGraph``) edits ask: not saved; ``ParallelizedStep.use`` re-attaches it."""

    # ----- figures -------------------------------------------------------------------
    @property
    def estimated_step_time(self) -> float:
        """Predicted seconds per step: compute + communication + resharding (the ILP objective)."""
        return self.objective

    @property
    def memory_per_device(self) -> float:
        """Bytes per device of every tensor the plan keeps (an upper bound: no liveness)."""
        return sum(o.memory_cost for o in self.ops)

    @property
    def compute_cost(self) -> float:
        return sum(o.compute_cost for o in self.ops)

    @property
    def communication_cost(self) -> float:
        """Predicted seconds of collectives, reshardings included as the ILP charges them:
        once per consuming op (XLA shares one resharding between consumers that want the
        same spec, which is why ``reshardings`` lists each once)."""
        return self.objective - self.compute_cost

    def op(self, name: str) -> OpPlan:
        for o in self.ops:
            if o.name == name:
                return o
        raise KeyError(f"no op named {name!r} in this plan{did_you_mean(name, [o.name for o in self.ops])}")

    def predicted_collectives(self) -> Counter:
        """Collective kinds and counts the plan issues per step."""
        count: Counter = Counter()
        for o in self.ops:
            count.update(c.kind for c in o.collectives)
        for r in self.reshardings:
            count.update(c.kind for c in r.collectives)
        return count

    def compare_collectives(self, hlo_text: str) -> CollectiveComparison:
        return CollectiveComparison(dict(self.predicted_collectives()), count_hlo_collectives(hlo_text))

    def summary(self, max_rows: int = 40) -> str:
        lines = [
            f"Plan ({self.method}) for program {self.fingerprint} on {self.cluster.get('name', '?')}, "
            f"logical mesh {self.mesh_shape[0]}x{self.mesh_shape[1]}",
            f"  predicted step time {self.estimated_step_time * 1e3:.3f} ms "
            f"(compute {self.compute_cost * 1e3:.3f} ms, communication {self.communication_cost * 1e3:.3f} ms); "
            f"memory/device {_fmt_bytes(self.memory_per_device)}",
            "  collectives per step: "
            + (", ".join(f"{k} x{v}" for k, v in sorted(self.predicted_collectives().items())) or "none"),
        ]
        if self.solver.get("status", "optimal") != "optimal":
            lines.append("  solver stopped at its time limit: the plan is feasible, optimality not proven")
        if self.method == "megatron" and self.mesh_shape[1] == 1:
            lines.append(
                "  tensor-parallel degree 1 (mesh axis 1 has one device): this Megatron plan is data parallelism; "
                "pass mesh_shape= to compare a wider tensor-parallel axis"
            )
        if self.mesh_candidates:
            lines.append(
                "  mesh shapes tried: "
                + ", ".join(f"{a}x{b}: {t * 1e3:.3f} ms" for (a, b), t in self.mesh_candidates)
            )
        if self.pins:
            lines.append("  pins: " + ", ".join(f"{k}={v!r}" for k, v in self.pins))
        if self.unplanned_primitives:
            lines.append("  no sharding rule (planned replicated): " + ", ".join(self.unplanned_primitives))
        if self.rewrites:
            more = " ..." if len(self.rewrites) > 3 else ""
            lines.append(f"  post-ILP rewrites: {len(self.rewrites)} (" + "; ".join(self.rewrites[:3]) + more + ")")
        heavy = [o for o in self.ops if o.kind == "op" and (o.collectives or o.primitive in ("dot_general", "conv_general_dilated"))]
        lines.append(f"  {'op':<22} {'strategy':<30} {'comm':>10}  collectives")
        for o in heavy[:max_rows]:
            colls = ", ".join(map(str, o.collectives)) or "-"
            lines.append(f"  {o.name:<22} {o.strategy:<30} {o.communication_cost * 1e6:8.1f}us  {colls}")
        if len(heavy) > max_rows:
            lines.append(f"  ... {len(heavy) - max_rows} more contraction/communicating ops")
        inputs = [i for i in self.inputs if i.spec.strip("R-")]
        lines.append(f"  arguments sharded: {len(inputs)} of {len(self.inputs)}")
        if self.reshardings:
            lines.append(f"  reshardings: {len(self.reshardings)} ({sum(r.cost for r in self.reshardings) * 1e6:.1f}us)")
        return "\n".join(lines)

    # ----- editing -------------------------------------------------------------------
    def _require_problem(self) -> PlanProblem:
        if self.problem is None:
            raise PlanFormatError(
                "this plan was loaded from JSON and has no planner state attached; "
                "call step.use(plan) with the ParallelizedStep it belongs to, then edit step.current_plan"
            )
        return self.problem

    def pin(self, op: str | None = None, strategy: str | None = None, *, pins: Mapping[str, str] | None = None) -> Plan:
        """A new plan with ``op`` fixed to ``strategy`` (and the other pins kept), re-solved.

        On failure (unknown op, unknown strategy, conflicting pins) this plan is untouched
        and a ``PinError`` says what to change.
        """
        new = dict(self.pins)
        if op is not None:
            if strategy is None:
                raise PinError("pin(op, strategy) needs a strategy name; see plan.explain(op) for the choices", (op,))
            new[op] = strategy
        new.update(pins or {})
        return self._require_problem().replan(self, new)

    def unpin(self, op: str) -> Plan:
        pins = dict(self.pins)
        if op not in pins:
            raise PinError(f"{op!r} is not pinned; pinned: {', '.join(pins) or 'nothing'}", (op,))
        del pins[op]
        return self._require_problem().replan(self, pins)

    def diff(self, other: Plan) -> PlanDiff:
        """Changes from ``other`` (the older plan) to this one."""
        if not isinstance(other, Plan):
            raise PlanFormatError(
                f"cannot diff a single-mesh plan with a {type(other).__name__}: diff two plans of one step (plan.diff(older_plan))"
            )
        if other.fingerprint != self.fingerprint:
            raise PlanFormatError(
                f"cannot diff plans of different programs ({other.fingerprint} vs {self.fingerprint})"
            )
        before = {o.name: o.strategy for o in other.ops}
        changes = tuple(
            OpChange(o.name, before.get(o.name, "?"), o.strategy) for o in self.ops if before.get(o.name) != o.strategy
        )
        old_pins, new_pins = dict(other.pins), dict(self.pins)
        return PlanDiff(
            changes=changes,
            time_before=other.estimated_step_time,
            time_after=self.estimated_step_time,
            memory_before=other.memory_per_device,
            memory_after=self.memory_per_device,
            pins_added=tuple(f"{k}={v!r}" for k, v in new_pins.items() if old_pins.get(k) != v),
            pins_removed=tuple(k for k in old_pins if k not in new_pins),
        )

    def explain(self, op: str) -> Explanation:
        """Every strategy of ``op`` with its cost, the rest of the plan held fixed."""
        return self._require_problem().explain(self, op)

    # ----- persistence ---------------------------------------------------------------
    def to_json(self) -> str:
        data = dataclasses.asdict(dataclasses.replace(self, problem=None))
        data.pop("problem")
        return json.dumps(data, indent=1)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_json())

    @classmethod
    def from_json(cls, text: str) -> Plan | PipelinePlan:
        """The plan ``to_json`` wrote. Any saved plan loads here: a pipeline plan's JSON gives the
        ``PipelinePlan`` it was (``PipelinePlan.from_json`` takes only those)."""
        data = _plan_json(text, "plan")
        if data.get("plan_type") == PIPELINE_PLAN_TYPE:
            from alpa_lab.plan.pipeline import PipelinePlan

            return PipelinePlan.from_json(text)
        try:
            return _plan_from_dict(data)
        except (KeyError, TypeError, ValueError) as exc:
            raise PlanFormatError(f"plan JSON is missing or has malformed fields: {exc!r}") from exc

    @classmethod
    def load(cls, path: str | Path) -> Plan | PipelinePlan:
        """A saved plan: a ``Plan``, or the ``PipelinePlan`` a pipeline plan's file holds."""
        return cls.from_json(_read_plan_file(path))

    def check_program(self, graph: OpGraph) -> None:
        """Raise if this plan was made for another program than ``graph``."""
        if graph.fingerprint != self.fingerprint:
            raise PlanFormatError(
                f"this plan belongs to another program (plan fingerprint {self.fingerprint}, "
                f"traced program {graph.fingerprint}): the function, its argument shapes or its "
                "dtypes differ; re-plan with step.plan(...)"
            )

    # ----- export to plain JAX -------------------------------------------------------
    def mesh(self, devices: Sequence[Any] | None = None) -> Any:
        """The plan's logical mesh: a ``jax.sharding.Mesh`` (axes ``"x"``, ``"y"``) of
        ``devices[i]`` for the plan's ``device_ids`` (``devices`` default: ``jax.devices()``)."""
        return device_mesh(self.mesh_shape, self.device_ids, devices)

    def shardings(self, *args: Any, results: Any = None, devices: Sequence[Any] | None = None) -> tuple[Any, Any]:
        """(argument shardings, result shardings): ``NamedSharding`` pytrees for ``jax.jit``.

        So a plan can be used without alpa_lab: ``jax.jit(step, in_shardings=..., out_shardings=...)``
        keeps the state where the plan keeps it between steps (the ops inside are left to
        XLA; ``Plan.jit`` applies the plan's per-op shardings too). ``args`` are the step's
        arguments (arrays or ``jax.ShapeDtypeStruct``s), whose structure the argument
        shardings take. The result shardings take the structure of ``results`` (the
        step's results, or ``jax.eval_shape(step, *args)``); without it they are a tuple,
        one per result leaf in order. On ``self.mesh(devices)``.
        """
        mesh = self.mesh(devices)
        leaves, in_tree = jax.tree_util.tree_flatten(args)
        _check_leaves(leaves, self.inputs, "argument")
        ins = jax.tree_util.tree_unflatten(in_tree, [spec_sharding(mesh, t.spec) for t in self.inputs])
        outs = tuple(spec_sharding(mesh, t.spec) for t in self.outputs)
        if results is not None:
            leaves, out_tree = jax.tree_util.tree_flatten(results)
            _check_leaves(leaves, self.outputs, "result")
            outs = jax.tree_util.tree_unflatten(out_tree, outs)
        return ins, outs

    def placement_specs(self, *args: Any, results: Any = None, devices: Sequence[Any] | None = None) -> tuple[Any, Any]:
        """(argument placements, result placements): ``PlacementSpec`` pytrees, Alpa's view of ``shardings``
        (on ``self.mesh(devices)``). ``results``: the step's results (or ``jax.eval_shape(step, *args)``);
        without it, None."""
        try:
            meshes: list[Any] | None = [self.mesh(devices)]
        except DeviceError:  # planned for devices this process does not have (a Ray cluster's)
            meshes = None
        leaves, in_tree = jax.tree_util.tree_flatten(args)
        _check_leaves(leaves, self.inputs, "argument")
        ins = placement_tree(leaves, in_tree, [((0,), (t.spec,)) for t in self.inputs], meshes)
        if results is None:
            return ins, None
        leaves, out_tree = jax.tree_util.tree_flatten(results)
        _check_leaves(leaves, self.outputs, "result")
        return ins, placement_tree(leaves, out_tree, [((0,), (t.spec,)) for t in self.outputs], meshes)

    def jit(self, fn: Callable[..., Any], devices: Sequence[Any] | None = None) -> ConstrainedStep:
        """``fn`` run with plain ``jax.jit`` under this plan, without alpa_lab's runtime.

        The returned step traces ``fn`` on its first call with given shapes (it must be the
        program this plan was made for) and jits it with the plan's argument and result
        shardings and a ``with_sharding_constraint`` on every op, on ``self.mesh(devices)``:
        the same program the runtime runs. It also has ``lower(*args)`` (for the HLO) and
        ``shardings(*args)`` (both pytrees, from the trace).
        """
        return ConstrainedStep(
            fn=fn,
            fingerprint=self.fingerprint,
            op_specs={o.name: o for o in self.ops if o.kind == "op"},
            in_specs=tuple(t.spec for t in self.inputs),
            out_specs=tuple(t.spec for t in self.outputs),
            mesh=self.mesh(devices),
            batch_inputs=self.batch_inputs,
        )



def _check_leaves(leaves: Sequence[Any], tensors: Sequence[TensorPlan], what: str) -> None:
    """Raise unless ``leaves`` are the plan's arguments/results (``what``): their count and shapes."""
    if len(leaves) != len(tensors):
        raise ValueError(
            f"the plan's step has {len(tensors)} {what} arrays but {len(leaves)} were given: pass the step's "
            f"{what}s as it was planned with (the plan lists {', '.join(t.path for t in tensors[:3])}"
            + (", ..." if len(tensors) > 3 else "") + ")"
        )
    for x, t in zip(leaves, tensors):
        shape = tuple(getattr(x, "shape", ()))
        if shape != tuple(t.shape):
            raise ValueError(
                f"{what} {t.path} has shape {list(shape)} but the plan was made for {list(t.shape)}: "
                "pass arrays of the planned shapes, or re-plan with these"
            )



def _plan_from_dict(d: dict) -> Plan:
    ops = tuple(
        OpPlan(
            **{
                **o,
                "input_specs": tuple(o["input_specs"]),
                "output_specs": tuple(o["output_specs"]),
                "collectives": _collectives(o["collectives"]),
            }
        )
        for o in d["ops"]
    )

    def tensors(items: list) -> tuple[TensorPlan, ...]:
        return tuple(TensorPlan(t["path"], tuple(t["shape"]), t["dtype"], t["spec"]) for t in items)

    reshardings = tuple(
        ReshardingPlan(
            r["producer"], r["consumer"], tuple(r["shape"]), r["dtype"], r["src"], r["dst"], _collectives(r["collectives"])
        )
        for r in d["reshardings"]
    )
    return Plan(
        fingerprint=str(d["fingerprint"]),
        method=str(d["method"]),
        cluster=dict(d["cluster"]),
        mesh_shape=tuple(d["mesh_shape"]),
        device_ids=tuple(d["device_ids"]),
        ops=ops,
        inputs=tensors(d["inputs"]),
        outputs=tensors(d["outputs"]),
        reshardings=reshardings,
        pins=tuple((str(k), str(v)) for k, v in d["pins"]),
        objective=float(d["objective"]),
        memory_budget=d.get("memory_budget"),
        solver=dict(d.get("solver", {})),
        mesh_candidates=tuple((tuple(s), float(t)) for s, t in d.get("mesh_candidates", [])),
        unplanned_primitives=tuple(d.get("unplanned_primitives", [])),
        rewrites=tuple(d.get("rewrites", [])),
        batch_inputs=None if d.get("batch_inputs") is None else tuple(str(p) for p in d["batch_inputs"]),
        batch_mesh_axis=None if d.get("batch_mesh_axis") is None else _mesh_axis(d["batch_mesh_axis"]),
        weight_update_sharding=_flag(d.get("weight_update_sharding", True)),
        forbidden_collectives=_forbidden(d.get("forbidden_collectives", [])),
    )


def _forbidden(v: Any) -> tuple[str, ...]:
    from alpa_lab.cost.cluster import COLLECTIVE_KINDS

    if not isinstance(v, (list, tuple)) or not set(v) <= set(COLLECTIVE_KINDS):
        raise ValueError(f"forbidden_collectives must list collective kinds ({', '.join(COLLECTIVE_KINDS)}), got {v!r}")
    return tuple(str(k) for k in v)


def _mesh_axis(v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v not in (0, 1):
        raise ValueError(f"batch_mesh_axis must be 0 or 1, got {v!r}")
    return v



_HLO_COLLECTIVE = re.compile(r"\b(all-reduce|all-gather|reduce-scatter|all-to-all|collective-permute)(-start)?\(")


def count_hlo_collectives(hlo_text: str) -> dict[str, int]:
    """Collectives in optimised HLO text, by kind, counted per operand.

    XLA's combiners merge independent collectives of one kind into one instruction with
    several operands (one tuple all-reduce for all gradients); counting operands undoes
    that, so the figure is comparable with the plan's. ``-done`` halves of async pairs are
    not matched.
    """
    count: Counter = Counter()
    for m in _HLO_COLLECTIVE.finditer(hlo_text):
        depth, operands, i = 1, 1, m.end()
        while i < len(hlo_text) and depth:
            ch = hlo_text[i]
            if ch in "([{":
                depth += 1
            elif ch in ")]}":
                depth -= 1
            elif ch == "," and depth == 1:
                operands += 1
            i += 1
        count[m.group(1)] += operands
    return dict(count)


_HLO_INSTRUCTION = re.compile(r"=\s*(.*?)\s*\b(all-reduce|all-gather|reduce-scatter|all-to-all|collective-permute)(?:-start)?\(")
_INDEX_COMMENT = re.compile(r"/\*index=\d+\*/")  # XLA numbers long tuples' elements: (f32[], ..., /*index=5*/f32[])
_SCALARS = re.compile(r"\(?\s*(?:\w+\[\](?:\{\})?\s*,?\s*)+\)?")


def count_communication_primitives(hlo_text: str | Sequence[str], ignore_scalar_all_reduce: bool = False) -> tuple[int, int, int, int, int]:
    """Alpa's ``count_communication_primitives``: collective instructions in optimised HLO, as
    (total, all-reduce, all-gather, reduce-scatter, all-to-all); total also counts collective-permutes (Alpa's
    counts every instruction with a channel id, send and recv too, which a single mesh's program does not have).

    Instructions, not operands (``count_hlo_collectives`` counts operands): a combined all-reduce of
    every gradient is one. An async pair counts once (its ``-start``). A pipeline's texts (a list,
    ``Executable.get_hlo_text()``) are summed. ``ignore_scalar_all_reduce`` leaves out all-reduces of
    scalars (a loss or a norm summed over the devices).
    """
    texts = [hlo_text] if isinstance(hlo_text, str) else list(hlo_text)
    count: Counter = Counter()
    for text in texts:
        for line in text.splitlines():
            m = _HLO_INSTRUCTION.search(line)
            if m is None:
                continue
            if ignore_scalar_all_reduce and m.group(2) == "all-reduce" and _SCALARS.fullmatch(_INDEX_COMMENT.sub("", m.group(1))):
                continue
            count[m.group(2)] += 1
    kinds = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all")
    return (sum(count.values()), *(count[k] for k in kinds))


def _signed_pct(before: float, after: float) -> str:
    if before == 0:
        return "n/a"
    return f"{(after - before) / before * 100:+.1f}%"
