"""The public entry point: ``parallelize(train_step, cluster=...)``.

``ParallelizedStep`` ties the pure pieces together for a user: trace (cached per argument
shapes), plan (one ILP per candidate logical mesh shape, the cheapest kept), run (the
current plan, compiled once). It holds the *current plan*; editing returns new plans and
``use`` makes one current, so a failed edit never loses the plan that works.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable, Iterable, Mapping

import jax

from alpa_lab.cost.cluster import ClusterSpec
from alpa_lab.graph.opgraph import OpGraph
from alpa_lab.graph.trace import trace
from alpa_lab.passes.intra_op import build_strategy_graph
from alpa_lab.passes.methods import METHODS, MethodError, solve_method
from alpa_lab.plan import Plan, make_plan
from alpa_lab.runtime.apply import CompiledPlan, compile_plan


def plan_graph(
    graph: OpGraph,
    cluster: ClusterSpec,
    *,
    mesh_shape: tuple[int, int] | None = None,
    method: str = "alpa",
    memory_budget: float | None = None,
    pins: Mapping[str, str] | None = None,
    progress: Callable[[str], None] | None = None,
) -> Plan:
    """Plan ``graph`` on ``cluster``: the cheapest plan over the candidate mesh shapes."""
    if method not in METHODS:
        raise MethodError(f"unknown planning method {method!r}; choose one of {', '.join(METHODS)}")
    shapes = [tuple(mesh_shape)] if mesh_shape is not None else cluster.logical_mesh_shapes()
    meshes = [cluster.logical_mesh(s) for s in shapes]  # validates a given shape
    best: Plan | None = None
    tried = []
    errors = []
    for mesh in meshes:
        t0 = time.perf_counter()
        sg = build_strategy_graph(graph, mesh)
        try:
            solved = solve_method(sg, method, pins, memory_budget=memory_budget)
        except MethodError as exc:
            errors.append(str(exc))
            continue
        plan = make_plan(sg, solved, method=method, cluster=cluster.to_dict(), pins=dict(pins or {}), memory_budget=memory_budget)
        tried.append((mesh.shape, plan.objective))
        if progress:
            progress(f"mesh {mesh.shape[0]}x{mesh.shape[1]}: {plan.objective * 1e3:.3f} ms ({time.perf_counter() - t0:.2f}s)")
        if best is None or plan.objective < best.objective:
            best = plan
    if best is None:
        raise MethodError("; ".join(errors))
    return dataclasses.replace(best, mesh_candidates=tuple(tried))


class ParallelizedStep:
    """A training step with a plan: call it like the original function."""

    def __init__(
        self,
        fn: Callable,
        cluster: ClusterSpec | None = None,
        *,
        mesh_shape: tuple[int, int] | None = None,
        method: str = "alpa",
        memory_budget: float | None = None,
    ):
        if method not in METHODS:
            raise MethodError(f"unknown planning method {method!r}; choose one of {', '.join(METHODS)}")
        self.fn = fn
        self.cluster = cluster if cluster is not None else ClusterSpec.local(1, len(jax.devices()))
        if mesh_shape is not None:
            self.cluster.logical_mesh(mesh_shape)  # fail early on a mesh that does not fit
        self.mesh_shape = mesh_shape
        self.method = method
        self.memory_budget = memory_budget
        self.current_plan: Plan | None = None
        self._graphs: dict[Any, OpGraph] = {}
        self._compiled: CompiledPlan | None = None
        self.__name__ = getattr(fn, "__name__", "step")
        self.__doc__ = getattr(fn, "__doc__", None)

    # ----- tracing and planning ----------------------------------------------------------
    def trace(self, *args: Any) -> OpGraph:
        """The op graph of ``fn(*args)`` (traced once per argument shapes and dtypes)."""
        key = _signature(args)
        if key not in self._graphs:
            self._graphs[key] = trace(self.fn, *args)
        return self._graphs[key]

    def plan(self, *args: Any, pins: Mapping[str, str] | None = None, progress: Callable[[str], None] | None = None) -> Plan:
        """Trace with ``args`` (arrays or ShapeDtypeStructs) and plan; the plan becomes current."""
        graph = self.trace(*args)
        plan = plan_graph(
            graph,
            self.cluster,
            mesh_shape=self.mesh_shape,
            method=self.method,
            memory_budget=self.memory_budget,
            pins=pins,
            progress=progress,
        )
        self.current_plan = plan
        return plan

    def use(self, plan: Plan, *args: Any) -> Plan:
        """Make ``plan`` current (e.g. an edited or loaded one) after checking it fits.

        A plan loaded from JSON gets the planner state back, so it can be edited again.
        With ``args`` the plan is checked against their program now; otherwise at the next call.
        """
        if args:
            graph = self.trace(*args)
            plan.check_program(graph)
            if plan.problem is None:
                sg = build_strategy_graph(graph, self.cluster.logical_mesh(plan.mesh_shape, plan.device_ids))
                plan = dataclasses.replace(plan, problem=sg)
        self.current_plan = plan
        return plan

    def pin(self, op: str, strategy: str) -> Plan:
        """Pin on the current plan; the re-solved plan becomes current only if it succeeds."""
        plan = self._require_plan().pin(op, strategy)
        self.current_plan = plan
        return plan

    def _require_plan(self) -> Plan:
        if self.current_plan is None:
            raise ValueError("this step has no plan yet: call step.plan(*example_args) or run it once")
        return self.current_plan

    # ----- running ---------------------------------------------------------------------
    def compiled(self, *args: Any) -> CompiledPlan:
        """The current plan compiled for ``args`` (planned first if there is no plan yet)."""
        graph = self.trace(*args)
        if self.current_plan is None:
            self.plan(*args)
        plan = self._require_plan()
        plan.check_program(graph)  # other shapes are another program: say so, run nothing
        if self._compiled is None or self._compiled.plan is not plan:
            self._compiled = compile_plan(graph, plan)
        return self._compiled

    def __call__(self, *args: Any) -> Any:
        compiled = self.compiled(*args)
        graph = self.trace(*args)
        outs = compiled(*jax.tree_util.tree_leaves(args))
        return jax.tree_util.tree_unflatten(graph.out_tree, outs)

    def compiled_hlo(self, *args: Any) -> str:
        """XLA's optimised HLO of the current plan (what XLA really runs)."""
        return self.compiled(*args).lower_text(*jax.tree_util.tree_leaves(args))


def _signature(args: Iterable[Any]) -> Any:
    leaves, tree = jax.tree_util.tree_flatten(args)
    return tree, tuple((tuple(getattr(x, "shape", ())), str(getattr(x, "dtype", type(x).__name__))) for x in leaves)


def parallelize(
    fn: Callable | None = None,
    *,
    cluster: ClusterSpec | None = None,
    mesh_shape: tuple[int, int] | None = None,
    method: str = "alpa",
    memory_budget: float | None = None,
) -> ParallelizedStep | Callable[[Callable], ParallelizedStep]:
    """Wrap a training step for planning and sharded execution (usable as a decorator)."""

    def wrap(f: Callable) -> ParallelizedStep:
        return ParallelizedStep(f, cluster, mesh_shape=mesh_shape, method=method, memory_budget=memory_budget)

    return wrap(fn) if fn is not None else wrap
