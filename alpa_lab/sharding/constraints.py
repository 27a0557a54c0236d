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

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding

from alpa_lab.graph.analysis import find_aliases
from alpa_lab.graph.evaluate import evaluate
from alpa_lab.graph.opgraph import Op, OpGraph
from alpa_lab.graph.trace import args_signature, trace, with_batch
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
    order, gathers = _combined_gathers(graph, op_plans, spec_of_var)

    def constrain_outputs(op: Op, values: list[Any]) -> list[Any]:
        return [jax.lax.with_sharding_constraint(x, s) for x, s in zip(values, out_constraint[op.index])]

    def run(*flat_args: Any) -> tuple[Any, ...]:
        gathered: dict[int, Any] = {}  # var -> its value gathered whole by the one combined all-gather (this trace's)

        def constrain_inputs(op: Op, values: list[Any]) -> list[Any]:
            wanted = in_constraint[op.index]
            return [
                x if want is None else gathered[v] if v in gathered and not any(want.spec) else jax.lax.with_sharding_constraint(x, want)
                for v, x, want in zip(op.inputs, values, wanted)
            ]

        def gather_first(op: Op, env: Any) -> None:
            if gathers and op.index == gathers.first_reader:
                gathered.update(_gather_together(gathers, env, mesh))

        return tuple(evaluate(order, flat_args, on_output=constrain_outputs, on_input=constrain_inputs, before=gather_first))

    fn = jax.jit(run, in_shardings=in_shardings, out_shardings=out_shardings)
    return fn, in_shardings, out_shardings


@dataclass(frozen=True)
class _Gathers:
    """The update's all-gathers ``compile_graph`` makes one: var -> (the dimension its spec splits, the mesh axes
    it is split over), all over the same axes; ``first_reader``: the op before which they are gathered."""

    dims: Mapping[int, int]
    axes: tuple[int, ...]
    first_reader: int

    def __bool__(self) -> bool:
        return len(self.dims) > 1


def _combined_gathers(graph: OpGraph, op_plans: Mapping[str, OpSpecs], spec_of_var: Mapping[int, str]) -> tuple[OpGraph, _Gathers]:
    """(``graph`` with its update's reads moved late, the tensors to gather together): an all-gather combiner for
    the weight update.

    After a sharded weight update (each device updates its slice of a replicated weight: ``shard_weight_update``,
    ZeRO-2), every updated slice is gathered back whole. Where the new weight is a result kept split to the end,
    stock XLA gathers all of them at once (its own combiner, at the results); where the op that makes the new weight
    wants the slice whole (a pipeline stage's update task: ``param + delta`` planned replicated), it makes one
    all-gather per weight, where Alpa's XLA made one (Alpa's test_reduce_scatter counts it). Here the same: the
    tensors split along one dimension over the same mesh axes (and of one dtype) and gathered whole for an op that
    makes a result of the program (the new weight) are laid side by side as rows of one per device, gathered at
    once, and cut apart again (``_gather_together``). The ops reading them (and what depends on
    those) run after every other op, so that all the slices exist when the one gather goes; the program's
    meaning is unchanged (only the order of independent ops moves). Gathers elsewhere (ZeRO-3's weights before
    the layer that uses them, a resharding mid-program) are left alone: combining them would hold every weight
    whole at once, which is what ZeRO-3 avoids. A new weight is a result that replaces an argument (the train
    state, updated: ``find_aliases``); a pipeline's forward and backward tasks return tensors that other tasks
    read, which replace nothing and are left alone.
    """
    new_state = {graph.outvars[pos] for pos in find_aliases(graph)}
    dims: dict[int, int] = {}
    readers: set[int] = set()
    axes_of: dict[tuple[tuple[int, ...], str], list[int]] = {}  # (mesh axes, dtype) -> the tensors (concatenated: one dtype)
    for op in graph.ops:
        if not op.outputs or not all(v in new_state for v in op.outputs):
            continue
        for v, want in zip(op.inputs, op_plans[op.name].input_specs):
            have = spec_of_var.get(v)
            if have is None or have == want or graph.vars[v].kind != "op":
                continue
            src, dst = ShardingSpec.parse(have), ShardingSpec.parse(want)
            split = [d for d, a in enumerate(src.dims) if a]
            if len(split) != 1 or any(dst.dims):  # one split dimension, gathered whole
                continue
            if v not in dims:
                dims[v] = split[0]
                axes_of.setdefault((src.dims[split[0]], graph.vars[v].dtype), []).append(v)
            readers.add(op.index)
    if not axes_of:
        return graph, _Gathers({}, (), -1)
    (axes, _), group = max(axes_of.items(), key=lambda kv: len(kv[1]))  # one combined gather: the largest group
    group_readers = {op.index for op in graph.ops if op.index in readers and any(v in group for v in op.inputs)}
    late = set()
    for op in graph.ops:  # the readers and everything after them in the dataflow
        if op.index in group_readers or any(graph.vars[v].producer in late for v in op.inputs):
            late.add(op.index)
    early = [op for op in graph.ops if op.index not in late]
    made_early = {v for op in early for v in op.outputs}
    ready = [v for v in group if v in made_early]
    if len(ready) < 2:
        return graph, _Gathers({}, (), -1)
    order = early + [op for op in graph.ops if op.index in late]
    first = next(op.index for op in order if op.index in late)
    return dataclasses.replace(graph, ops=tuple(order)), _Gathers({v: dims[v] for v in ready}, axes, first)


def _gather_together(gathers: _Gathers, env: Mapping[int, Any], mesh: Mesh) -> dict[int, Any]:
    """One all-gather for every tensor of ``gathers``: each, its split dimension first, as n rows (n: the devices
    its dimension is split over, one row per device's slice), laid side by side; the whole gathered at once and
    cut back into the tensors, whole. Moving the split dimension first and reshaping keep every device's slice on it
    (no data moves but in the gather)."""
    split = ShardingSpec((gathers.axes, ()))  # the rows: one per device along the split axes
    n = split.num_shards(mesh.devices.shape)
    rows = spec_sharding(mesh, str(split))
    pieces, layout = [], []
    for v, d in gathers.dims.items():
        x = jax.numpy.moveaxis(env[v], d, 0)
        layout.append((v, d, x.shape))
        pieces.append(jax.lax.with_sharding_constraint(x.reshape(n, -1), rows))
    whole = jax.lax.with_sharding_constraint(jax.numpy.concatenate(pieces, axis=1), spec_sharding(mesh, "RR"))
    out, at = {}, 0
    for (v, d, shape), piece in zip(layout, pieces):
        width = piece.shape[1]
        out[v] = jax.numpy.moveaxis(whole[:, at : at + width].reshape(shape), 0, d)
        at += width
    return out


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
    batch_inputs: tuple[str, ...] | None = None
    """the argument paths the plan's step named as its batch (``Plan.batch_inputs``): never state, as it traced them"""
    _bound: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def _bind(self, args: tuple) -> _Bound:
        key = args_signature(args)
        if key not in self._bound:
            graph = trace(self.fn, *args, cut=False)  # one mesh: argument-less boundaries are no-ops, as the plan's trace
            if self.batch_inputs is not None:
                graph = with_batch(graph, [p in self.batch_inputs for p in graph.in_paths])
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
