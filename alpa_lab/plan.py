"""A ``Plan``: what the planner decided, as plain data.

A plan records, for every op and argument, the chosen strategy with its specs and costs;
the reshardings between ops; the mesh; the pins it honours; and a fingerprint of the traced
program it belongs to. It holds no live JAX objects, so it saves to JSON and loads back
anywhere. A plan made in this session also keeps the planner's problem (the strategy
graph) beside it, which is what lets ``pin`` re-solve in place; a loaded plan gets it back
through ``ParallelizedStep.use``.
"""

from __future__ import annotations

import dataclasses
import json
import re
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import jax

from alpa_lab.cost.cluster import Collective, _fmt_bytes
from alpa_lab.graph.opgraph import OpGraph, did_you_mean
from alpa_lab.passes.inter_op import pipeline_latency
from alpa_lab.passes.intra_op import PinError, StrategyGraph
from alpa_lab.passes.methods import MethodSolution, solve_method
from alpa_lab.passes.schedule import SCHEDULES, Timeline, TimelineRecord
from alpa_lab.sharding.constraints import ConstrainedStep, device_mesh, spec_sharding
from alpa_lab.sharding.resharding import resharding

SCHEMA_VERSION = 1
PIPELINE_PLAN_TYPE = "pipeline"
"""``plan_type`` of a ``PipelinePlan``'s JSON (a single-mesh ``Plan``'s JSON has none)."""


class PlanFormatError(ValueError):
    """Plan JSON that is corrupt, of another schema version, or for another program."""


@dataclass(frozen=True)
class TensorPlan:
    """An argument or result of the step: where it lives between steps."""

    path: str
    shape: tuple[int, ...]
    dtype: str
    spec: str


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
            lines.append(
                f"{mark} {a.strategy:<36} {a.own_cost * 1e6:9.2f}us {a.resharding_cost * 1e6:9.2f}us {a.total * 1e6:9.2f}us"
            )
        lines.append("  (costs with every other op's strategy held as planned; * = chosen)")
        return "\n".join(lines)


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
    schema_version: int = SCHEMA_VERSION
    problem: StrategyGraph | None = field(default=None, compare=False, repr=False)

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
    def _require_problem(self) -> StrategyGraph:
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
        return self._resolve(new)

    def unpin(self, op: str) -> Plan:
        pins = dict(self.pins)
        if op not in pins:
            raise PinError(f"{op!r} is not pinned; pinned: {', '.join(pins) or 'nothing'}", (op,))
        del pins[op]
        return self._resolve(pins)

    def _resolve(self, pins: Mapping[str, str]) -> Plan:
        sg = self._require_problem()
        solved = solve_method(sg, self.method, pins, memory_budget=self.memory_budget)
        return make_plan(
            sg,
            solved,
            method=self.method,
            cluster=self.cluster,
            pins=pins,
            memory_budget=self.memory_budget,
            mesh_candidates=self.mesh_candidates,
        )

    def diff(self, other: Plan) -> PlanDiff:
        """Changes from ``other`` (the older plan) to this one."""
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
        sg = self._require_problem()
        n = sg.node_index(op)
        node = sg.nodes[n]
        chosen = {o.name: o.strategy for o in self.ops}
        choice = {i: sg.nodes[i].strategy_index(chosen[nd.name]) for i, nd in enumerate(sg.nodes)}
        alts = []
        for j, s in enumerate(node.strategies):
            reshard = 0.0
            for e in sg.edges:
                if e.consumer == n:
                    src = sg.nodes[e.producer].strategies[choice[e.producer]].output_specs[e.output]
                    dst = s.input_specs[e.operand]
                elif e.producer == n:
                    src = s.output_specs[e.output]
                    if e.consumer >= 0:
                        dst = sg.nodes[e.consumer].strategies[choice[e.consumer]].input_specs[e.operand]
                    else:
                        dst = sg.nodes[e.operand].strategies[choice[e.operand]].output_specs[0]
                elif e.consumer < 0 and e.operand == n:
                    src = sg.nodes[e.producer].strategies[choice[e.producer]].output_specs[e.output]
                    dst = s.output_specs[0]
                else:
                    continue
                shape, itemsize = sg.var_info[e.var]
                reshard += resharding(src, dst, shape, itemsize, sg.mesh).cost
            alts.append(Alternative(s.name, s.cost, reshard, j == choice[n]))
        leader = sg.nodes[int(sg.group_of_node[n])].name
        return Explanation(self.op(op), tuple(alts), leader)

    # ----- persistence ---------------------------------------------------------------
    def to_json(self) -> str:
        data = dataclasses.asdict(dataclasses.replace(self, problem=None))
        data.pop("problem")
        return json.dumps(data, indent=1)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_json())

    @classmethod
    def from_json(cls, text: str) -> Plan:
        data = _plan_json(text, "plan")
        if data.get("plan_type") == PIPELINE_PLAN_TYPE:
            raise PlanFormatError(
                "this JSON is a pipeline plan (stages on sub-meshes), not a single-mesh Plan: "
                "load it with alpa_lab.PipelinePlan.load (or PipelinePlan.from_json)"
            )
        try:
            return _plan_from_dict(data)
        except (KeyError, TypeError, ValueError) as exc:
            raise PlanFormatError(f"plan JSON is missing or has malformed fields: {exc!r}") from exc

    @classmethod
    def load(cls, path: str | Path) -> Plan:
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


def _read_plan_file(path: str | Path) -> str:
    try:
        return Path(path).read_text()
    except OSError as exc:
        raise PlanFormatError(f"cannot read plan file {str(path)!r}: {exc.strerror}") from exc


def _plan_json(text: str, what: str) -> dict:
    """Plan JSON as a dict of this schema version; ``what`` ("plan", "pipeline plan") names it in errors."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise PlanFormatError(f"{what} file is not valid JSON ({exc}); was it truncated or edited by hand?") from exc
    if not isinstance(data, dict) or "schema_version" not in data:
        raise PlanFormatError("this JSON is not an alpa_lab plan (no 'schema_version' field)")
    if data["schema_version"] != SCHEMA_VERSION:
        raise PlanFormatError(
            f"{what} schema version {data['schema_version']} is not supported by this alpa_lab "
            f"(expects {SCHEMA_VERSION}); re-plan the step to get a current plan"
        )
    return data


def _collectives(items: list) -> tuple[Collective, ...]:
    return tuple(Collective(c["kind"], tuple(c["axes"]), float(c["nbytes"]), float(c["cost"])) for c in items)


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
    )


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


def _signed_pct(before: float, after: float) -> str:
    if before == 0:
        return "n/a"
    return f"{(after - before) / before * 100:+.1f}%"


def make_plan(
    sg: StrategyGraph,
    solved: MethodSolution,
    *,
    method: str,
    cluster: Mapping[str, Any],
    pins: Mapping[str, str],
    memory_budget: float | None,
    mesh_candidates: tuple = (),
) -> Plan:
    """Turn a solved strategy graph into a Plan (pure data plus the problem for re-solving)."""
    solution = solved.solution
    choice = solution.choice
    in_paths, out_paths = sg.in_paths, sg.out_paths
    ops = []
    for i, node in enumerate(sg.nodes):
        s = node.strategies[choice[i]]
        ops.append(
            OpPlan(
                name=node.name,
                kind=node.kind,
                primitive=node.primitive,
                label=node.label,
                strategy=s.name,
                input_specs=tuple(map(str, s.input_specs)),
                output_specs=tuple(map(str, s.output_specs)),
                compute_cost=s.compute_cost,
                communication_cost=s.communication_cost,
                memory_cost=s.memory_cost,
                collectives=s.collectives,
                merged_into=sg.nodes[int(sg.group_of_node[i])].name,
                num_strategies=len(node.strategies),
            )
        )
    reshardings = []
    seen = set()
    for e in sg.edges:
        src = sg.nodes[e.producer].strategies[choice[e.producer]].output_specs[e.output]
        if e.consumer >= 0:
            dst = sg.nodes[e.consumer].strategies[choice[e.consumer]].input_specs[e.operand]
            consumer = sg.nodes[e.consumer].name
        else:
            dst = sg.nodes[e.operand].strategies[choice[e.operand]].output_specs[0]
            consumer = f"output {out_paths[-1 - e.consumer]}"
        if src == dst or (e.var, dst) in seen:
            continue  # XLA reshards a tensor once per target spec, however many consumers
        seen.add((e.var, dst))
        shape, itemsize = sg.var_info[e.var]
        r = resharding(src, dst, shape, itemsize, sg.mesh)
        if r.collectives:
            reshardings.append(
                ReshardingPlan(sg.nodes[e.producer].name, consumer, shape, sg.var_dtype[e.var], str(src), str(dst), r.collectives)
            )
    spec_of_var = {}
    for vid, (n, out) in sg.node_of_var.items():
        spec_of_var[vid] = str(sg.nodes[n].strategies[choice[n]].output_specs[out])
    inputs = tuple(
        TensorPlan(path, sg.var_info[v][0], sg.var_dtype[v], spec_of_var.get(v, "R" * len(sg.var_info[v][0]) or "-"))
        for path, v in zip(in_paths, sg.invars)
    )
    outputs = []
    for pos, (path, v) in enumerate(zip(out_paths, sg.outvars)):
        shape = sg.var_info[v][0]
        if pos in sg.aliases and sg.aliases[pos] in spec_of_var:
            spec = spec_of_var[sg.aliases[pos]]
        else:
            spec = spec_of_var.get(v, "R" * len(shape) or "-")
        outputs.append(TensorPlan(path, shape, sg.var_dtype[v], spec))
    ilp = solution.ilp
    return Plan(
        fingerprint=sg.fingerprint,
        method=method,
        cluster=dict(cluster),
        mesh_shape=tuple(sg.mesh.shape),
        device_ids=tuple(sg.mesh.device_ids),
        ops=tuple(ops),
        inputs=inputs,
        outputs=tuple(outputs),
        reshardings=tuple(reshardings),
        pins=tuple(pins.items()),
        objective=solution.objective,
        memory_budget=memory_budget,
        solver={
            "variables": ilp.num_variables,
            "constraints": ilp.num_constraints,
            "build_seconds": ilp.build_seconds + sg.build_seconds,
            "solve_seconds": ilp.solve_seconds,
            "reduced_nodes": ilp.reduced_nodes,
            "ilp_nodes": len(sg.cost_graph.node_costs),
            "ops": sum(1 for n in sg.nodes if n.kind == "op"),
            "status": ilp.status,
            "tie_period": sg.tie_period,
        },
        mesh_candidates=tuple(mesh_candidates),
        unplanned_primitives=sg.unplanned_primitives,
        rewrites=solved.rewrites,
        problem=sg,
    )


# ---------------------------------------------------------------------------------------
# The two-level plan: pipeline stages, each with its own intra-op Plan
# ---------------------------------------------------------------------------------------


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
    timeline: Any
    split_inputs: tuple[str, ...]
    """argument paths cut into micro-batches along axis 0 (the batch)."""
    stage_pins: bool = False
    planning_seconds: Mapping[str, float] = field(default_factory=dict)
    schema_version: int = SCHEMA_VERSION
    problem: Any = field(default=None, compare=False, repr=False)
    """the planner state (``passes.pipeline.PipelineProblem``): not saved; ``ParallelizedStep.use`` re-attaches it."""
    max_stages: int | None = None
    """the stage DP's bound this plan was solved with (``parallelize(max_stages=)``): saved, so that a
    re-solve (``unpin_stages``, ``recalibrated``) searches the same space."""

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    @property
    def estimated_step_time(self) -> float:
        """Predicted seconds per step: the schedule's makespan, then the slowest stage's update."""
        return self.timeline.makespan + max(st.apply_time for st in self.stages)

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
    def _require_problem(self) -> Any:
        if self.problem is None:
            raise PlanFormatError(
                "this pipeline plan has no planner state attached (loaded from JSON?); call "
                "step.use(plan, *example_args) with the ParallelizedStep it belongs to, then edit the plan it returns"
            )
        return self.problem

    def _replan(self, stages: list, pins: Mapping[str, str], stage_pins: bool, schedule: str | None = None) -> PipelinePlan:
        from alpa_lab.cost.cluster import ClusterSpec
        from alpa_lab.passes.pipeline import check_memory, plan_stages

        problem = self._require_problem()
        schedule = schedule or self.schedule
        results, timeline = plan_stages(
            problem, stages, num_microbatches=self.num_microbatches, schedule=schedule, method=self.method, pins=pins
        )
        check_memory(results, ClusterSpec(**self.cluster))
        return dataclasses.replace(self, stages=results, timeline=timeline, stage_pins=stage_pins, schedule=schedule)

    def with_schedule(self, schedule: str, chunks: int = 2) -> PipelinePlan:
        """The same stages run with another schedule (re-simulated; memory re-checked, eq. 5).

        ``"interleaved_1f1b"`` keeps the stages' meshes and cuts the layers into ``chunks``
        virtual stages per mesh (Megatron-LM's interleaving); each is planned on its mesh.
        """
        from alpa_lab.passes.pipeline import interleave

        stages = self._current_stages()
        if schedule == "interleaved_1f1b" and self.num_meshes == self.num_stages:
            stages = interleave(stages, self.num_layers, chunks)
        return self._replan(stages, dict(self.pins), self.stage_pins, schedule)

    @property
    def num_meshes(self) -> int:
        """Distinct sub-meshes: ``num_stages``, or fewer when stages are interleaved."""
        return len({st.device_ids for st in self.stages})

    def _current_stages(self) -> list:
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
        from alpa_lab.passes.pipeline import fixed_stages

        stages = fixed_stages(self._require_problem(), layers, submeshes, logical_shapes)
        return self._replan(stages, dict(self.pins), True)

    def unpin_stages(self) -> PipelinePlan:
        """A new plan whose stages the DP chooses again (layer costs come from the cache); op pins are kept.

        An interleaved plan is re-planned with 1F1B's stages, then interleaved with as many chunks.
        """
        from alpa_lab.cost.cluster import ClusterSpec
        from alpa_lab.passes.pipeline import interleave, plan_pipeline

        problem = self._require_problem()
        interleaved = self.schedule == "interleaved_1f1b"
        _, stages, _ = plan_pipeline(
            problem.graph, ClusterSpec(**self.cluster), num_microbatches=self.num_microbatches,
            schedule="1f1b" if interleaved else self.schedule, method=self.method, max_stages=self.max_stages,
            problem=problem,
        )
        chosen = [(st.layers, st.submesh_shape, st.logical_shape, st.device_ids) for st in stages]
        if interleaved:
            chosen = interleave(chosen, self.num_layers, self.num_stages // self.num_meshes)
        return self._replan(chosen, dict(self.pins), False)

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
        from alpa_lab.cost.profile import ProfileError
        from alpa_lab.passes.pipeline import PipelineProblem, interleave, plan_pipeline

        problem = self._require_problem()
        measured_on = (profile.cluster_spec["hosts"], profile.cluster_spec["devices_per_host"])
        if measured_on != (self.cluster["hosts"], self.cluster["devices_per_host"]):
            raise ProfileError(
                f"the profile was measured on {profile.cluster_spec['hosts']}x{profile.cluster_spec['devices_per_host']} devices "
                f"but this plan is for {self.cluster['hosts']}x{self.cluster['devices_per_host']}: profile a run of a plan for this cluster"
            )
        cluster = profile.cluster()
        t0 = time.perf_counter()
        # a new problem (its caches hold the old costs) over the same program, reuse and cost model
        new_problem = PipelineProblem.build(problem.graph, cluster, reuse=problem.reuse)
        new_problem.stage_timer = problem.stage_timer
        if self.stage_pins:
            # the user fixed the stages: keep them as planned (chunks of an interleaved plan share
            # meshes, which fixed_stages would place apart), and each stage's layout (memory-saving or not)
            chosen = self._current_stages()
            if self.method == "alpa":
                for st in self.stages:
                    if st.plan.method != self.method:
                        new_problem.stage_methods[(st.layers, st.submesh_shape, st.logical_shape)] = st.plan.method
        else:
            interleaved = self.schedule == "interleaved_1f1b"
            _, stages, _ = plan_pipeline(
                problem.graph, cluster, num_microbatches=self.num_microbatches,
                schedule="1f1b" if interleaved else self.schedule, method=self.method, max_stages=self.max_stages,
                problem=new_problem,
            )
            chosen = [(st.layers, st.submesh_shape, st.logical_shape, st.device_ids) for st in stages]
            if interleaved:
                chosen = interleave(chosen, self.num_layers, self.num_stages // self.num_meshes)
        fresh = dataclasses.replace(
            self, cluster=cluster.to_dict(), problem=new_problem,
            planning_seconds={"recalibrate": time.perf_counter() - t0, **new_problem.seconds},
        )
        return fresh._replan(chosen, dict(self.pins), self.stage_pins)

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
        lines = []
        if self._current_stages() != other._current_stages():
            for a, b in zip(other.stages, self.stages):
                if (a.layers, a.submesh_shape, a.logical_shape) != (b.layers, b.submesh_shape, b.logical_shape):
                    lines.append(
                        f"stage {a.index}: layers {a.layers[0]}..{a.layers[1] - 1} on {a.submesh_shape} as {a.logical_shape} "
                        f"-> layers {b.layers[0]}..{b.layers[1] - 1} on {b.submesh_shape} as {b.logical_shape}"
                    )
            if len(self.stages) != len(other.stages):
                lines.append(f"{len(other.stages)} stages -> {len(self.stages)} stages")
        else:
            for a, b in zip(other.stages, self.stages):
                d = b.plan.diff(a.plan)
                if d.changes or d.pins_added or d.pins_removed:
                    lines.append(f"stage {a.index}: {d}")
        if self.schedule != other.schedule:
            lines.append(f"schedule {other.schedule} -> {self.schedule}")
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
        homes: dict[str, dict[str, Any]] = {"argument": {}, "result": {}}
        for st, mesh in zip(self.stages, meshes):
            for t in st.plan.inputs:
                homes["argument"].setdefault(t.path, spec_sharding(mesh, t.spec))
            for t in st.plan.outputs:
                if not t.path.startswith("<"):  # not a tensor passed between stages
                    homes["result"].setdefault(t.path, spec_sharding(mesh, t.spec))
        unread = jax.sharding.NamedSharding(meshes[0], jax.sharding.PartitionSpec())

        def placed(tree: Any, side: str) -> Any:
            leaves, treedef = jax.tree_util.tree_flatten_with_path(tree)
            out = []
            for path, _ in leaves:
                key = jax.tree_util.keystr(path) or "[]"
                if key not in homes[side] and side == "result":
                    raise ValueError(
                        f"no stage of this pipeline plan computes a result {key}: pass the step's results "
                        "(or jax.eval_shape(step, *args)) as it was planned with"
                    )
                out.append(homes[side].get(key, unread))
            return jax.tree_util.tree_unflatten(treedef, out)

        paths = {jax.tree_util.keystr(p) or "[]" for p, _ in jax.tree_util.tree_flatten_with_path(args)[0]}
        if not paths & set(homes["argument"]):
            raise ValueError(
                "none of the arguments given is one this pipeline plan's stages read: pass the step's arguments "
                f"as it was planned with (the stages read e.g. {', '.join(sorted(homes['argument'])[:3])})"
            )
        outs = dict(homes["result"]) if results is None else placed(results, "result")
        return placed(args, "argument"), outs

    def attach(self, problem: Any) -> PipelinePlan:
        """This plan with ``problem`` (the ``PipelineProblem`` of its program) as its planner state.

        What ``ParallelizedStep.use`` does for a loaded plan, so that it runs and can be edited
        again: each stage's ``Plan`` gets its strategy graph (``problem.stage_graph``, cached
        there), the problem learns the layout each stage was planned with (a DP-chosen
        memory-saving one stays on re-plans) and caches the stage plans, so an edit re-solves
        only the stages it touches, as on the original plan. Raises ``PlanFormatError`` when
        the plan does not fit it (another program, another cluster, stage plans that are not
        that program's), before recording anything in ``problem`` but strategy graphs.
        """
        self.check_program(problem.graph)
        if problem.slicing.num_layers != self.num_layers:
            raise PlanFormatError(
                f"this pipeline plan cuts the program into {self.num_layers} layers but the traced program has "
                f"{problem.slicing.num_layers}; re-plan with step.plan(...)"
            )
        if problem.cluster.to_dict() != dict(self.cluster):
            raise PlanFormatError("the planner state given is for another cluster than this pipeline plan's")
        graphs = []
        for st in self.stages:
            period = int(st.plan.solver.get("tie_period", 1))
            sg = problem.stage_graph(st.layers, st.submesh_shape, st.logical_shape, st.device_ids, period)
            if sg.fingerprint != st.plan.fingerprint:
                raise PlanFormatError(
                    f"stage {st.index}'s plan (layers {st.layers[0]}..{st.layers[1] - 1}) belongs to another program "
                    f"than that stage of the traced program; re-plan with step.plan(...)"
                )
            _check_choices(st, sg)
            graphs.append(sg)
        stages = []
        for st, sg in zip(self.stages, graphs):
            if self.method == "alpa":  # as plan_pipeline records the DP's choice of layout
                if st.plan.method != self.method:
                    problem.stage_methods[(st.layers, st.submesh_shape, st.logical_shape)] = st.plan.method
                else:
                    problem.stage_methods.pop((st.layers, st.submesh_shape, st.logical_shape), None)
            key = (st.layers, st.logical_shape, st.device_ids, st.plan.method, tuple(sorted(dict(st.plan.pins).items())))
            cached = problem.stage_plans.get(key)
            if cached is not None and cached == st.plan and cached.problem is sg:
                plan = cached
            else:
                plan = dataclasses.replace(st.plan, problem=sg)
                problem.stage_plans.setdefault(key, plan)
            stages.append(dataclasses.replace(st, plan=plan))
        return dataclasses.replace(self, stages=tuple(stages), problem=problem)


def _check_choices(st: StageResult, sg: StrategyGraph) -> None:
    """Each op of a stage's plan is a node of its strategy graph, with a strategy that node offers."""
    if [o.name for o in st.plan.ops] != [n.name for n in sg.nodes]:
        raise PlanFormatError(f"stage {st.index}'s plan does not list the ops of that stage's program; re-plan with step.plan(...)")
    for o, node in zip(st.plan.ops, sg.nodes):
        if o.strategy not in {s.name for s in node.strategies}:
            raise PlanFormatError(
                f"stage {st.index}'s plan gives {o.name!r} the strategy {o.strategy!r}, which the planner does not "
                f"offer for it (see plan.stages[{st.index}].plan.explain({o.name!r}) on a planned step)"
            )


# ----- pipeline plan JSON ------------------------------------------------------------------


class _FieldError(ValueError):
    """A malformed field of pipeline plan JSON; the message starts with its path (``stages[1].plan``)."""


class _MissingField(_FieldError):
    """A required field absent from pipeline plan JSON; ``args[0]`` is its path."""


def _stage_to_dict(st: StageResult) -> dict[str, Any]:
    data = {f.name: getattr(st, f.name) for f in dataclasses.fields(st) if f.name != "plan"}
    plan = dataclasses.asdict(dataclasses.replace(st.plan, problem=None))
    plan.pop("problem")
    data["plan"] = plan
    return data


def _number(x: Any) -> float:
    """A JSON number kept as written (an int stays an int), so figures round-trip exactly."""
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        raise TypeError(f"expected a number, got {x!r}")
    return x


def _integer(x: Any) -> int:
    if isinstance(x, bool) or not isinstance(x, int):
        raise TypeError(f"expected an integer, got {x!r}")
    return x


def _text(x: Any) -> str:
    if not isinstance(x, str):
        raise TypeError(f"expected a string, got {x!r}")
    return x


def _flag(x: Any) -> bool:
    if not isinstance(x, bool):
        raise TypeError(f"expected true or false, got {x!r}")
    return x


def _array(item: Any) -> Any:
    def convert(x: Any) -> tuple:
        if not isinstance(x, list):
            raise TypeError(f"expected a list, got {x!r}")
        return tuple(item(v) for v in x)

    return convert


def _optional(item: Any) -> Any:
    return lambda x: None if x is None else item(x)


def _as_tuples(x: Any) -> Any:
    """JSON lists back to tuples, for fields without a converter of their own."""
    return tuple(_as_tuples(v) for v in x) if isinstance(x, list) else x


def _from_dict(cls: type, d: Any, where: str, convert: Mapping[str, Any]) -> Any:
    """``cls`` from its JSON object: each field through its converter; errors name the field's path."""
    if not isinstance(d, dict):
        raise _FieldError(f"{where or 'the plan'}: expected a JSON object, got {type(d).__name__}")
    kwargs = {}
    for f in dataclasses.fields(cls):
        if f.name == "problem" or not f.init:
            continue
        path = f"{where}.{f.name}" if where else f.name
        if f.name not in d:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise _MissingField(path)
            continue
        fn = convert.get(f.name, _as_tuples)
        try:
            kwargs[f.name] = fn(d[f.name], path) if getattr(fn, "wants_path", False) else fn(d[f.name])
        except _FieldError:
            raise  # a nested field's error already names its path
        except KeyError as exc:
            raise _MissingField(f"{path}.{exc.args[0]}") from exc
        except (TypeError, ValueError, AttributeError) as exc:
            raise _FieldError(f"{path}: {exc}") from exc
    return cls(**kwargs)


def _with_path(fn: Any) -> Any:
    fn.wants_path = True
    return fn


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


def _cluster(d: Any) -> dict[str, Any]:
    from alpa_lab.cost.cluster import ClusterSpec

    if not isinstance(d, dict):
        raise TypeError(f"expected a JSON object, got {d!r}")
    try:
        ClusterSpec(**d)  # the fields of a cluster, with valid values
    except (TypeError, ValueError) as exc:
        raise ValueError(f"not a valid ClusterSpec ({exc})") from exc
    return dict(d)


def _seconds(d: Any) -> dict[str, float]:
    if not isinstance(d, dict):
        raise TypeError(f"expected a JSON object, got {d!r}")
    return {_text(k): _number(v) for k, v in d.items()}


def _pipeline_plan_from_dict(d: dict) -> PipelinePlan:
    plan = _from_dict(
        PipelinePlan, d, "",
        {
            "fingerprint": _text, "method": _text, "cluster": _cluster, "num_microbatches": _integer,
            "schedule": _text, "num_layers": _integer, "stages": _stages, "timeline": _timeline,
            "split_inputs": _array(_text), "stage_pins": _flag, "planning_seconds": _seconds,
            "schema_version": _integer, "max_stages": _optional(_integer),
        },
    )
    if plan.schedule not in SCHEDULES:
        raise ValueError(f"schedule: unknown pipeline schedule {plan.schedule!r}")
    start = 0
    for i, st in enumerate(plan.stages):
        if st.index != i or len(st.layers) != 2 or st.layers[0] != start or st.layers[1] <= start:
            raise ValueError(f"stages[{i}]: index {st.index} with layers {list(st.layers)} does not follow stage {i - 1}")
        start = st.layers[1]
    if start != plan.num_layers:
        raise ValueError(f"stages: the stages cover layers 0..{start - 1} but the plan has {plan.num_layers}")
    return plan
