"""A plan's specs as stock JAX shardings: the mesh, ``NamedSharding``s and per-op constraints.

The one place sharding specs become JAX objects. Arguments and results get
``in_shardings``/``out_shardings``, every op output gets a ``with_sharding_constraint`` with
its planned spec, and an operand the plan reshards before an op gets a constraint with the
spec that op wants; XLA's SPMD partitioner then inserts the collectives. The runtime
(``runtime.apply``, ``runtime.pipeline``) compiles plans with it, and ``Plan.jit`` exports
a plan with it to code that does not use alpa_lab's runtime: it needs only JAX, the op graph
and the specs (no pass, no runtime).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding

from alpa_lab.graph.evaluate import evaluate
from alpa_lab.graph.opgraph import Op, OpGraph
from alpa_lab.graph.trace import args_signature, trace
from alpa_lab.sharding.spec import ShardingSpec

__all__ = ["ConstrainedStep", "DeviceError", "OpSpecs", "compile_graph", "device_mesh", "spec_sharding"]

AXIS_NAMES = ("x", "y")
"""Names of the logical mesh's two axes (``ShardingSpec.to_partition_spec``'s default)."""


class DeviceError(RuntimeError):
    """The plan needs more devices than this process has."""


class OpSpecs(Protocol):
    """What a plan says of one op: the specs it wants its operands in and gives its results."""

    input_specs: tuple[str, ...]
    output_specs: tuple[str, ...]


def device_mesh(mesh_shape: Sequence[int], device_ids: Sequence[int], devices: Sequence[Any] | None = None) -> Mesh:
    """The logical mesh ``mesh_shape`` over ``devices[i] for i in device_ids`` (default ``jax.devices()``)."""
    devices = list(jax.devices()) if devices is None else list(devices)
    need = max(device_ids) + 1
    if len(devices) < need:
        raise DeviceError(
            f"the plan uses {need} devices ({mesh_shape[0]}x{mesh_shape[1]} mesh) but JAX sees "
            f"{len(devices)}; for simulated CPU devices set XLA_FLAGS=--xla_force_host_platform_device_count={need} "
            "before JAX is first imported (in a notebook: restart the kernel after setting it)"
        )
    grid = np.array([devices[i] for i in device_ids], dtype=object).reshape(tuple(mesh_shape))
    return Mesh(grid, AXIS_NAMES)


def spec_sharding(mesh: Mesh, spec_text: str) -> NamedSharding:
    """The ``NamedSharding`` of a spec written as text (``"S0R"``, ``"RS01"``)."""
    return NamedSharding(mesh, ShardingSpec.parse(spec_text).to_partition_spec(AXIS_NAMES))


def compile_graph(
    graph: OpGraph,
    op_plans: Mapping[str, OpSpecs],
    in_specs: Sequence[str],
    out_specs: Sequence[str],
    mesh: Mesh,
) -> tuple[Callable[..., Any], tuple[NamedSharding, ...], tuple[NamedSharding, ...]]:
    """``graph`` jitted on ``mesh`` with every op's planned specs (ops found by name).

    The one place a plan becomes sharding constraints: a whole program (``runtime.apply``,
    ``Plan.jit``) and a pipeline's unit tasks (``runtime.pipeline``) all go through it.
    """

    def sharding(spec_text: str) -> NamedSharding:
        return spec_sharding(mesh, spec_text)

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


@dataclass(frozen=True, eq=False)
class _Bound:
    graph: OpGraph
    fn: Callable[..., Any]
    in_shardings: tuple[NamedSharding, ...]
    out_shardings: tuple[NamedSharding, ...]


@dataclass(frozen=True, eq=False)
class ConstrainedStep:
    """A step run with plain ``jax.jit`` under a plan's shardings (what ``Plan.jit`` returns).

    On the first call with given argument shapes the step is traced to its op graph, which
    must be the program the plan was made for (same fingerprint), and the graph is jitted
    with the plan's argument/result shardings and a ``with_sharding_constraint`` on every
    op (``compile_graph``). Runs without alpa_lab's runtime.
    """

    fn: Callable[..., Any]
    fingerprint: str
    op_specs: Mapping[str, OpSpecs]
    in_specs: tuple[str, ...]
    out_specs: tuple[str, ...]
    mesh: Mesh
    _bound: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def _bind(self, args: tuple) -> _Bound:
        key = args_signature(args)
        if key not in self._bound:
            graph = trace(self.fn, *args)
            if graph.fingerprint != self.fingerprint:
                raise ValueError(
                    f"the plan belongs to another program (plan fingerprint {self.fingerprint}, "
                    f"{getattr(self.fn, '__name__', 'the step')}({_shapes(args)}) traces to {graph.fingerprint}): "
                    "pass the function and argument shapes and dtypes the plan was made for, or re-plan"
                )
            fn, ins, outs = compile_graph(graph, self.op_specs, self.in_specs, self.out_specs, self.mesh)
            self._bound[key] = _Bound(graph, fn, ins, outs)
        return self._bound[key]

    def __call__(self, *args: Any) -> Any:
        b = self._bind(args)
        # placed on their planned shardings first: jit refuses arrays committed elsewhere
        flat = [
            x if getattr(x, "sharding", None) == s else jax.device_put(x, s)
            for x, s in zip(jax.tree_util.tree_leaves(args), b.in_shardings)
        ]
        return jax.tree_util.tree_unflatten(b.graph.out_tree, b.fn(*flat))

    def lower(self, *args: Any) -> jax.stages.Lowered:
        """The jitted step lowered for ``args`` (``.compile().as_text()`` is XLA's HLO)."""
        return self._bind(args).fn.lower(*jax.tree_util.tree_leaves(args))

    def shardings(self, *args: Any) -> tuple[Any, Any]:
        """(argument shardings, result shardings) as pytrees of the step's arguments and results."""
        b = self._bind(args)
        return (
            jax.tree_util.tree_unflatten(b.graph.in_tree, b.in_shardings),
            jax.tree_util.tree_unflatten(b.graph.out_tree, b.out_shardings),
        )


def _shapes(args: Any) -> str:
    leaves = jax.tree_util.tree_leaves(args)
    text = ", ".join(f"{getattr(x, 'dtype', '?')}{list(np.shape(x))}" for x in leaves[:4])
    return text + (f", ... ({len(leaves)} arrays)" if len(leaves) > 4 else "")
