"""Elementwise ops: every result element depends on the same element of each operand.

So any spec of the result works with no communication, as long as each operand arrives in
the same spec. jaxprs broadcast only scalars and, since recent JAX, size-1 dims of
same-rank operands (``eq(x[2,8,1], iota[1,1,4])`` in ``one_hot``); those operands are
replicated along the broadcast dims, since every device needs all of them.
"""

from __future__ import annotations

from alpa_lab.sharding.rules.base import (
    Loop,
    RuleContext,
    loop_strategies,
    matching_operand_dims,
    same_dim_loops,
)
from alpa_lab.sharding.strategy import Strategy

BINARY = (
    "add", "add_any", "sub", "mul", "div", "max", "min", "pow", "atan2", "rem", "and", "or",
    "xor", "eq", "ne", "lt", "le", "gt", "ge", "select_n", "clamp", "nextafter", "complex",
    "shift_left", "shift_right_logical", "shift_right_arithmetic", "igamma", "igammac",
    "igamma_grad_a", "polygamma", "zeta", "mulhi", "random_gamma_grad", "threefry2x32",
)
UNARY = (
    "neg", "exp", "exp2", "log", "log1p", "tanh", "logistic", "sqrt", "rsqrt", "cbrt",
    "integer_pow", "square", "abs", "sign", "floor", "ceil", "round", "erf", "erfc",
    "erf_inv", "is_finite", "not", "convert_element_type", "stop_gradient", "copy", "copy_p",
    "cos", "sin", "tan", "acos", "asin", "atan", "cosh", "sinh", "acosh", "asinh", "atanh",
    "expm1", "imag", "real", "conj", "reduce_precision", "lgamma", "digamma", "bessel_i0e",
    "bessel_i1e", "population_count", "clz", "bitcast_convert_type",
    "one_minus_square",  # 1 - x*x: tanh's derivative in newer JAX
)
MARKERS = ("pipeline_marker",)
"""``alpa_lab.graph.markers``: the identity on each operand, so output i follows input i."""
ELEMENTWISE = BINARY + UNARY + MARKERS


def elementwise_rule(ctx: RuleContext) -> list[Strategy]:
    """One strategy per spec of the result; same-shape operands follow it."""
    if any(v.shape != ctx.outs[0].shape for v in ctx.outs):
        return []  # results of different shapes: not elementwise, caller falls back
    rank = ctx.outs[0].rank
    return loop_strategies(ctx, same_dim_loops(ctx, rank, lambda d: matching_operand_dims(ctx, d)))


def marker_rule(ctx: RuleContext) -> list[Strategy]:
    """A pipeline marker: output i is input i, so it takes input i's spec, for free.

    One operand: one strategy per spec (and a follower of its producer). Several operands
    of one shape: the strategies giving every operand the same spec. Operands of different
    shapes: only the replicated strategy (the caller's fallback); a per-operand choice is
    not one op strategy.
    """
    if not ctx.ins or any(v.shape != ctx.ins[0].shape for v in ctx.ins + ctx.outs):
        return []
    rank = ctx.ins[0].rank
    loops = [
        Loop(operands=tuple((t, d) for t in range(len(ctx.ins))), results=tuple((t, d) for t in range(len(ctx.outs))))
        for d in range(rank)
    ]
    return loop_strategies(ctx, loops)


RULES = {prim: elementwise_rule for prim in BINARY + UNARY}
RULES.update({prim: marker_rule for prim in MARKERS})
