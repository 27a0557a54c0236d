"""Structural facts about a traced training step that the planner and its methods use."""

from __future__ import annotations

import re
from collections.abc import Collection, Sequence

from alpa_lab.graph.opgraph import OpGraph

Leaf = tuple[str, tuple[int, ...], str]
"""An argument or result leaf as the rules below see it: (tree path, shape, dtype name)."""


def _top(path: str) -> tuple[str, str]:
    """(``[i]``, the rest) for a path into a tuple of arguments or results; ("", path) for a single result."""
    m = re.match(r"\[\d+\]", path)
    if m:
        return m.group(0), path[m.end():]
    return "", "" if path == "[]" else path  # "[]": the whole result, a single array


def state_aliases(args: Sequence[Leaf], results: Sequence[Leaf], batch: Collection[int] = ()) -> dict[int, int]:
    """Result leaf -> argument leaf it replaces (the train state), by position in each list.

    ``batch``: argument leaves the user named as the batch (``batch_argnums``), never state: an autoencoder's
    reconstruction or an inference step's output has its input's path, shape and dtype, and is not its new value.

    A result replaces an argument at the same tree path with the same shape and dtype
    (``return state, loss`` for ``step(state, batch)``). An argument none of whose leaves is
    so returned is also state when one whole result has exactly its leaves below it (the same
    paths under it, shapes and dtypes): ``return loss, state`` and ``return state`` alone. That
    second rule only applies when the first found no state at all, and only to arguments of
    several leaves (or returned as the step's only result), so a batch returned changed (an
    autoencoder's reconstruction) stays the batch. Last, the first argument, a tuple or list, returned as
    the whole result (``return new_params``, params a tuple of arrays: the result's paths are ``[0]``,
    ``[1]``, ...) is state when its leaves below its top are exactly the result's.
    """
    by_path = {path: i for i, (path, _, _) in enumerate(args) if i not in batch}
    aliases = {}
    for j, (path, shape, dtype) in enumerate(results):
        i = by_path.get(path)
        if i is not None and args[i][1:] == (shape, dtype):
            aliases[j] = i
    if aliases:
        return aliases
    groups_in: dict[str, list[int]] = {}
    for i, (path, _, _) in enumerate(args):
        if i not in batch:
            groups_in.setdefault(_top(path)[0], []).append(i)
    groups_out: dict[str, list[int]] = {}
    for j, (path, _, _) in enumerate(results):
        groups_out.setdefault(_top(path)[0], []).append(j)
    used: set[str] = set()
    for top_in, members in groups_in.items():
        if not top_in:
            continue
        leaves = sorted((_top(args[i][0])[1], args[i][1], args[i][2], i) for i in members)
        for top_out, outs in groups_out.items():
            if top_out in used or len(outs) != len(members) or (len(members) < 2 and top_out):
                continue
            mine = sorted((_top(results[j][0])[1], results[j][1], results[j][2], j) for j in outs)
            if [leaf[:3] for leaf in leaves] == [leaf[:3] for leaf in mine]:
                aliases.update({j: i for (*_, i), (*_, j) in zip(leaves, mine)})
                used.add(top_out)
                break
    if aliases or len(results) < 2:
        return aliases
    # the step returns its first argument's tuple (or list) itself, new (``return new_params`` for
    # ``step(params, batch)`` with params a tuple of arrays): the result's paths are that argument's below its top.
    # The first only: a batch returned whole (an autoencoder's pair) comes after the state it is trained with.
    whole = sorted((path, shape, dtype, j) for j, (path, shape, dtype) in enumerate(results))
    members = groups_in.get("[0]", [])
    leaves = sorted((_top(args[i][0])[1], args[i][1], args[i][2], i) for i in members)
    if [leaf[:3] for leaf in leaves] == [leaf[:3] for leaf in whole]:
        return {j: i for (*_, i), (*_, j) in zip(leaves, whole)}
    return aliases


def batch_dimension(shapes: Sequence[tuple[int, ...]]) -> int | None:
    """The batch size among data leaves' shapes: the leading dimension the most of them share (ties:
    the one whose leaves have more dimensions, then the first seen), as a batch's arrays share it and a
    class-weight vector or a raw PRNG key beside them does not; None if no leaf has a dimension."""
    score: dict[int, tuple[int, int, int]] = {}
    for order, shape in enumerate(shapes):
        if len(shape) >= 1:
            count, dims, first = score.get(shape[0], (0, 0, order))
            score[shape[0]] = (count + 1, dims + len(shape), first)
    if not score:
        return None
    return max(score, key=lambda d: (score[d][0], score[d][1], -score[d][2]))


def find_aliases(graph: OpGraph, *, named_batch: bool = False) -> dict[int, int]:
    """Outputs that replace an argument (the train state): output position -> argument var (``state_aliases``;
    never an argument the user named as the batch, ``OpGraph.batch_invars``, unless ``named_batch``: what the
    shapes alone would say, to tell a user who named the state as the batch)."""
    def leaf(path: str, v: int) -> Leaf:
        return path, tuple(graph.vars[v].shape), str(graph.vars[v].dtype)

    pairs = state_aliases(
        [leaf(p, v) for p, v in zip(graph.in_paths, graph.invars)], [leaf(p, v) for p, v in zip(graph.out_paths, graph.outvars)],
        () if named_batch else {i for i, v in enumerate(graph.invars) if v in graph.batch_invars},
    )
    return {pos: graph.invars[i] for pos, i in pairs.items()}


def classify_arguments(graph: OpGraph) -> dict[int, str]:
    """Argument var -> "param", "optimizer_state" or "data".

    State is what the step returns in place of an argument (see ``find_aliases``). A state
    leaf that the step's other results (the loss) or its gradients (``al.grad``'s marked
    gradients: a step returning only its new state reports no loss; without them, the backward ops JAX names
    ``transpose(...)``: Alpa's tests' ``jax.grad`` steps returning the new state alone) depend on is a parameter;
    state that only feeds the update of state (Adam's moments, a step counter, BatchNorm
    statistics in training) is optimizer state. Arguments not returned are data (the batch).
    """
    aliases = find_aliases(graph)
    state = set(aliases.values())
    reported = [v for pos, v in enumerate(graph.outvars) if pos not in aliases]
    gradients = [v for op in graph.ops
                 if op.primitive == "pipeline_marker" and op.params.get("kind") == "gradient" for v in op.inputs]
    if reported or gradients:
        loss_inputs = _ancestor_arguments(graph, reported + gradients)
    else:  # only the new state, differentiated by jax.grad: the parameters are the state the backward pass reads
        # (what JAX names ``transpose(...)``: its residuals come from the weights), not what only the forward reads and
        # returns updated beside the gradient (BatchNorm's statistics, taken with ``mutable=["batch_stats"]``)
        loss_inputs = _ancestor_arguments(graph, [v for op in graph.ops if "transpose(" in op.label for v in op.inputs])
    kinds = {}
    for vid in graph.invars:
        if vid not in state:
            kinds[vid] = "data"
        elif vid in loss_inputs:
            kinds[vid] = "param"
        else:
            kinds[vid] = "optimizer_state"
    return kinds


def under_autodiff(label: str) -> bool:
    """Whether an op's name stack puts it under JAX's differentiation (``jvp(...)``, or its ``transpose(...)``)."""
    return "jvp(" in label or "transpose(" in label


def _ancestor_arguments(graph: OpGraph, outputs: list[int]) -> set[int]:
    """Argument vars that any of ``outputs`` depends on."""
    seen: set[int] = set()
    stack = list(outputs)
    while stack:
        v = stack.pop()
        if v in seen:
            continue
        seen.add(v)
        producer = graph.vars[v].producer
        if producer is not None:
            stack.extend(graph.ops[producer].inputs)
    return {v for v in graph.invars if v in seen}
