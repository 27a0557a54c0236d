"""The machinery every sharding rule shares: loops over an op's iteration space.

Most parallel algorithms of the Alpa paper (sec. 4.2, Table 3) are one idea: the op is a
loop nest, and each mesh axis either parallelises one loop or is unused. A loop appears in
some dimensions of the operands and results; splitting the loop over mesh axis ``a`` splits
all those tensor dimensions over ``a``. Splitting a *reduced* loop (the contracting dim of
a matmul, a summed axis) leaves partial results on each device, so the op ends with an
all-reduce of its output tile over ``a`` (or a reduce-scatter onto an output dim that is not
split yet). A tensor dimension that belongs to no loop is always replicated.

A rule therefore only has to say which loops an op has (``Loop``); ``loop_strategies``
enumerates the assignments of mesh axes to loops, keeps those whose specs divide the
shapes evenly, and prices them.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Callable, Sequence

from alpa_lab.cost.cluster import Collective, LogicalMesh
from alpa_lab.graph.opgraph import Op, OpGraph, Var
from alpa_lab.sharding.spec import ShardingSpec
from alpa_lab.sharding.strategy import Strategy

Dim = tuple[int, int]
"""(tensor index, dimension) of one operand or result of an op."""


@dataclass(frozen=True)
class RuleContext:
    """One op with its graph and mesh: what a rule reads to build strategies."""

    op: Op
    graph: OpGraph
    mesh: LogicalMesh

    @property
    def ins(self) -> list[Var]:
        return [self.graph.vars[i] for i in self.op.inputs]

    @property
    def outs(self) -> list[Var]:
        return [self.graph.vars[i] for i in self.op.outputs]

    @property
    def params(self) -> dict:
        return self.op.params

    @property
    def split_axes(self) -> tuple[int, ...]:
        """Mesh axes worth splitting over: those of size > 1."""
        return tuple(a for a, n in enumerate(self.mesh.shape) if n > 1)


Rule = Callable[[RuleContext], list[Strategy]]


@dataclass(frozen=True)
class Loop:
    """One dimension of an op's iteration space and where it shows up.

    ``operands``/``results`` are the (tensor index, dim) pairs indexed by this loop;
    ``reduced`` means the loop is summed (or max-ed) over, so splitting it leaves partial
    results that must be combined across the devices that split it.
    """

    operands: tuple[Dim, ...] = ()
    results: tuple[Dim, ...] = ()
    reduced: bool = False


def make_strategy(
    ctx: RuleContext,
    outs: Sequence[ShardingSpec],
    ins: Sequence[ShardingSpec],
    *,
    parallelism: int,
    name: str | None = None,
    collectives: Sequence[Collective] = (),
) -> Strategy:
    """A priced strategy.

    ``parallelism`` is how many ways the op's iteration space is split (the product of the
    mesh axes splitting its loops); a replicated op (1) pays its full compute on every
    device, which is what lets the ILP see the gain of sharding.
    """
    mesh_shape = ctx.mesh.shape
    memory = sum(v.nbytes / s.num_shards(mesh_shape) for v, s in zip(ctx.outs, outs))
    return Strategy(
        name=name or default_name(outs, ins),
        output_specs=tuple(outs),
        input_specs=tuple(ins),
        compute_cost=ctx.mesh.compute_cost(ctx.op.flops, ctx.op.bytes_accessed, parallelism),
        communication_cost=sum(c.cost for c in collectives),
        memory_cost=float(memory),
        collectives=tuple(collectives),
    )


def default_name(outs: Sequence[ShardingSpec], ins: Sequence[ShardingSpec]) -> str:
    """``"S0R"`` when the operands follow the result, else ``"S0R <- RS0, R"``.

    Scalar operands are left out; they are always replicated.
    """
    out = ",".join(map(str, outs))
    shown = [s for s in ins if s.rank > 0]
    if len(outs) == 1 and all(s == outs[0] for s in shown):
        return out
    return f"{out} <- {', '.join(map(str, shown))}" if shown else out


def replicated_strategy(ctx: RuleContext, name: str | None = None) -> Strategy:
    """Every operand and result whole on every device; compute unsplit."""
    outs = [ShardingSpec.replicated(v.rank) for v in ctx.outs]
    ins = [ShardingSpec.replicated(v.rank) for v in ctx.ins]
    return make_strategy(ctx, outs, ins, name=name, parallelism=1)


def loop_strategies(
    ctx: RuleContext,
    loops: Sequence[Loop],
    *,
    reduce_scatter: bool = False,
    name_fn: Callable[[Sequence[ShardingSpec], Sequence[ShardingSpec]], str] = default_name,
) -> list[Strategy]:
    """Every assignment of the mesh axes (size > 1) to loops whose specs fit the shapes.

    Each mesh axis is unused or parallelises one loop; both axes on one loop give the
    combined axis ``01``. Split reduced loops cost an all-reduce of each result tile over
    their mesh axes; with ``reduce_scatter`` the op may instead reduce-scatter its (single)
    result onto a result dimension no mesh axis splits yet, which leaves the result
    sharded and moves half the bytes.
    """
    axes = ctx.split_axes
    strategies = []
    for assignment in itertools.product([None, *range(len(loops))], repeat=len(axes)):
        chosen = [(a, loops[k]) for a, k in zip(axes, assignment) if k is not None]
        ins = _specs([v.rank for v in ctx.ins], [(a, loop.operands) for a, loop in chosen])
        outs = _specs([v.rank for v in ctx.outs], [(a, loop.results) for a, loop in chosen])
        if not _all_valid(ctx, outs, ins):
            continue
        parallelism = math.prod(ctx.mesh.shape[a] for a, _ in chosen)
        reduced = tuple(a for a, loop in chosen if loop.reduced)
        tiles = [v.nbytes / s.num_shards(ctx.mesh.shape) for v, s in zip(ctx.outs, outs)]
        collectives = [ctx.mesh.collective("all-reduce", t, reduced) for t in tiles] if reduced else []
        strategies.append(
            make_strategy(ctx, outs, ins, name=name_fn(outs, ins), collectives=collectives, parallelism=parallelism)
        )
        if reduce_scatter and reduced and len(outs) == 1:
            for scattered in scatter_targets(outs[0], reduced):
                if scattered.is_valid_for(ctx.outs[0].shape, ctx.mesh.shape):
                    rs = ctx.mesh.collective("reduce-scatter", tiles[0], reduced)
                    strategies.append(
                        make_strategy(
                            ctx, [scattered], ins, name=name_fn([scattered], ins), collectives=[rs], parallelism=parallelism
                        )
                    )
    return strategies


def scatter_targets(out: ShardingSpec, axes: tuple[int, ...]) -> list[ShardingSpec]:
    """``out`` with ``axes`` added to one dimension no mesh axis splits yet, for each such dim."""
    return [
        ShardingSpec(out.dims[:d] + (axes,) + out.dims[d + 1 :])
        for d in range(out.rank)
        if not out.dims[d]
    ]


def _specs(ranks: list[int], placements: list[tuple[int, tuple[Dim, ...]]]) -> list[ShardingSpec]:
    """Specs of tensors of ``ranks`` with mesh axis ``a`` on each of its (tensor, dim)."""
    dims: list[list[tuple[int, ...]]] = [[() for _ in range(r)] for r in ranks]
    for a, where in placements:
        for t, d in where:
            dims[t][d] = dims[t][d] + (a,)
    return [ShardingSpec(tuple(ds)) for ds in dims]


def _all_valid(ctx: RuleContext, outs: Sequence[ShardingSpec], ins: Sequence[ShardingSpec]) -> bool:
    shape = ctx.mesh.shape
    return all(s.is_valid_for(v.shape, shape) for v, s in zip(ctx.outs, outs)) and all(
        s.is_valid_for(v.shape, shape) for v, s in zip(ctx.ins, ins)
    )


def same_dim_loops(ctx: RuleContext, rank: int, dims_of: Callable[[int], tuple[Dim, ...]], skip: Sequence[int] = ()) -> list[Loop]:
    """One loop per result dimension ``d`` (except ``skip``): results ``d`` of every result
    plus the operand dims ``dims_of(d)``. The shape of most data-parallel ops."""
    return [
        Loop(operands=dims_of(d), results=tuple((t, d) for t in range(len(ctx.outs))))
        for d in range(rank)
        if d not in skip
    ]


def matching_operand_dims(ctx: RuleContext, d: int, operands: Sequence[int] | None = None) -> tuple[Dim, ...]:
    """Operands of the result's rank whose dim ``d`` has the result's size there.

    Operands of another rank (scalars) or of size 1 at ``d`` (implicit broadcast) stay
    replicated along it: every device has all of them.
    """
    size = ctx.outs[0].shape[d]
    rank = ctx.outs[0].rank
    idx = range(len(ctx.ins)) if operands is None else operands
    return tuple((t, d) for t in idx if ctx.ins[t].rank == rank and ctx.ins[t].shape[d] == size)


def normalize_axis(axis: int, rank: int) -> int:
    return axis + rank if axis < 0 else axis
