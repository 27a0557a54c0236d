"""Reductions, scans, sorts and windowed ops (pooling).

A reduction may split any operand dim. A split *reduced* dim leaves each device a partial
result, combined by an all-reduce of the result tile over the splitting mesh axes (for sums
also a reduce-scatter onto an unsplit result dim: the gradient reduction of data
parallelism, sharded as in ZeRO). Ops that need the whole of an axis at once (argmax's
index, a scan, a sort, a pooling window) keep that axis replicated and split the others
freely; top_k is planned replicated (see ``top_k_rule``).
"""

from __future__ import annotations

from alpa_lab.sharding.rules.base import Loop, RuleContext, loop_strategies, normalize_axis, replicated_strategy
from alpa_lab.sharding.rules.layout import all_operands, passthrough
from alpa_lab.sharding.strategy import Strategy

SUM_REDUCTIONS = ("reduce_sum",)
OTHER_REDUCTIONS = ("reduce_max", "reduce_min", "reduce_prod", "reduce_and", "reduce_or", "reduce_xor")
SCANS = ("cumsum", "cumprod", "cummax", "cummin", "cumlogsumexp")
WINDOWED = ("reduce_window_sum", "reduce_window_max", "reduce_window_min", "select_and_scatter_add", "select_and_gather_add")


def reduction_loops(ctx: RuleContext, split_reduced: bool) -> list[Loop]:
    """Kept operand dims map, in order, to result dims; reduced dims are reduced loops."""
    axes = {normalize_axis(a, ctx.ins[0].rank) for a in ctx.params["axes"]}
    kept = [d for d in range(ctx.ins[0].rank) if d not in axes]
    loops = [Loop(operands=((0, d),), results=((0, kept.index(d)),)) for d in kept]
    if split_reduced:
        loops += [Loop(operands=((0, d),), reduced=True) for d in sorted(axes)]
    return loops


def reduce_sum_rule(ctx: RuleContext) -> list[Strategy]:
    return loop_strategies(ctx, reduction_loops(ctx, True), reduce_scatter=True)


def reduce_rule(ctx: RuleContext) -> list[Strategy]:
    """max/min/prod/and/or: partial results combine with an all-reduce of that kind."""
    return loop_strategies(ctx, reduction_loops(ctx, True))


def arg_reduce_rule(ctx: RuleContext) -> list[Strategy]:
    """argmax/argmin: an index is not combinable by an all-reduce; the axis stays whole."""
    return loop_strategies(ctx, reduction_loops(ctx, False))


def along_axis_rule(ctx: RuleContext) -> list[Strategy]:
    """Scans and sort: every dim but the one they run along may be split."""
    params = ctx.params
    axis = params.get("axis", params.get("dimension", -1))
    return passthrough(ctx, lambda d: all_operands(ctx, d), skip=(normalize_axis(axis, ctx.ins[0].rank),))


def top_k_rule(ctx: RuleContext) -> list[Strategy]:
    """Replicated only. Splitting the batch dims would be correct, but XLA lowers top_k to a
    ``TopK`` custom call that its partitioner does not split: it all-gathers the operand
    whatever the spec (jax 0.10, CPU; tests/test_rules.py pins this), so a "free" split
    strategy would hide that all-gather from the cost model."""
    return [replicated_strategy(ctx)]


def window_is_trivial(params: dict, d: int) -> bool:
    """The window neither spans, strides, pads nor dilates dim ``d``."""
    ones = ("window_dimensions", "window_strides", "base_dilation", "window_dilation")
    if any(k in params and params[k][d] != 1 for k in ones):
        return False
    return "padding" not in params or tuple(params["padding"][d]) == (0, 0)


def windowed_rule(ctx: RuleContext) -> list[Strategy]:
    """Pooling and its gradients: split only dims the window does not span (batch, channel)."""
    rank = ctx.outs[0].rank
    same = [d for d in range(rank) if all(v.shape[d] == ctx.outs[0].shape[d] for v in ctx.ins if v.rank == rank)]
    free = [d for d in same if window_is_trivial(ctx.params, d)]
    return passthrough(ctx, lambda d: all_operands(ctx, d), skip=[d for d in range(rank) if d not in free])


RULES = {
    **{prim: reduce_sum_rule for prim in SUM_REDUCTIONS},
    **{prim: reduce_rule for prim in OTHER_REDUCTIONS},
    "argmax": arg_reduce_rule,
    "argmin": arg_reduce_rule,
    **{prim: along_axis_rule for prim in SCANS + ("sort",)},
    "top_k": top_k_rule,
    **{prim: windowed_rule for prim in WINDOWED},
}
