"""Run a plan: the traced program, re-executed op by op under the planned shardings.

The plan becomes ``NamedSharding``s on a ``jax.sharding.Mesh`` of the plan's devices:
arguments and results get ``in_shardings``/``out_shardings``, every op output gets a
``with_sharding_constraint`` with its planned spec, and an operand the plan reshards
before an op gets a constraint with the spec that op wants (``sharding.constraints``,
shared with ``Plan.jit``, which exports a plan without this runtime). XLA's SPMD
partitioner then inserts the collectives; ``compiled_hlo`` shows which.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import jax
from jax.sharding import Mesh, NamedSharding

from alpa_lab.graph.opgraph import OpGraph
from alpa_lab.plan import Plan
from alpa_lab.sharding.constraints import DeviceError, compile_graph, device_mesh

__all__ = ["CompiledPlan", "DeviceError", "call_compiled", "compile_graph", "compile_plan", "make_mesh"]


def make_mesh(plan: Plan, devices: list | None = None) -> Mesh:
    """The plan's logical mesh over this process's devices."""
    return device_mesh(plan.mesh_shape, plan.device_ids, devices)


@dataclass(frozen=True, eq=False)
class CompiledPlan:
    """A plan bound to a program and a mesh: a jitted function over the flat arguments."""

    plan: Plan
    mesh: Mesh
    fn: Callable[..., Any]
    in_shardings: tuple[NamedSharding, ...]
    out_shardings: tuple[NamedSharding, ...]

    def __call__(self, *flat_args: Any) -> list[Any]:
        # Arguments are placed on their planned shardings first (a no-op for arrays already
        # there, such as the state the last step returned): jit would otherwise compile once
        # for host arrays and again for the committed arrays of the next step.
        args = [x if getattr(x, "sharding", None) == s else jax.device_put(x, s) for x, s in zip(flat_args, self.in_shardings)]
        return self.fn(*args)

    def lower_text(self, *flat_args: Any) -> str:
        """XLA's optimised HLO for these arguments (to count the collectives it inserted)."""
        return self.fn.lower(*flat_args).compile().as_text()


def compile_plan(graph: OpGraph, plan: Plan, devices: list | None = None) -> CompiledPlan:
    """Bind ``plan`` to ``graph``: constraints on every op, shardings on arguments and results."""
    plan.check_program(graph)
    mesh = make_mesh(plan, devices)
    fn, in_shardings, out_shardings = compile_graph(
        graph,
        {o.name: o for o in plan.ops if o.kind == "op"},
        [t.spec for t in plan.inputs],
        [t.spec for t in plan.outputs],
        mesh,
    )
    return CompiledPlan(plan, mesh, fn, in_shardings, out_shardings)


def call_compiled(compiled: Callable[..., Any], graph: OpGraph, args: tuple) -> Any:
    """Run a compiled plan (``CompiledPlan`` or ``runtime.pipeline.CompiledPipeline``) on the step's
    arguments: flat leaves in, results in the step's own structure.

    Shared by ``ParallelizedStep.__call__`` and a ``TrainingRun``, which keeps calling the program it
    compiled at launch whatever plan the step has since.
    """
    return jax.tree_util.tree_unflatten(graph.out_tree, compiled(*jax.tree_util.tree_leaves(args)))
