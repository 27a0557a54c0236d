"""Indexing: gather (embedding lookup, ``x[idx]``, ``take_along_axis``), scatter (their
gradients), dynamic slices.

A gather's loops are the batch dims of its indices (each device looks up its own ids in a
replicated table), the operand dims it copies whole (an embedding table split along the
hidden dim gives an output split the same way), and, for a lookup along one collapsed dim,
that indexed dim: each device holds some rows of the table, looks up the ids it owns (zero
elsewhere) and an all-reduce sums the results (Megatron's vocab-parallel embedding). The
batching dims of ``take_along_axis``-style gathers pair an indices dim with an operand dim.
A scatter is the mirror image: split updates along the indices batch leaves partial sums
of the result (all-reduced; only for add/min/max scatters), and a table split along its
indexed or window dim takes each update where it lands with no communication.
"""

from __future__ import annotations

from alpa_lab.sharding.rules.base import Dim, Loop, RuleContext, loop_strategies
from alpa_lab.sharding.rules.layout import passthrough
from alpa_lab.sharding.strategy import Strategy


def batch_dim_loop(j: int, indices_dims: tuple[Dim, ...], pairs: tuple, result: Dim | None, combinable: bool) -> Loop | None:
    """Loop over indices batch dim ``j``; ``pairs`` = (operand batching dims, indices batching dims).

    With a paired operand batching dim the operand is split along too and nothing is
    partial; otherwise the result (a scatter's whole operand) is partial unless ``result``
    says where the loop shows up in it.
    """
    operand_batching, indices_batching = pairs
    if j in indices_batching:
        d = operand_batching[indices_batching.index(j)]
        return Loop(operands=((0, d), *indices_dims), results=((0, d),) if result is None else (result,))
    if result is not None:
        return Loop(operands=indices_dims, results=(result,))
    return Loop(operands=indices_dims, reduced=True) if combinable else None


def gather_loops(ctx: RuleContext) -> list[Loop]:
    dn = ctx.params["dimension_numbers"]
    operand, indices, out = ctx.ins[0], ctx.ins[1], ctx.outs[0]
    slice_sizes = ctx.params["slice_sizes"]
    batch_pos = [d for d in range(out.rank) if d not in dn.offset_dims]
    pairs = (tuple(dn.operand_batching_dims), tuple(dn.start_indices_batching_dims))
    loops = [batch_dim_loop(j, ((1, j),), pairs, (0, batch_pos[j]), False) for j in range(indices.rank - 1)]
    window = [d for d in range(operand.rank) if d not in dn.collapsed_slice_dims and d not in dn.operand_batching_dims]
    for d, o in zip(window, dn.offset_dims):
        if d not in dn.start_index_map and slice_sizes[d] == operand.shape[d]:
            loops.append(Loop(operands=((0, d),), results=((0, o),)))
    if len(dn.start_index_map) == 1 and dn.start_index_map[0] in dn.collapsed_slice_dims:
        loops.append(Loop(operands=((0, dn.start_index_map[0]),), reduced=True))
    return loops


def gather_rule(ctx: RuleContext) -> list[Strategy]:
    """Ids split / table split along hidden dim / table split along vocab dim, and pairs."""
    return loop_strategies(ctx, gather_loops(ctx))


def scatter_loops(ctx: RuleContext, combinable: bool) -> list[Loop]:
    dn = ctx.params["dimension_numbers"]
    operand, indices, updates = ctx.ins[0], ctx.ins[1], ctx.ins[2]
    scatter_pos = [d for d in range(updates.rank) if d not in dn.update_window_dims]
    pairs = (tuple(dn.operand_batching_dims), tuple(dn.scatter_indices_batching_dims))
    loops = [
        batch_dim_loop(j, ((1, j), (2, scatter_pos[j])), pairs, None, combinable) for j in range(indices.rank - 1)
    ]
    window = [d for d in range(operand.rank) if d not in dn.inserted_window_dims and d not in dn.operand_batching_dims]
    for d, u in zip(window, dn.update_window_dims):
        if d not in dn.scatter_dims_to_operand_dims and updates.shape[u] == operand.shape[d]:
            loops.append(Loop(operands=((0, d), (2, u)), results=((0, d),)))
    if len(dn.scatter_dims_to_operand_dims) == 1 and dn.scatter_dims_to_operand_dims[0] in dn.inserted_window_dims:
        d = dn.scatter_dims_to_operand_dims[0]
        loops.append(Loop(operands=((0, d),), results=((0, d),)))
    return loops


def combining_scatter_rule(ctx: RuleContext) -> list[Strategy]:
    """scatter-add/min/max: partial results of split updates combine by an all-reduce."""
    return loop_strategies(ctx, [loop for loop in scatter_loops(ctx, True) if loop is not None])


def scatter_rule(ctx: RuleContext) -> list[Strategy]:
    """Overwriting (or multiplying) scatters: updates cannot be split along the indices."""
    return loop_strategies(ctx, [loop for loop in scatter_loops(ctx, False) if loop is not None])


def dynamic_slice_rule(ctx: RuleContext) -> list[Strategy]:
    """Dims taken whole may be split; sliced dims and the (scalar) start indices replicated."""
    sizes = ctx.params["slice_sizes"]
    touched = [d for d, n in enumerate(ctx.ins[0].shape) if sizes[d] != n]
    return passthrough(ctx, lambda d: ((0, d),), skip=touched)


def dynamic_update_slice_rule(ctx: RuleContext) -> list[Strategy]:
    """Dims the update covers whole follow the operand; updated dims replicated."""
    operand, update = ctx.ins[0], ctx.ins[1]
    touched = [d for d in range(operand.rank) if update.shape[d] != operand.shape[d]]
    return passthrough(ctx, lambda d: ((0, d), (1, d)), skip=touched)


RULES = {
    "gather": gather_rule,
    "scatter-add": combining_scatter_rule,
    "scatter_add": combining_scatter_rule,
    "scatter-min": combining_scatter_rule,
    "scatter-max": combining_scatter_rule,
    "scatter": scatter_rule,
    "scatter-mul": scatter_rule,
    "dynamic_slice": dynamic_slice_rule,
    "dynamic_update_slice": dynamic_update_slice_rule,
}
