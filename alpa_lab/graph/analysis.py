"""Structural facts about a traced training step that the planner and its methods use."""

from __future__ import annotations

from alpa_lab.graph.opgraph import OpGraph


def find_aliases(graph: OpGraph) -> dict[int, int]:
    """Outputs that replace an argument: same tree path, shape and dtype (the train state)."""
    by_path = {graph.in_paths[i]: vid for i, vid in enumerate(graph.invars)}
    aliases = {}
    for pos, (path, vid) in enumerate(zip(graph.out_paths, graph.outvars)):
        in_var = by_path.get(path)
        if in_var is None:
            continue
        a, b = graph.vars[in_var], graph.vars[vid]
        if a.shape == b.shape and a.dtype == b.dtype:
            aliases[pos] = in_var
    return aliases


def classify_arguments(graph: OpGraph) -> dict[int, str]:
    """Argument var -> "param", "optimizer_state" or "data".

    State is what the step returns in place of an argument (see ``find_aliases``). A state
    leaf that the step's other results (the loss) depend on is a parameter; state that only
    feeds the update of state (Adam's moments, a step counter, BatchNorm statistics in
    training) is optimizer state. Arguments not returned are data (the batch).
    """
    aliases = find_aliases(graph)
    state = set(aliases.values())
    reported = [v for pos, v in enumerate(graph.outvars) if pos not in aliases]
    loss_inputs = _ancestor_arguments(graph, reported)
    kinds = {}
    for vid in graph.invars:
        if vid not in state:
            kinds[vid] = "data"
        elif vid in loss_inputs:
            kinds[vid] = "param"
        else:
            kinds[vid] = "optimizer_state"
    return kinds


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
