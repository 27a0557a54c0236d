"""Per-primitive parallel algorithms: the sharding strategies the intra-op ILP picks from.

A registry maps each JAX primitive name to a rule (``RuleContext -> list[Strategy]``), one
module per family: ``contraction`` (dot_general, Table 3 of the Alpa paper), ``conv``,
``elementwise``, ``layout``, ``reduction`` (also scans, sort, pooling) and ``indexing``.
Most rules describe the op's loops and let ``base.loop_strategies`` enumerate them.

``strategies_for`` never fails: a primitive without a rule (control flow such as
``while``, custom calls) gets the one fully replicated strategy, which is always correct.

The planner chooses among ``planned_strategies``: heavy ops (matmuls, convolutions) split their
work over every device of the mesh, or over as many as their shapes allow (sec. 4.2: "for heavy
operators such as matmul, we do not allow replicated computation ... all parallel algorithms
always evenly divide the work to all devices"; Alpa's ``allow_recompute_heavy_op=False`` and
``allow_mixed_mesh_shape=False``). Otherwise a tiny matmul priced replicated would win on a fast
device model, and a 2-D mesh would be used as a 1-D one with its other axis recomputing everything.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import replace

from alpa_lab.cost.cluster import LogicalMesh
from alpa_lab.graph.opgraph import Op, OpGraph
from alpa_lab.sharding.rules import contraction, conv, elementwise, indexing, layout, reduction
from alpa_lab.sharding.rules.base import Rule, RuleContext, replicated_strategy
from alpa_lab.sharding.strategy import Strategy

__all__ = ["strategies_for", "planned_strategies", "has_rule", "is_follower", "RULES"]

RULES: dict[str, Rule] = {
    **contraction.RULES,
    **conv.RULES,
    **elementwise.RULES,
    **layout.RULES,
    **reduction.RULES,
    **indexing.RULES,
}

HEAVY = frozenset(contraction.RULES) | frozenset(conv.RULES)
"""Primitives whose work is split over the mesh whenever their shapes allow (never recomputed on every device)."""

FOLLOWERS = frozenset(elementwise.ELEMENTWISE) | layout.FOLLOWERS
"""Ops cheap and shape-preserving enough to take their producer's sharding (sec. 4.2)."""


def has_rule(primitive: str) -> bool:
    return primitive in RULES


def is_follower(op: Op) -> bool:
    """True for trivial one-result ops (elementwise, reshape, transpose, broadcast, ...)
    whose strategy the planner may merge into the producer of their largest operand."""
    return op.primitive in FOLLOWERS and len(op.outputs) == 1 and len(op.inputs) >= 1


def strategies_for(op: Op, graph: OpGraph, mesh: LogicalMesh) -> list[Strategy]:
    """The strategies of ``op`` on ``mesh``: never empty, replicated when nothing else fits."""
    ctx = RuleContext(op, graph, mesh)
    rule = RULES.get(op.primitive)
    if rule is None:
        return [replicated_strategy(ctx, name=f"replicated (no rule for {op.primitive})")]
    try:
        strategies = rule(ctx)
    except Exception as exc:  # a rule must not take the planner down; replicated is always right
        warnings.warn(f"sharding rule for {op.primitive} failed on {op.name}: {type(exc).__name__}: {exc}", stacklevel=2)
        return [replicated_strategy(ctx, name=f"replicated (rule for {op.primitive} failed)")]
    return _checked(ctx, strategies) or [replicated_strategy(ctx, name="replicated")]


def planned_strategies(op: Op, graph: OpGraph, mesh: LogicalMesh) -> list[Strategy]:
    """The strategies the intra-op ILP chooses among: ``strategies_for``'s, a heavy op's split over as many
    devices as its shapes allow (the module docstring says why)."""
    strategies = strategies_for(op, graph, mesh)
    if op.primitive in HEAVY and len(strategies) > 1:
        ways = [_parallelism(s, mesh.shape) for s in strategies]
        strategies = [s for s, w in zip(strategies, ways) if w == max(ways)]
    return strategies


def _parallelism(s: Strategy, mesh_shape: tuple[int, int]) -> int:
    """How many ways a heavy op's work is split: every loop of a matmul or convolution indexes an operand,
    so the mesh axes its operands use are the axes its loops are split over."""
    axes = {a for spec in s.input_specs for a in spec.mesh_axes_used}
    return math.prod(mesh_shape[a] for a in axes)


def _checked(ctx: RuleContext, strategies: list[Strategy]) -> list[Strategy]:
    """Drop duplicates and anything that does not fit the shapes; make names unique."""
    out: list[Strategy] = []
    seen_specs, names = set(), set()
    for s in strategies:
        key = (s.output_specs, s.input_specs)
        fits = len(s.input_specs) == len(ctx.ins) and len(s.output_specs) == len(ctx.outs) and all(
            spec.is_valid_for(v.shape, ctx.mesh.shape)
            for spec, v in zip(s.input_specs + s.output_specs, ctx.ins + ctx.outs)
        )
        if key in seen_specs or not fits:
            continue
        name, k = s.name, 2
        while name in names:
            name, k = f"{s.name} #{k}", k + 1
        seen_specs.add(key)
        names.add(name)
        out.append(s if name == s.name else replace(s, name=name))
    return out

