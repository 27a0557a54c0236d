"""Convolutions: ``conv_general_dilated`` as a contraction over input channels.

``out[n, o, ...] = sum_{c, window} lhs[n, c, ...] * rhs[o, c, window]``: batch ``n`` and
output channel ``o`` are free loops, input channel ``c`` is a reduced one (split => the
output is a partial sum, all-reduced). Spatial dims stay replicated: splitting them needs
halo exchange, which these strategies do not model.

The weight-gradient conv reuses the same rule: its "input channel" loop is the data batch,
so the rule gives data parallelism's gradient all-reduce.

Grouped convolutions (``feature_group_count`` or ``batch_group_count`` > 1) are planned
replicated. In principle whole groups and the batch could be split, but XLA (jax 0.10,
CPU, Shardy and GSPMD alike) all-gathers the operands of any sharded grouped conv, and for
the weight gradient of one (``batch_group_count`` > 1) with its contracting dim split over
one axis of a 2x2 mesh it even computes wrong results; a strategy claiming either would
hide that communication from the cost model or be wrong (tests/test_rules.py pins this).
"""

from __future__ import annotations

from typing import Sequence

from alpa_lab.sharding.rules.base import Loop, RuleContext, loop_strategies
from alpa_lab.sharding.spec import ShardingSpec
from alpa_lab.sharding.strategy import Strategy


def conv_specs(ctx: RuleContext) -> tuple[Sequence[int], Sequence[int], Sequence[int]]:
    """(lhs_spec, rhs_spec, out_spec): positions of (batch|out-feature, feature|in-feature, spatial...)."""
    dn = ctx.params.get("dimension_numbers")
    if dn is None:  # lax default: NC..., OI..., NC...
        rank = ctx.ins[0].rank
        return (tuple(range(rank)),) * 3
    return dn.lhs_spec, dn.rhs_spec, dn.out_spec


def conv_loops(ctx: RuleContext) -> list[Loop]:
    """Batch, output channel, input channel (reduced); none for grouped convs (module doc)."""
    if ctx.params.get("feature_group_count", 1) != 1 or ctx.params.get("batch_group_count", 1) != 1:
        return []
    lhs, rhs, out = conv_specs(ctx)
    return [
        Loop(operands=((0, lhs[0]),), results=((0, out[0]),)),
        Loop(operands=((1, rhs[0]),), results=((0, out[1]),)),
        Loop(operands=((0, lhs[1]), (1, rhs[1])), reduced=True),
    ]


def conv_name(outs: Sequence[ShardingSpec], ins: Sequence[ShardingSpec]) -> str:
    return f"{outs[0]} = {ins[0]} * {ins[1]}"


def conv_rule(ctx: RuleContext) -> list[Strategy]:
    """Batch, output-channel and input-channel splits and their pairs on the two mesh axes."""
    return loop_strategies(ctx, conv_loops(ctx), reduce_scatter=True, name_fn=conv_name)


RULES = {"conv_general_dilated": conv_rule}
