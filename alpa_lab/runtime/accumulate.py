"""Gradient accumulation over micro-batches, as one program per unit task.

A pipeline stage's backward makes, every micro-batch, the tensors the update reads once per
step (the weight gradients, the loss): they are summed over the micro-batches and averaged.
Summed tensor by tensor, each sum is a dispatch of its own, and on a stage with tens of
weights those dispatches cost more than the backward itself (measured: 2.2 ms per
micro-batch against a 1.8 ms backward, tiny GPT on simulated CPU devices). Here a unit
task's sums are one jitted program, and the average at the end of the step one per mesh, so a
stage's RUN instruction costs its program and one more launch, as the planner charges
(``passes.pipeline.stage_parts``; the average, once per step, is not charged).

Shared by the in-process runtime (``runtime.pipeline``) and the mesh workers
(``runtime.mesh_worker``): floating tensors are summed, others (a step counter) keep the
last micro-batch's value.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from alpa_lab.graph.opgraph import is_inexact

__all__ = ["accumulate", "averaged"]

_ADD = None
_DIVIDE = None


def _programs() -> tuple[Any, Any]:
    global _ADD, _DIVIDE
    if _ADD is None:  # jax is imported on first use: a mesh worker sets its devices up before
        import jax

        _ADD = jax.jit(lambda sums, xs: [s + x for s, x in zip(sums, xs)])
        # the count is an argument, not a constant XLA could fold into a multiplication by 1/n: the same
        # division as summing and dividing eagerly
        _DIVIDE = jax.jit(lambda xs, n: [x / n for x in xs])
    return _ADD, _DIVIDE


def accumulate(sums: dict[int, Any], made: Sequence[tuple[int, Any]], dtypes: Mapping[int, Any]) -> None:
    """Add one micro-batch's ``(var, value)`` pairs into ``sums`` (in place), in one program.

    The first value of a tensor is kept as it is; a tensor that is not floating keeps the latest.
    """
    add, _ = _programs()
    pairs = [(v, x) for v, x in made if v in sums and is_inexact(dtypes[v])]
    for v, x in made:
        if v not in sums or not is_inexact(dtypes[v]):
            sums[v] = x
    if pairs:
        for (v, _), total in zip(pairs, add([sums[v] for v, _ in pairs], [x for _, x in pairs])):
            sums[v] = total


def averaged(sums: Mapping[int, Any], num_microbatches: int, dtypes: Mapping[int, Any]) -> dict[int, Any]:
    """The step's values: floating sums over ``num_microbatches``, one program per mesh; the rest as they are."""
    _, divide = _programs()
    out = dict(sums)
    per_mesh: dict[frozenset, list[int]] = {}
    for v, x in sums.items():
        if is_inexact(dtypes[v]):
            per_mesh.setdefault(frozenset(d.id for d in x.devices()), []).append(v)
    for floating in per_mesh.values():
        out.update(zip(floating, divide([sums[v] for v in floating], num_microbatches)))
    return out
