"""Gradient accumulation over micro-batches, inside the unit tasks' own programs.

A pipeline stage's backward makes, every micro-batch, the tensors the update reads once per
step (the weight gradients, the loss): they are summed over the micro-batches and averaged.
As in Alpa, the sums are folded into the program that makes them: the unit task's program
takes the running sums (donated, so they are updated in place) and returns them with this
micro-batch's outputs added. Summed tensor by tensor, each sum would be a dispatch of its own
(on a stage with tens of weights those cost more than the backward itself: 2.2 ms per
micro-batch against a 1.8 ms backward, tiny GPT on simulated CPU devices); summed in a program
of their own, one more launch per RUN. Folded, a RUN is one program, as the planner charges
(``passes.pipeline.stage_parts``). The sums start each step at zero (one small program per
task, laid out as its outputs) and the average at the end of the step is one program per mesh
(neither is charged: once per step).

Shared by the in-process runtime (``runtime.pipeline``) and the mesh workers
(``runtime.mesh_worker``): floating tensors are summed, others (a step counter) keep the
last micro-batch's value.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["SummingTask", "averaged", "run_summing", "summing_task"]

_DIVIDE = None


def _divide() -> Any:
    global _DIVIDE
    if _DIVIDE is None:  # jax is imported on first use: a mesh worker sets its devices up before
        import jax

        # the count is an argument, not a constant XLA could fold into a multiplication by 1/n: the same
        # division as summing and dividing eagerly
        _DIVIDE = jax.jit(lambda xs, n: [x / n for x in xs])
    return _DIVIDE


def _inexact(dtype: Any) -> bool:
    return bool(np.issubdtype(np.dtype(dtype), np.inexact))


@dataclass(frozen=True, eq=False)
class SummingTask:
    """A per-micro-batch unit task whose outputs are summed over the micro-batches, with the sums in its program."""

    call: Callable[..., Any]
    """``call(sums, *args) -> (outputs, new sums)``: the task's program and the additions, one program; sums donated"""
    zeros: Callable[[], Any]
    """the sums at the start of a step: zeros laid out as the outputs they sum"""
    summed: tuple[int, ...]
    """the floating outputs (var ids) that are summed, in ``call``'s order"""
    kept: tuple[tuple[int, int], ...]
    """(output position, var) of the accumulated outputs that are not floating: the last micro-batch's is kept"""


def summing_task(
    fn: Callable[..., Any],
    outvars: Sequence[int],
    accumulated: frozenset[int] | set[int],
    dtypes: Mapping[int, Any],
    shapes: Sequence[tuple[int, ...]],
    out_shardings: Sequence[Any],
) -> SummingTask | None:
    """``fn`` (a unit task's program: flat arguments in, its ``outvars`` out) with its accumulated outputs
    summed in the same program; None if it makes none. ``shapes`` and ``out_shardings`` are its outputs'."""
    import jax
    import jax.numpy as jnp

    positions = [p for p, v in enumerate(outvars) if v in accumulated and _inexact(dtypes[v])]
    kept = tuple((p, v) for p, v in enumerate(outvars) if v in accumulated and not _inexact(dtypes[v]))
    if not positions and not kept:
        return None

    def call(sums: list, *args: Any) -> tuple[Any, list]:
        outs = fn(*args)
        return outs, [s + outs[p] for s, p in zip(sums, positions)]  # s + x: the order summing apart used

    zero_avals = [(tuple(shapes[p]), np.dtype(dtypes[outvars[p]])) for p in positions]
    zeros = jax.jit(lambda: [jnp.zeros(shape, dtype) for shape, dtype in zero_avals],
                    out_shardings=[out_shardings[p] for p in positions])
    return SummingTask(jax.jit(call, donate_argnums=0), zeros, tuple(outvars[p] for p in positions), kept)


def run_summing(task: SummingTask, sums: dict[int, Any], args: Sequence[Any]) -> list[Any]:
    """Run one micro-batch of ``task``, its sums in ``sums`` (updated in place; zeros at a step's first call)."""
    if task.summed and task.summed[0] not in sums:
        sums.update(zip(task.summed, task.zeros()))
    outs, new = task.call([sums[v] for v in task.summed], *args)
    sums.update(zip(task.summed, new))
    outs = list(outs)
    for p, v in task.kept:
        sums[v] = outs[p]
    return outs


def averaged(sums: Mapping[int, Any], num_microbatches: int, dtypes: Mapping[int, Any]) -> dict[int, Any]:
    """The step's values: floating sums over ``num_microbatches``, one program per mesh; the rest as they are."""
    out = dict(sums)
    per_mesh: dict[frozenset, list[int]] = {}
    for v, x in sums.items():
        if _inexact(dtypes[v]):
            per_mesh.setdefault(frozenset(d.id for d in x.devices()), []).append(v)
    for floating in per_mesh.values():
        out.update(zip(floating, _divide()([sums[v] for v in floating], num_microbatches)))
    return out
