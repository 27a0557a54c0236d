"""Contractions: ``dot_general`` (Alpa paper, Table 3, generalised to any einsum).

``C[b, i, j] = sum_k A[b, i, k] B[b, k, j]`` has four kinds of loops: batch ``b`` (in A, B
and C), lhs-free ``i`` (A and C), rhs-free ``j`` (B and C) and contracting ``k`` (A and B,
reduced). Every batch, free and contracting dimension of the ``dimension_numbers`` is its
own loop, so a mesh axis may go to any one of several free dims; splitting a contracting
dim leaves partial sums, summed by an all-reduce of the output tile or reduce-scattered
onto an output dim that is not split yet.
"""

from __future__ import annotations

from typing import Sequence

from alpa_lab.sharding.rules.base import Loop, RuleContext, loop_strategies
from alpa_lab.sharding.spec import ShardingSpec
from alpa_lab.sharding.strategy import Strategy


def dot_general_loops(ctx: RuleContext) -> list[Loop]:
    """Loops of a dot_general; output dims are batch, then lhs free, then rhs free (XLA order)."""
    (lc, rc), (lb, rb) = ctx.params["dimension_numbers"]
    lhs_rank, rhs_rank = ctx.ins[0].rank, ctx.ins[1].rank
    lhs_free = [d for d in range(lhs_rank) if d not in lc and d not in lb]
    rhs_free = [d for d in range(rhs_rank) if d not in rc and d not in rb]
    loops = [Loop(operands=((0, a), (1, b)), results=((0, o),)) for o, (a, b) in enumerate(zip(lb, rb))]
    out = len(lb)
    for d in lhs_free:
        loops.append(Loop(operands=((0, d),), results=((0, out),)))
        out += 1
    for d in rhs_free:
        loops.append(Loop(operands=((1, d),), results=((0, out),)))
        out += 1
    loops += [Loop(operands=((0, a), (1, b)), reduced=True) for a, b in zip(lc, rc)]
    return loops


def dot_name(outs: Sequence[ShardingSpec], ins: Sequence[ShardingSpec]) -> str:
    """``"S0S1 = S0R x RS1"``, the naming of Table 3."""
    return f"{outs[0]} = {ins[0]} x {ins[1]}"


def dot_general_rule(ctx: RuleContext) -> list[Strategy]:
    """Table 3 generalised: each mesh axis to one batch/free/contracting dim, or unused."""
    return loop_strategies(ctx, dot_general_loops(ctx), reduce_scatter=True, name_fn=dot_name)


RULES = {"dot_general": dot_general_rule}
