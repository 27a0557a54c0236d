"""Layout ops: they move or copy elements without arithmetic.

Each result dimension comes from at most one operand dimension; a result spec can be served
by the same split of that operand dimension as long as each device's operand tile holds
exactly the elements of its result tile. Dimensions an op reads unevenly (the concatenated
dim, padded, sliced, reversed or tiled dims, broadcast size-1 dims) are kept replicated:
splitting them would need communication the op does not model.
"""

from __future__ import annotations

import math
from typing import Callable, Sequence

from alpa_lab.sharding.rules.base import Dim, Loop, RuleContext, loop_strategies, same_dim_loops
from alpa_lab.sharding.strategy import Strategy


def passthrough(ctx: RuleContext, dims_of: Callable[[int], tuple[Dim, ...]], skip: Sequence[int] = ()) -> list[Strategy]:
    """Any split of the result dims not in ``skip``; ``dims_of(d)`` follows result dim ``d``."""
    return loop_strategies(ctx, same_dim_loops(ctx, ctx.outs[0].rank, dims_of, skip))


def all_operands(ctx: RuleContext, d: int) -> tuple[Dim, ...]:
    """Dim ``d`` of every non-scalar operand (ops whose operands share the result's layout)."""
    return tuple((t, d) for t, v in enumerate(ctx.ins) if v.rank > d)


def broadcast_in_dim_rule(ctx: RuleContext) -> list[Strategy]:
    """New result dims split freely; kept dims follow the operand; size-1 broadcasts are R."""
    bdims = ctx.params["broadcast_dimensions"]
    src = {o: e for e, o in enumerate(bdims) if ctx.ins[0].shape[e] == ctx.outs[0].shape[o]}
    return passthrough(ctx, lambda d: ((0, src[d]),) if d in src else ())


def transpose_rule(ctx: RuleContext) -> list[Strategy]:
    perm = ctx.params["permutation"]
    return passthrough(ctx, lambda d: ((0, perm[d]),))


def squeeze_rule(ctx: RuleContext) -> list[Strategy]:
    removed = {d % ctx.ins[0].rank for d in ctx.params["dimensions"]}
    kept = [d for d in range(ctx.ins[0].rank) if d not in removed]
    return passthrough(ctx, lambda d: ((0, kept[d]),))


def expand_dims_rule(ctx: RuleContext) -> list[Strategy]:
    added = {d % ctx.outs[0].rank for d in ctx.params["dimensions"]}
    src = [d for d in range(ctx.outs[0].rank) if d not in added]
    return passthrough(ctx, lambda d: ((0, src.index(d)),) if d in src else ())


def reshape_groups(in_shape: Sequence[int], out_shape: Sequence[int]) -> list[tuple[list[int], list[int]]]:
    """Pair up runs of operand and result dims (size-1 dims dropped) with equal products."""
    ins = [d for d, n in enumerate(in_shape) if n != 1]
    outs = [d for d, n in enumerate(out_shape) if n != 1]
    groups, i, j = [], 0, 0
    while i < len(ins) and j < len(outs):
        gi, gj = [ins[i]], [outs[j]]
        i, j = i + 1, j + 1
        while math.prod(in_shape[d] for d in gi) != math.prod(out_shape[d] for d in gj):
            if math.prod(in_shape[d] for d in gi) < math.prod(out_shape[d] for d in gj):
                gi.append(ins[i])
                i += 1
            else:
                gj.append(outs[j])
                j += 1
        groups.append((gi, gj))
    return groups


def reshape_rule(ctx: RuleContext) -> list[Strategy]:
    """Split the major dim of a group of merged/split dims on both sides, nothing else.

    Splitting the major operand dim of a group by ``n`` gives each device a contiguous
    1/n of the group's elements, which is the same block as splitting the major result dim
    by ``n``; the shapes must divide (checked when specs are validated). Any other split
    (a minor dim of a merge) would interleave devices' data: not offered.
    ``dimensions`` (a transpose before the reshape) maps the operand dims first.
    """
    order = ctx.params.get("dimensions") or tuple(range(ctx.ins[0].rank))
    permuted = [ctx.ins[0].shape[d] for d in order]
    loops = [
        Loop(operands=((0, order[gi[0]]),), results=((0, gj[0]),))
        for gi, gj in reshape_groups(permuted, ctx.outs[0].shape)
    ]
    return loop_strategies(ctx, loops)


def rev_rule(ctx: RuleContext) -> list[Strategy]:
    return passthrough(ctx, lambda d: ((0, d),), skip=ctx.params["dimensions"])


def concatenate_rule(ctx: RuleContext) -> list[Strategy]:
    return passthrough(ctx, lambda d: all_operands(ctx, d), skip=(ctx.params["dimension"],))


def pad_rule(ctx: RuleContext) -> list[Strategy]:
    """Padded dims replicated; the padding value is a scalar."""
    touched = [d for d, cfg in enumerate(ctx.params["padding_config"]) if any(int(c) != 0 for c in cfg)]
    return passthrough(ctx, lambda d: ((0, d),), skip=touched)


def slice_rule(ctx: RuleContext) -> list[Strategy]:
    """Dims the slice keeps whole may be split; sliced ones are replicated."""
    touched = [d for d, (a, b) in enumerate(zip(ctx.ins[0].shape, ctx.outs[0].shape)) if a != b]
    strides = ctx.params.get("strides") or ()
    touched += [d for d, s in enumerate(strides) if s not in (None, 1)]
    return passthrough(ctx, lambda d: ((0, d),), skip=touched)


def split_rule(ctx: RuleContext) -> list[Strategy]:
    axis = ctx.params["axis"] % ctx.ins[0].rank
    return passthrough(ctx, lambda d: ((0, d),), skip=(axis,))


def tile_rule(ctx: RuleContext) -> list[Strategy]:
    reps = tuple(ctx.params["reps"])
    if len(reps) != ctx.ins[0].rank or ctx.ins[0].rank != ctx.outs[0].rank:
        return []
    return passthrough(ctx, lambda d: ((0, d),), skip=[d for d, r in enumerate(reps) if r != 1])


def iota_rule(ctx: RuleContext) -> list[Strategy]:
    """Each device makes its own tile of the counter: any spec, no operands."""
    return passthrough(ctx, lambda d: ())


def random_bits_rule(ctx: RuleContext) -> list[Strategy]:
    """Each device draws its own tile of the bits, from the whole key (a batch of keys split as its draws).

    Threefry drawn partitionably (``jax_threefry_partitionable``, JAX's default) makes an element's bits a
    function of the key and the element's index alone, as the counter of ``iota`` is, so a tile costs a tile's
    work and the values are the unsplit draw's. This is what lets a parallelized initialisation (weights drawn
    with ``model.init``) make each device's part of a weight, as Alpa's does, where replicated draws would make
    every device draw all of it. Other generators (``rbg``) are left replicated.
    """
    import jax  # the flag is read when a program is planned, as JAX reads it when one is traced

    key = ctx.ins[0]
    if not key.dtype.startswith("key<fry>") or not jax.config.jax_threefry_partitionable:
        return []
    return passthrough(ctx, lambda d: ((0, d),) if d < key.rank else ())


RULES = {
    "broadcast_in_dim": broadcast_in_dim_rule,
    "transpose": transpose_rule,
    "squeeze": squeeze_rule,
    "expand_dims": expand_dims_rule,
    "reshape": reshape_rule,
    "rev": rev_rule,
    "concatenate": concatenate_rule,
    "pad": pad_rule,
    "slice": slice_rule,
    "split": split_rule,
    "tile": tile_rule,
    "iota": iota_rule,
    "random_bits": random_bits_rule,
}

FOLLOWERS = frozenset({"broadcast_in_dim", "transpose", "squeeze", "expand_dims", "reshape", "rev"})
