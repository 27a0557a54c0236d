"""Pipeline markers (Alpa paper sec. 5.1): identity ops that say where the program splits.

``mark_stage_boundary(x)`` puts a ``pipeline_marker`` op (kind ``"boundary"``) on its
arguments: the identity, but a primitive of its own, so it shows up in the traced jaxpr.
It survives differentiation: its JVP marks primals and tangents alike, and its transpose
marks the cotangents, so a layer boundary in the forward pass has its mirror in the
backward pass. ``value_and_grad``/``grad`` are drop-ins for JAX's that also mark every
gradient leaf (kind ``"gradient"``, name ``"grad"``): where gradients are accumulated
across micro-batches and the weight update begins.

The sharding rule (``alpa_lab.sharding.rules.elementwise``) treats the marker as an
element-wise identity: output i takes the spec of input i, with no communication.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

__all__ = ["KINDS", "grad", "mark_stage_boundary", "pipeline_marker_p", "value_and_grad"]

KINDS = ("boundary", "gradient")

pipeline_marker_p = Primitive("pipeline_marker")
pipeline_marker_p.multiple_results = True


def _check_params(kind: str, name: str) -> None:
    if kind not in KINDS:
        raise ValueError(f"pipeline_marker kind must be one of {KINDS}, got {kind!r}")
    if not isinstance(name, str):
        raise TypeError(f"pipeline_marker name must be a str, got {type(name).__name__}")


def _impl(*xs: Any, kind: str, name: str) -> list[Any]:
    return list(xs)


def _abstract_eval(*avals: Any, kind: str, name: str) -> list[Any]:
    return list(avals)


def _batch(args: Sequence[Any], dims: Sequence[Any], *, kind: str, name: str) -> tuple[list[Any], list[Any]]:
    return pipeline_marker_p.bind(*args, kind=kind, name=name), list(dims)


def _markable(t: Any) -> bool:
    """A tangent/cotangent worth marking: not a symbolic zero, not a float0 (integer) tangent."""
    return type(t) is not ad.Zero and getattr(t, "dtype", None) != jax.dtypes.float0


def _mark_subset(values: Sequence[Any], kind: str, name: str) -> list[Any]:
    """Mark the non-zero (non-float0) values with one marker; pass the rest through."""
    values = list(values)
    idx = [i for i, v in enumerate(values) if _markable(v)]
    if idx:
        marked = pipeline_marker_p.bind(*(values[i] for i in idx), kind=kind, name=name)
        for i, m in zip(idx, marked):
            values[i] = m
    return values


def _jvp(primals: Sequence[Any], tangents: Sequence[Any], *, kind: str, name: str) -> tuple[list[Any], list[Any]]:
    out = pipeline_marker_p.bind(*primals, kind=kind, name=name)
    # symbolic zeros stay symbolic (their aval is already the tangent aval of the output,
    # which equals the input); the others get a marker of the same kind/name
    return out, _mark_subset(tangents, kind, name)


def _transpose(cts: Sequence[Any], *primals: Any, kind: str, name: str) -> list[Any]:
    marked = _mark_subset(cts, kind, name)
    out = []
    for p, ct in zip(primals, marked):
        # the marker is linear in every operand; a symbolic zero cotangent stays one
        out.append(ct if ad.is_undefined_primal(p) else None)
    return out


pipeline_marker_p.def_impl(_impl)
pipeline_marker_p.def_abstract_eval(_abstract_eval)
batching.primitive_batchers[pipeline_marker_p] = _batch
ad.primitive_jvps[pipeline_marker_p] = _jvp
ad.primitive_transposes[pipeline_marker_p] = _transpose
mlir.register_lowering(pipeline_marker_p, mlir.lower_fun(lambda *xs, **_: xs, multiple_results=True))


def mark(xs: Sequence[Any], kind: str, name: str = "") -> list[Any]:
    """Bind one marker of ``kind``/``name`` on the arrays ``xs``; returns the marked list."""
    _check_params(kind, name)
    if not xs:
        return []
    return list(pipeline_marker_p.bind(*xs, kind=kind, name=name))


def mark_stage_boundary(*xs: Any, name: str = "") -> Any:
    """Mark a pipeline-stage boundary on ``xs`` (arrays or pytrees of arrays).

    Returns the marked values: one argument gives one value back, several give a tuple.
    """
    if not xs:
        raise TypeError("mark_stage_boundary needs at least one argument")
    leaves, tree = jax.tree_util.tree_flatten(xs)
    marked = mark(leaves, "boundary", name)
    out = jax.tree_util.tree_unflatten(tree, marked)
    return out[0] if len(xs) == 1 else tuple(out)


def _mark_gradients(grads: Any) -> Any:
    def one(g: Any) -> Any:
        if getattr(g, "dtype", None) == jax.dtypes.float0 or not hasattr(g, "dtype"):
            return g
        if not np.issubdtype(np.dtype(g.dtype), np.inexact):
            return g
        return pipeline_marker_p.bind(g, kind="gradient", name="grad")[0]

    return jax.tree_util.tree_map(one, grads)


def value_and_grad(fun: Callable, argnums: int | Sequence[int] = 0, has_aux: bool = False, **kwargs: Any) -> Callable:
    """``jax.value_and_grad`` that puts a gradient marker on every gradient leaf."""
    vg = jax.value_and_grad(fun, argnums=argnums, has_aux=has_aux, **kwargs)

    def wrapped(*args: Any, **kw: Any) -> Any:
        value, grads = vg(*args, **kw)
        return value, _mark_gradients(grads)

    wrapped.__name__ = f"value_and_grad({getattr(fun, '__name__', 'fun')})"
    wrapped.__doc__ = getattr(fun, "__doc__", None)
    return wrapped


def grad(fun: Callable, argnums: int | Sequence[int] = 0, has_aux: bool = False, **kwargs: Any) -> Callable:
    """``jax.grad`` that puts a gradient marker on every gradient leaf."""
    vg = value_and_grad(fun, argnums=argnums, has_aux=has_aux, **kwargs)

    def wrapped(*args: Any, **kw: Any) -> Any:
        (value, grads) = vg(*args, **kw)
        if has_aux:
            return grads, value[1]
        return grads

    wrapped.__name__ = f"grad({getattr(fun, '__name__', 'fun')})"
    wrapped.__doc__ = getattr(fun, "__doc__", None)
    return wrapped
