"""Run a plan: the traced program, re-executed op by op under the planned shardings.

The plan becomes ``NamedSharding``s on a ``jax.sharding.Mesh`` of the plan's devices:
arguments and results get ``in_shardings``/``out_shardings``, every op output gets a
``with_sharding_constraint`` with its planned spec, and an operand the plan reshards
before an op gets a constraint with the spec that op wants. XLA's SPMD partitioner then
inserts the collectives; ``compiled_hlo`` shows which.
"""

from __future__ import annotations

from dataclasses import dataclass
from collections.abc import Mapping, Sequence
from typing import Any, Callable

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding

from alpa_lab.graph.evaluate import evaluate
from alpa_lab.graph.opgraph import Op, OpGraph
from alpa_lab.plan import OpPlan, Plan
from alpa_lab.sharding.spec import ShardingSpec


class DeviceError(RuntimeError):
    """The plan needs more devices than this process has."""


def make_mesh(plan: Plan, devices: list | None = None) -> Mesh:
    """The plan's logical mesh over this process's devices."""
    devices = list(jax.devices()) if devices is None else list(devices)
    need = max(plan.device_ids) + 1
    if len(devices) < need:
        raise DeviceError(
            f"the plan uses {need} devices ({plan.mesh_shape[0]}x{plan.mesh_shape[1]} mesh) but JAX sees "
            f"{len(devices)}; for simulated CPU devices set XLA_FLAGS=--xla_force_host_platform_device_count={need} "
            "before JAX is first imported (in a notebook: restart the kernel after setting it)"
        )
    grid = np.array([devices[i] for i in plan.device_ids], dtype=object).reshape(plan.mesh_shape)
    return Mesh(grid, ("x", "y"))


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


def compile_graph(
    graph: OpGraph,
    op_plans: Mapping[str, OpPlan],
    in_specs: Sequence[str],
    out_specs: Sequence[str],
    mesh: Mesh,
) -> tuple[Callable[..., Any], tuple[NamedSharding, ...], tuple[NamedSharding, ...]]:
    """``graph`` jitted on ``mesh`` with every op's planned specs (ops found by name).

    The one place a plan becomes sharding constraints: a whole program (``compile_plan``)
    and a pipeline's unit tasks (``runtime.pipeline``) both go through it.
    """

    def sharding(spec_text: str) -> NamedSharding:
        return NamedSharding(mesh, ShardingSpec.parse(spec_text).to_partition_spec())

    spec_of_var = dict(zip(graph.invars, in_specs))
    out_constraint = {}
    in_constraint = {}
    for op in graph.ops:
        p = op_plans[op.name]
        spec_of_var.update(zip(op.outputs, p.output_specs))
        out_constraint[op.index] = [sharding(s) for s in p.output_specs]
        # reshard an operand where the plan does: where this op wants another spec
        in_constraint[op.index] = [
            sharding(s) if v in spec_of_var and spec_of_var[v] != s else None for s, v in zip(p.input_specs, op.inputs)
        ]
    in_shardings = tuple(sharding(s) for s in in_specs)
    out_shardings = tuple(sharding(s) for s in out_specs)

    def constrain_inputs(op: Op, values: list[Any]) -> list[Any]:
        wanted = in_constraint[op.index]
        return [x if want is None else jax.lax.with_sharding_constraint(x, want) for x, want in zip(values, wanted)]

    def constrain_outputs(op: Op, values: list[Any]) -> list[Any]:
        return [jax.lax.with_sharding_constraint(x, s) for x, s in zip(values, out_constraint[op.index])]

    def run(*flat_args: Any) -> tuple[Any, ...]:
        return tuple(evaluate(graph, flat_args, on_output=constrain_outputs, on_input=constrain_inputs))

    fn = jax.jit(run, in_shardings=in_shardings, out_shardings=out_shardings)
    return fn, in_shardings, out_shardings
