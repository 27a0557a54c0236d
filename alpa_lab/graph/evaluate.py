"""Re-run an ``OpGraph`` op by op.

The graph keeps each op's JAX primitive and parameters, so binding them in program order
recomputes the traced function. That is how the runtime executes a plan (``on_input`` and
``on_output`` put sharding constraints on each op's operands and results) and how the tests show that tracing, with
its inlining of jit/custom_jvp/custom_vjp/checkpoint, kept the program's meaning.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, MutableMapping, Sequence

import jax

from alpa_lab.graph.opgraph import Op, OpGraph

OutputHook = Callable[[Op, list[Any]], list[Any]]
"""(op, its output values) -> the values the rest of the program sees."""
InputHook = Callable[[Op, list[Any]], list[Any]]
"""(op, its operand values) -> the values the op is applied to."""
BeforeHook = Callable[[Op, MutableMapping[int, Any]], None]
"""(op, every value so far by var id) -> None; may replace values for this op and all after it."""


def evaluate(
    graph: OpGraph,
    flat_args: Sequence[Any],
    on_output: OutputHook | None = None,
    on_input: InputHook | None = None,
    before: BeforeHook | None = None,
    scoped: bool = False,
) -> list[Any]:
    """The graph's flat outputs for ``flat_args`` (its flat inputs, in ``graph.invars`` order).

    Works eagerly and under ``jax.jit`` (values may be tracers). With ``scoped`` each op is
    bound under its own module path (``jax.named_scope(op.label)``), so a re-trace of the
    result keeps the labels that repeated-block reuse reads.
    """
    if len(flat_args) != len(graph.invars):
        raise ValueError(f"the graph takes {len(graph.invars)} flat arguments, got {len(flat_args)}")
    env: dict[int, Any] = dict(graph.consts)
    env.update(graph.literals)
    env.update(zip(graph.invars, flat_args))
    for op in graph.ops:
        if before is not None:
            before(op, env)
        args = [env[i] for i in op.inputs]
        if on_input is not None:
            args = list(on_input(op, args))
        env.update(zip(op.outputs, bind_op(op, args, on_output, scoped)))
    return [env[v] for v in graph.outvars]


def bind_op(op: Op, args: Sequence[Any], on_output: OutputHook | None = None, scoped: bool = False) -> list[Any]:
    """``op`` applied to ``args``: its output values (through ``on_output``), under its module path if ``scoped``."""
    with jax.named_scope(op.label) if scoped and op.label else contextlib.nullcontext():
        out = op.bind.bind(*args, **op.params)
    outs = list(out) if op.bind.multiple_results else [out]
    return list(on_output(op, outs)) if on_output is not None else outs


def last_uses(graph: OpGraph) -> dict[int, int]:
    """var -> the index of the last op that reads it (``len(graph.ops)`` for the program's results)."""
    last: dict[int, int] = {}
    for op in graph.ops:
        for v in op.inputs:
            last[v] = op.index
    for v in graph.outvars:
        last[v] = len(graph.ops)
    return last


def as_function(graph: OpGraph, on_output: OutputHook | None = None) -> Callable[..., Any]:
    """The graph as a function over the traced function's (pytree) arguments and results."""

    def run(*args: Any) -> Any:
        flat, tree = jax.tree_util.tree_flatten(args)
        if tree != graph.in_tree:
            raise ValueError(f"arguments do not match the traced structure:\n{tree}\nvs\n{graph.in_tree}")
        return jax.tree_util.tree_unflatten(graph.out_tree, evaluate(graph, flat, on_output))

    return run
