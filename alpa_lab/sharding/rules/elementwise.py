"""Elementwise ops: every result element depends on the same element of each operand.

So any spec of the result works with no communication, as long as each operand arrives in
the same spec. jaxprs broadcast only scalars and, since recent JAX, size-1 dims of
same-rank operands (``eq(x[2,8,1], iota[1,1,4])`` in ``one_hot``); those operands are
replicated along the broadcast dims, since every device needs all of them.
"""

from __future__ import annotations

from alpa_lab.sharding.rules.base import RuleContext, loop_strategies, matching_operand_dims, same_dim_loops
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
)
ELEMENTWISE = BINARY + UNARY


def elementwise_rule(ctx: RuleContext) -> list[Strategy]:
    """One strategy per spec of the result; same-shape operands follow it."""
    if any(v.shape != ctx.outs[0].shape for v in ctx.outs):
        return []  # results of different shapes: not elementwise, caller falls back
    rank = ctx.outs[0].rank
    return loop_strategies(ctx, same_dim_loops(ctx, rank, lambda d: matching_operand_dims(ctx, d)))


RULES = {prim: elementwise_rule for prim in ELEMENTWISE}
