"""Pipeline markers (Alpa paper sec. 5.1): identity ops that say where the program splits.

``mark_stage_boundary(x)`` puts a ``pipeline_marker`` op (kind ``"boundary"``) on its
arguments: the identity, but a primitive of its own, so it shows up in the traced jaxpr.
It survives differentiation: its JVP marks primals and tangents alike, and its transpose
marks the cotangents, so a layer boundary in the forward pass has its mirror in the
backward pass. ``value_and_grad``/``grad`` are drop-ins for JAX's that also mark every
gradient leaf (kind ``"gradient"``, name ``"grad"``): where gradients are accumulated
across micro-batches and the weight update begins. They also mark the loss (a boundary
named ``"loss"``), whose mirror in the backward pass is where the backward starts.

Automatic layering (Alpa's ``AutoLayerOption``): inside ``auto_layers(L)``, and when the
loss function has no hand-placed boundaries, ``value_and_grad`` traces the loss function,
clusters its ops into L layers by the DP of eq. 6 (``graph.layering``) and re-runs it
with a boundary marker (``"layer1"`` ... ``"layer{L-1}"``) on every tensor crossing a
layer boundary, before differentiating; so each layer's backward is delimited too.

Argument-less boundaries (Alpa's ``mark_pipeline_boundary()``): ``mark_stage_boundary()``
with no tensor binds a marker on nothing, which says *where* the program splits but has no
tangent, so it cannot mirror itself in the backward pass. ``trace`` therefore watches for
such calls (``watch_boundaries``: the first one stops the trace) and traces the step again
with ``cutting_boundaries`` on; then ``value_and_grad`` traces its loss function to a jaxpr, and re-runs that jaxpr
with a boundary marker on every tensor live at each such point (as Alpa's manual layer
construction does), before differentiating: the cut is then the one a tensor boundary on
those tensors makes. A step without them is traced once, as before.

The sharding rule (``alpa_lab.sharding.rules.elementwise``) treats the marker as an
element-wise identity: output i takes the spec of input i, with no communication.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import math
import re
import sys
import warnings
from collections.abc import Callable, Iterator, MutableMapping, Sequence
from typing import Any

import jax
import numpy as np
from jax._src import source_info_util
from jax.extend import core as jcore
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

from alpa_lab.graph.evaluate import bind_op, evaluate, last_uses
from alpa_lab.graph.opgraph import Op, is_inexact

__all__ = [
    "KINDS", "LOSS", "BoundaryFound", "auto_layers", "automatic_layer_construction", "automatic_remat", "cutting_boundaries",
    "grad", "is_cut", "manual_layer_construction", "manual_remat",
    "forward_layers", "mark_stage_boundary", "pipeline_marker_p",
    "value_and_grad", "watch_boundaries", "watching_boundaries",
]

LOSS = "loss"
"""Name of the boundary marker on the loss; its backward mirror starts the backward pass."""

_MAX_UNITS = 1500
"""Largest op count the layering DP clusters op by op (see ``_layered``)."""

_AUTO_LAYERS: contextvars.ContextVar[int | None] = contextvars.ContextVar("alpa_lab_auto_layers", default=None)
_REMAT: contextvars.ContextVar[bool] = contextvars.ContextVar("alpa_lab_remat", default=False)
"""Whether ``value_and_grad`` runs each layer under ``jax.checkpoint`` (``auto_layers(..., remat=True)``)."""
_LAYERS_ASKED: contextvars.ContextVar[bool] = contextvars.ContextVar("alpa_lab_layers_asked", default=True)
"""Whether the user asked for the layer count (``layers=``): then a count beyond the program's is cut down, said."""
_CALLS: contextvars.ContextVar[list[str] | None] = contextvars.ContextVar("alpa_lab_boundary_calls", default=None)
"""Names of the argument-less ``mark_stage_boundary()`` calls made while ``trace`` watches."""
_CUTTING: contextvars.ContextVar[bool] = contextvars.ContextVar("alpa_lab_cutting", default=False)
"""Whether ``value_and_grad`` turns argument-less boundaries into tensor boundaries."""
_IN_VALUE_AND_GRAD: contextvars.ContextVar[bool] = contextvars.ContextVar("alpa_lab_in_value_and_grad", default=False)
"""Whether an ``alpa_lab.value_and_grad`` is differentiating (it cuts and rematerializes its loss itself)."""
_FORWARD_ONLY: contextvars.ContextVar[bool] = contextvars.ContextVar("alpa_lab_forward_only", default=False)
"""Whether a step without gradients is being cut (``forward_layers``): the layer-construction decorators cut its
loss function and mark no loss or gradients."""

_CALLS_INLINED = {"jit": "jaxpr", "pjit": "jaxpr", "closed_call": "call_jaxpr", "core_call": "call_jaxpr"}
"""Calls an argument-less boundary may sit in: pure structure, so they are inlined to cut there."""

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
    """Mark a pipeline-stage boundary on ``xs`` (arrays or pytrees of arrays), or here.

    Each leaf gets its own marker op (all with ``name``). Unnamed boundaries are told
    apart by position: the markers of one call are adjacent in the program.
    Returns the marked values: one argument gives one value back, several give a tuple.

    With no argument (Alpa's ``mark_pipeline_boundary()``), the program is cut at this
    point: every tensor computed before it and used after it crosses the boundary, as if
    each were passed here. This works inside the loss function given to
    ``alpa_lab.value_and_grad``/``alpa_lab.grad`` (also inside a ``jax.jit`` function it
    calls), where the cut can be mirrored in the backward pass; it returns None. Tracing a
    step for a pipelined plan (``alpa_lab.trace``, ``step.plan``) with one elsewhere, or inside
    ``jax.checkpoint``/``custom_vjp``/control flow, raises ``TraceError`` saying so. Outside
    a plan's tracing (run eagerly, under plain ``jax.jit``/``jax.grad``), and in a plan
    on one mesh (``ShardParallel``, ``DataParallel`` without gradient accumulation, whose
    micro-batches are traced as a pipeline's), it does nothing.
    Because it is found while the step is traced, a call inside a ``jax.jit`` function
    whose trace JAX already cached is not seen: call it in the loss function itself.
    """
    _check_params("boundary", name)
    if not xs:
        calls = _CALLS.get()
        if calls is not None:
            calls.append(name)
            if not _CUTTING.get():
                raise BoundaryFound(name)
        # the marker on nothing: a no-op when run or compiled, a position in a jaxpr
        pipeline_marker_p.bind(kind="boundary", name=name)
        return None
    leaves, tree = jax.tree_util.tree_flatten(xs)
    # one marker per leaf, so each tensor keeps its own sharding across the boundary
    marked = [pipeline_marker_p.bind(x, kind="boundary", name=name)[0] for x in leaves]
    out = jax.tree_util.tree_unflatten(tree, marked)
    return out[0] if len(xs) == 1 else tuple(out)


mark_pipeline_boundary = mark_stage_boundary
"""Alpa's name for ``mark_stage_boundary`` (``alpa.mark_pipeline_boundary()``), so Alpa code runs unchanged."""


def _mark_gradients(grads: Any) -> Any:
    def one(g: Any) -> Any:
        if getattr(g, "dtype", None) == jax.dtypes.float0 or not hasattr(g, "dtype"):
            return g
        if not jax.dtypes.issubdtype(g.dtype, np.inexact):  # a key (extended dtype) too
            return g
        return pipeline_marker_p.bind(g, kind="gradient", name="grad")[0]

    return jax.tree_util.tree_map(one, grads)


@contextlib.contextmanager
def auto_layers(num_layers: int | None, remat: bool = False, asked: bool = True) -> Iterator[None]:
    """Within this block, ``value_and_grad`` cuts unmarked loss functions into layers.

    With ``remat`` every layer (automatic or hand-marked) also runs under ``jax.checkpoint``,
    as Alpa's benchmarks ran their models: the forward keeps only each layer's inputs, and
    the backward recomputes the rest (``passes.stages`` files the recompute under the backward).
    """
    if num_layers is not None and (isinstance(num_layers, bool) or int(num_layers) != num_layers or num_layers < 1):
        raise ValueError(f"the number of layers must be a positive integer, got {num_layers!r}")
    if not isinstance(remat, bool):
        raise ValueError(f"remat must be True or False, got {remat!r}")
    token, remat_token, asked_token = _AUTO_LAYERS.set(num_layers), _REMAT.set(remat), _LAYERS_ASKED.set(asked)
    try:
        yield
    finally:
        _LAYERS_ASKED.reset(asked_token)
        _REMAT.reset(remat_token)
        _AUTO_LAYERS.reset(token)


def _mark_loss(out: Any, has_aux: bool) -> Any:
    if has_aux:
        loss, aux = out
        return mark([loss], "boundary", LOSS)[0], aux
    return mark([out], "boundary", LOSS)[0]


def _unit_starts(graph: Any, num_layers: int) -> list[int]:
    """Where the units the layering DP clusters begin (op indices, first is 0).

    A model built of repeated modules (``Block_0`` ... ``Block_23``) is cut only between
    runs of ops of one module, so layers hold whole blocks and repeated layers are equal
    (and share one intra-op solve). Otherwise, and for programs too large for the O(K^2)
    DP, units are runs of consecutive ops of equal count.
    """
    K = len(graph.ops)
    families: dict[tuple[int, str], set[str]] = {}
    parts = [op.label.split("/") for op in graph.ops]
    for comps in parts:
        for depth, c in enumerate(comps):
            m = re.fullmatch(r"(.+)_(\d+)", c)
            if m:
                families.setdefault((depth, m.group(1)), set()).add(m.group(2))
    if families:
        (depth, name), members = max(families.items(), key=lambda kv: (len(kv[1]), -kv[0][0]))
        if len(members) >= 2:
            keys = []
            for comps in parts:
                c = comps[depth] if len(comps) > depth else ""
                keys.append(c if re.fullmatch(rf"{re.escape(name)}_\d+", c) else "/".join(comps[: depth + 1]))
            starts = [0] + [i for i in range(1, K) if keys[i] != keys[i - 1]]
            if num_layers <= len(starts) <= _MAX_UNITS:
                return starts
    size = -(-K // _MAX_UNITS)
    return list(range(0, K, size))


def _layered(fun: Callable, num_layers: int, args: tuple, kwargs: dict, marked: bool = True, remat: bool | None = None) -> Callable:
    """``fun`` re-run op by op with boundary markers between its ``num_layers`` layers (``marked=False``: none, for
    ``automatic_remat``), each layer under ``jax.checkpoint`` with ``remat`` (default: ``auto_layers``' setting).

    Returns ``fun`` itself when it already has hand-placed boundaries (the user's layers win)
    or has fewer ops than layers asked for.
    """
    from alpa_lab.graph.trace import trace
    from alpa_lab.graph.layering import cluster_layers

    static = _Static(args)
    hand_back = _NNXHandBack(fun, static, kwargs)
    graph = trace(hand_back.traced, *static.arrays, traced_consts=True)
    if any(_is_boundary(op) for op in graph.ops):
        return fun
    K = len(graph.ops)
    if num_layers < 2 or K < 2:
        return fun
    starts = _unit_starts(graph, min(num_layers, K))
    unit_of = np.searchsorted(np.asarray(starts), np.arange(K), side="right") - 1
    flops = np.zeros(len(starts))
    for op in graph.ops:
        flops[unit_of[op.index]] += op.flops
    edges = [
        (int(unit_of[graph.vars[v].producer]), int(unit_of[op.index]), float(graph.vars[v].nbytes))
        for op in graph.ops
        for v in op.inputs
        if graph.vars[v].producer is not None and unit_of[graph.vars[v].producer] != unit_of[op.index]
    ]
    if len(starts) < num_layers:  # more than the program has room for
        if not _LAYERS_ASKED.get():  # the default count: a program this small stays one layer, as it always did
            return fun
        warnings.warn(  # asked for: as many as it has, said (not one, silently)
            f"layers={num_layers} is more than the loss function can be cut into ({len(starts)} pieces of its {K} ops); "
            f"cutting it into {len(starts)} layers",
            stacklevel=4,
        )
        num_layers = len(starts)
        if num_layers < 2:
            return fun
    bounds = [(starts + [K])[b] for b in cluster_layers(flops, edges, num_layers).boundaries]
    last_use = last_uses(graph)
    cuts = {b: k for k, b in enumerate(bounds[1:-1], start=1)} if marked else {}
    starts_of_layers = set(bounds[1:-1])
    remat = _REMAT.get() if remat is None else remat

    live: list[int] = []  # op-produced values some later op (or the result) reads

    def mark_cut(op: Op, env: MutableMapping[int, Any]) -> None:
        if op.index in cuts:
            live[:] = [v for v in live if last_use.get(v, -1) >= op.index]
            for v in live:  # one marker per tensor: each keeps its own sharding
                if is_inexact(graph.vars[v].dtype):
                    env[v] = mark([env[v]], "boundary", f"layer{cuts[op.index]}")[0]

    def ran(op: Op) -> None:
        live.extend(op.outputs)

    def produced(op: Op, outs: list[Any]) -> list[Any]:
        ran(op)
        return outs

    def layered(*a: Any) -> Any:
        live.clear()
        arrays = static.arrays_of(a)
        if remat:
            outs = _checkpointed(graph, arrays, starts=starts_of_layers, ran=ran, before=mark_cut)
        elif graph.checkpoints:  # the user's own jax.checkpoint bodies stay checkpointed (cut at the layers)
            outs = _checkpointed(graph, arrays, starts=set(cuts), ran=ran, before=mark_cut, regions=graph.checkpoints)
        else:
            # each op under its own module path, so labels (and the repeated-block reuse that
            # reads them) survive the re-run
            outs = evaluate(graph, arrays, on_output=produced, before=mark_cut, scoped=True)
        return hand_back.handed_back(a, jax.tree_util.tree_unflatten(graph.out_tree, outs))

    return layered


def _rematerialized(fun: Callable, args: tuple, kwargs: dict) -> Callable:
    """``fun`` (whose layers are already marked, by hand or by a cut) re-run with the ops between
    its boundary markers under ``jax.checkpoint``."""
    from alpa_lab.graph.trace import trace

    static = _Static(args)
    hand_back = _NNXHandBack(fun, static, kwargs)
    graph = trace(hand_back.traced, *static.arrays, traced_consts=True)

    def run(*a: Any) -> Any:
        outs = _checkpointed(graph, static.arrays_of(a), starts=set())
        return hand_back.handed_back(a, jax.tree_util.tree_unflatten(graph.out_tree, outs))

    return run


def _checkpointed(
    graph: Any,
    flat_args: Sequence[Any],
    starts: set[int],
    ran: Callable[[Op], None] | None = None,
    before: Callable[[Op, MutableMapping[int, Any]], None] | None = None,
    regions: Sequence[tuple[int, int, Any, bool]] | None = None,
    drop_cuts: bool = False,
) -> list[Any]:
    """``evaluate(graph, ..., scoped=True)`` with each run of ops between boundary markers (and
    between the op indices in ``starts``) as one ``jax.checkpoint`` call; the markers run outside,
    so their mirrors in the backward still delimit the layers. With ``regions`` ((first, end, policy,
    prevent_cse): the user's checkpoints, ``OpGraph.checkpoints``) only their ops are, with their policy.
    ``ran(op)`` is called for each op once its outputs are in the environment. ``drop_cuts``: argument-less
    boundaries delimit the checkpoints and are not run (``manual_remat``'s, which mark no stage).

    Under ``trace`` (which keeps the labels, ``segment_labels``), runs of identical ops (a stack of
    equal layers) call one function: JAX then traces, differentiates and transposes the body once
    (its caches are keyed by the function), not once per layer, and ``trace`` puts each op's own
    module path back on it."""
    env: dict[int, Any] = dict(graph.consts)
    env.update(graph.literals)
    env.update(zip(graph.invars, flat_args))
    K = len(graph.ops)
    last_use = last_uses(graph)
    labels = _SEGMENT_LABELS.get()
    bodies: dict[Any, Callable[..., Any]] = {}

    region_of = np.zeros(K, dtype=np.int64)  # without regions every op is checkpointed; with them: -1 plain, r region r
    if regions is not None:
        region_of[:] = -1
        for r, (first, end, _, _) in enumerate(regions):
            region_of[first:end] = r
    i = 0
    while i < K:
        if before is not None:
            before(graph.ops[i], env)
        if _is_boundary(graph.ops[i]) or region_of[i] < 0:
            op = graph.ops[i]
            if drop_cuts and is_cut(op):
                i += 1
                continue
            env.update(zip(op.outputs, bind_op(op, [env[v] for v in op.inputs], scoped=True)))
            if ran is not None:
                ran(op)
            i += 1
            continue
        j = i + 1
        while j < K and j not in starts and not _is_boundary(graph.ops[j]) and region_of[j] == region_of[i]:
            j += 1
        policy, prevent_cse = (regions[region_of[i]][2], regions[region_of[i]][3]) if regions is not None else (None, True)
        segment = graph.ops[i:j]
        made = {v for op in segment for v in op.outputs}
        ins = list(dict.fromkeys(v for op in segment for v in op.inputs if v not in made and v not in graph.literals))
        outs = [v for op in segment for v in op.outputs if last_use.get(v, -1) >= j]
        key = _segment_key(graph, segment, ins, outs, policy, prevent_cse) if labels is not None else None
        if key is None:  # a body of its own, its ops under their module paths
            body = _segment_body(graph, segment, ins, outs, tokens=False)
            values = jax.checkpoint(body, policy=policy, prevent_cse=prevent_cse)(*[env[v] for v in ins])
        else:  # the body equal segments share, called under this segment's token
            if key not in bodies:
                body = _segment_body(graph, segment, ins, outs, tokens=True)
                bodies[key] = jax.checkpoint(body, policy=policy, prevent_cse=prevent_cse)
            labels.append(tuple(op.label for op in segment))
            with jax.named_scope(SEGMENT_TOKEN.format(len(labels) - 1)):
                values = bodies[key](*[env[v] for v in ins])
        env.update(zip(outs, values))
        if ran is not None:
            for op in segment:
                ran(op)
        i = j
    return [env[v] for v in graph.outvars]


SEGMENT_TOKEN = "__alpa_segment_{}__"
"""Name scope around a shared checkpointed segment's call: which segment (an index into ``segment_labels``)."""
OP_TOKEN = "__alpa_op_{}__"
"""Name scope of an op inside a shared segment's body: its position in the segment."""
_SEGMENT_LABELS: contextvars.ContextVar[list[tuple[str, ...]] | None] = contextvars.ContextVar(
    "alpa_lab_segment_labels", default=None
)


@contextlib.contextmanager
def segment_labels() -> Iterator[list[tuple[str, ...]]]:
    """Within this block, identical checkpointed segments share one body; the list gets each
    segment call's op labels, for ``trace`` to resolve ``SEGMENT_TOKEN``/``OP_TOKEN`` scopes."""
    labels: list[tuple[str, ...]] = []
    token = _SEGMENT_LABELS.set(labels)
    try:
        yield labels
    finally:
        _SEGMENT_LABELS.reset(token)


def _segment_body(graph: Any, segment: Sequence[Op], ins: list[int], outs: list[int], tokens: bool) -> Callable[..., list[Any]]:
    """The ops of ``segment`` as a function of ``ins``' values returning ``outs``' values; each op under
    its own module path, or (``tokens``: shared by equal segments) under its position's token."""

    def body(*values: Any) -> list[Any]:
        local: dict[int, Any] = dict(graph.literals)
        local.update(zip(ins, values))
        for n, op in enumerate(segment):
            args = [local[v] for v in op.inputs]
            if tokens:
                with jax.named_scope(OP_TOKEN.format(n)):
                    out = bind_op(op, args)
            else:
                out = bind_op(op, args, scoped=True)
            local.update(zip(op.outputs, out))
        return [local[v] for v in outs]

    return body


def _segment_key(
    graph: Any, segment: Sequence[Op], ins: list[int], outs: list[int], policy: Any, prevent_cse: bool
) -> tuple | None:
    """What a segment's body computes, exactly: its ops (primitive, every parameter with its type),
    their wiring, literal values bit for bit, which values it returns, and its checkpoint's policy.
    Equal keys: one body serves both. None: a parameter is not hashable (that segment is not shared)."""
    where = {v: ("in", k) for k, v in enumerate(ins)}
    parts: list[Any] = [len(ins), policy, prevent_cse]
    for n, op in enumerate(segment):
        refs = []
        for v in op.inputs:
            if v in graph.literals:
                val = np.asarray(graph.literals[v])
                refs.append(("literal", type(graph.literals[v]).__name__, val.dtype.str, val.tobytes()))
            else:
                refs.append(where[v])
        params = tuple((k, type(p), p) for k, p in sorted(op.params.items()))
        parts.append((op.bind, params, tuple(refs)))
        for k, v in enumerate(op.outputs):
            where[v] = (n, k)
    parts.append(tuple(where[v] for v in outs))
    key = tuple(parts)
    try:
        hash(key)
    except TypeError:
        return None
    return key


def _is_boundary(op: Op) -> bool:
    return op.primitive == "pipeline_marker" and op.params["kind"] == "boundary"


class BoundaryFound(Exception):
    """An argument-less boundary met while ``trace`` watches and does not cut yet: ``trace``
    stops there and traces the step again with ``cutting_boundaries`` on."""


def is_cut(eqn_or_op: Any) -> bool:
    """An argument-less boundary (a jaxpr equation or an ``Op``): a marker on nothing."""
    prim = getattr(eqn_or_op, "primitive", None)
    prim = getattr(prim, "name", prim)
    inputs = eqn_or_op.invars if hasattr(eqn_or_op, "invars") else eqn_or_op.inputs
    return prim == "pipeline_marker" and not inputs and eqn_or_op.params["kind"] == "boundary"


def watching_boundaries() -> bool:
    """Whether an enclosing ``trace`` records argument-less boundaries (so it is the one to act)."""
    return _CALLS.get() is not None


@contextlib.contextmanager
def watch_boundaries() -> Iterator[list[str]]:
    """Within this block, argument-less ``mark_stage_boundary()`` calls are listed (their names)."""
    calls: list[str] = []
    token = _CALLS.set(calls)
    try:
        yield calls
    finally:
        _CALLS.reset(token)


@contextlib.contextmanager
def cutting_boundaries() -> Iterator[None]:
    """Within this block, ``value_and_grad`` cuts its loss function at argument-less boundaries."""
    token = _CUTTING.set(True)
    try:
        yield
    finally:
        _CUTTING.reset(token)


def _find_cuts(jaxpr: Any, where: str = "") -> bool:
    """Whether ``jaxpr`` has an argument-less boundary at its top level or in a call it may inline.

    Raises ``ValueError`` for one inside a body that cannot be cut (``jax.checkpoint``,
    ``custom_vjp``/``custom_jvp``, ``scan``/``while``/``cond``): its backward is not the
    backward of its ops, or it runs more than once.
    """
    found = False
    for eqn in jaxpr.eqns:
        if is_cut(eqn):
            if where:
                raise ValueError(
                    f"mark_stage_boundary() without arguments inside {where} cannot cut the program there "
                    "(that body is differentiated, or run, as a whole): call it between such calls, "
                    "or mark the tensors that cross: x = mark_stage_boundary(x)"
                )
            found = True
            continue
        prim = eqn.primitive.name
        for sub in jcore.jaxprs_in_params(eqn.params):
            inlined = prim in _CALLS_INLINED and not where
            found |= _find_cuts(sub, "" if inlined else where or prim)
    return found


class _NNXHandBack:
    """A loss function's in-place changes to the Flax NNX modules among its arguments (a dropout's key counter,
    BatchNorm's statistics), carried through its re-run as a program of its ops, which by itself would drop them.

    Traced (``traced``), the function returns the changed arrays beside its result; re-run (``handed_back``), they
    are put back into the modules the re-run was given, the copies ``nnx.value_and_grad`` made, which hand them on
    to the caller's modules as they do the loss's own changes. In a pipeline such a change is made every
    micro-batch: floating ones (statistics) are averaged over the micro-batches, others (a key counter) keep the
    last micro-batch's value (``runtime.accumulate``)."""

    def __init__(self, fun: Callable, static: _Static, kwargs: dict) -> None:
        self.fun, self.static, self.kwargs = fun, static, kwargs
        self.changed: list[tuple[int, int]] = []
        """(module, array) positions, in ``nnx_objects`` and ``jax.tree_util.tree_leaves`` order, that the trace changed"""

        def traced(*arrays: Any) -> Any:  # named as the loss function, for the trace's messages
            return self._traced(arrays)

        traced.__name__ = getattr(fun, "__name__", "loss")
        self.traced = traced

    def _traced(self, arrays: tuple) -> Any:
        from alpa_lab.graph.trace import nnx_objects

        args = self.static.args(arrays)
        modules = [obj for _, obj in nnx_objects(args)]
        before = {id(x) for obj in modules for x in jax.tree_util.tree_leaves(obj)}
        out = self.fun(*args, **self.kwargs)
        leaves = [jax.tree_util.tree_leaves(obj) for obj in modules]
        self.changed = [(k, i) for k, xs in enumerate(leaves) for i, x in enumerate(xs) if id(x) not in before]
        return (out, [leaves[k][i] for k, i in self.changed]) if self.changed else out

    def handed_back(self, args: tuple, result: Any) -> Any:
        if not self.changed:
            return result
        from flax import nnx

        from alpa_lab.graph.trace import nnx_objects

        out, values = result
        modules = [obj for _, obj in nnx_objects(args)]
        # each array leaf's variable (a variable holds one array; one holding none has no leaf)
        slots = [
            [v for v in jax.tree_util.tree_leaves(obj, is_leaf=lambda x: isinstance(x, nnx.Variable)) for _ in jax.tree_util.tree_leaves(v)]
            for obj in modules
        ]
        for (k, i), value in zip(self.changed, values):
            variable = slots[k][i]
            if hasattr(variable, "set_value"):  # flax >= 0.12 (the .value setter is deprecated there)
                variable.set_value(value)
            else:
                variable.value = value
        return out


class _Static:
    """The arguments of a loss function split as ``jax.grad`` passes them: arrays are traced; flags, callables
    (a module's ``apply``) and other Python values stay what they are, baked into the re-run's trace."""

    def __init__(self, args: tuple) -> None:
        self.leaves, self.tree = jax.tree_util.tree_flatten(args)
        self.traced = [jcore.valid_jaxtype(x) and not isinstance(x, (bool, int)) for x in self.leaves]
        self.arrays = [x for x, t in zip(self.leaves, self.traced) if t]

    def args(self, arrays: Sequence[Any]) -> tuple:
        """The arguments with ``arrays`` in the traced leaves' places."""
        given = iter(arrays)
        return jax.tree_util.tree_unflatten(self.tree, [next(given) if t else x for x, t in zip(self.leaves, self.traced)])

    def arrays_of(self, args: tuple) -> list[Any]:
        """The traced leaves of arguments laid out as these (the differentiated ones are JAX's tracers by then)."""
        return [x for x, t in zip(jax.tree_util.tree_leaves(args), self.traced) if t]


def _cut(fun: Callable, args: tuple, kwargs: dict) -> Callable | None:
    """``fun`` re-run from its jaxpr with a boundary marker on every tensor live at each
    argument-less ``mark_stage_boundary()``; None when it has none.

    The jaxpr keeps ``custom_vjp``/``custom_jvp`` calls and ``jax.checkpoint`` bodies whole
    (only the ``jit`` calls holding a boundary are inlined), so differentiating the re-run
    is differentiating ``fun``.
    """
    static = _Static(args)
    hand_back = _NNXHandBack(fun, static, kwargs)
    closed, out_shape = jax.make_jaxpr(hand_back.traced, return_shape=True)(*static.arrays)
    if not _find_cuts(closed.jaxpr):
        return None
    out_tree = jax.tree_util.tree_structure(out_shape)

    def cut(*a: Any) -> Any:
        outs = _Cutter().run(closed.jaxpr, closed.consts, static.arrays_of(a))
        return hand_back.handed_back(a, jax.tree_util.tree_unflatten(out_tree, outs))

    return cut


class _Cutter:
    """Evaluates a jaxpr, replacing each argument-less boundary by boundary markers on the
    values that cross it: computed before it (by an equation, not an argument or constant),
    read after it, of a float dtype (the others have no gradient to mirror).

    A boundary inside an inlined call cuts the enclosing program too: the frames of the
    calls being evaluated are searched as well, and a marked value replaces the unmarked
    one in every frame.
    """

    def __init__(self) -> None:
        self.frames: list[tuple[dict, dict, list[int]]] = []  # (env, last use, [position])
        self.computed: dict[int, Any] = {}  # id -> value (kept alive so ids stay unique)

    def run(self, jaxpr: Any, consts: Sequence[Any], args: Sequence[Any]) -> list[Any]:
        env: dict[Any, Any] = {}
        env.update(zip(jaxpr.constvars, consts))
        env.update(zip(jaxpr.invars, args))
        last: dict[Any, int] = {}
        for k, eqn in enumerate(jaxpr.eqns):
            last.update((v, k) for v in eqn.invars if isinstance(v, jcore.Var))
        last.update((v, len(jaxpr.eqns)) for v in jaxpr.outvars if isinstance(v, jcore.Var))
        here = [0]
        self.frames.append((env, last, here))

        def read(v: Any) -> Any:
            return v.val if isinstance(v, jcore.Literal) else env[v]

        try:
            for k, eqn in enumerate(jaxpr.eqns):
                here[0] = k
                # bound under the equation's own module path, so labels are those of a plain run
                name_stack = source_info_util.current_name_stack() + eqn.source_info.name_stack
                with source_info_util.user_context(eqn.source_info.traceback, name_stack=name_stack), eqn.ctx.manager:
                    if is_cut(eqn):
                        self.cut(eqn.params["name"])
                        continue
                    body = _inlined_body(eqn)
                    if body is not None:  # a jit holding a boundary: its ops run here, under its name
                        with jax.named_scope(eqn.params["name"]) if eqn.params.get("name") else contextlib.nullcontext():
                            outs = self.run(body.jaxpr, body.consts, [read(v) for v in eqn.invars])
                    else:
                        outs = eqn.primitive.bind(*map(read, eqn.invars), **eqn.primitive.get_bind_params(eqn.params))
                        outs = outs if eqn.primitive.multiple_results else [outs]
                for v, x in zip(eqn.outvars, outs):
                    env[v] = x
                    self.computed[id(x)] = x
            return [read(v) for v in jaxpr.outvars]
        finally:
            self.frames.pop()

    def cut(self, name: str) -> None:
        crossing: dict[int, Any] = {}
        for env, last, here in self.frames:
            for v, x in env.items():
                if last.get(v, -1) > here[0] and id(x) in self.computed and _inexact(x):
                    crossing.setdefault(id(x), x)
        for x in crossing.values():  # one marker per tensor: each keeps its own sharding
            marked = pipeline_marker_p.bind(x, kind="boundary", name=name)[0]
            self.computed[id(marked)] = marked
            for env, _, _ in self.frames:
                for v, y in env.items():
                    if y is x:
                        env[v] = marked


def _inlined_body(eqn: Any) -> Any:
    """The body (a ``ClosedJaxpr``) of a ``jit``-like call holding a boundary; None for any other equation."""
    body = eqn.params.get(_CALLS_INLINED[eqn.primitive.name]) if eqn.primitive.name in _CALLS_INLINED else None
    if body is None:
        return None
    closed = body if hasattr(body, "consts") else jcore.ClosedJaxpr(body, ())
    return closed if _find_cuts(closed.jaxpr) else None


def _inexact(x: Any) -> bool:
    dtype = getattr(x, "dtype", None)
    return dtype is not None and dtype != jax.dtypes.float0 and jax.dtypes.issubdtype(dtype, np.inexact)


def _prepared(fun: Callable, args: tuple, kw: dict) -> tuple[Callable, dict]:
    """The loss function as a plan's trace differentiates it, and the keyword arguments to call it with: cut at its
    argument-less boundaries (``_cut``), else cut into the layers ``auto_layers`` asks for (``_layered``), and
    with remat each layer under ``jax.checkpoint``; as it is outside a plan's trace."""
    f = _cut(fun, args, kw) if _CUTTING.get() else None
    num_layers = _AUTO_LAYERS.get()
    layered = False  # whether _layered cut it (and, with remat, checkpointed its layers)
    if f is None:
        f = _layered(fun, num_layers, args, kw) if num_layers else fun
        layered = f is not fun
    if _REMAT.get() and not layered:
        f = _rematerialized(f, args, kw if f is fun else {})
    return f, ({} if f is not fun else kw)  # the cut, layered or rematerialized function closed over them


def forward_layers(fun: Callable) -> Callable:
    """``fun``, a step without gradients (an inference pipeline's), cut as ``value_and_grad`` cuts a loss function:
    at its argument-less boundaries (a marker on every tensor that crosses each), else into the layers
    ``auto_layers`` asks for. A loss function it calls under Alpa's layer-construction decorators is cut so too,
    without the loss and gradient markers (there is no backward to mirror them)."""

    def wrapped(*args: Any, **kw: Any) -> Any:
        token = _FORWARD_ONLY.set(True)
        try:
            f, kw = _prepared(fun, args, kw)
            return f(*args, **kw)
        finally:
            _FORWARD_ONLY.reset(token)

    wrapped.__name__ = getattr(fun, "__name__", "step")
    wrapped.__doc__ = getattr(fun, "__doc__", None)
    return wrapped


def value_and_grad(fun: Callable, argnums: int | Sequence[int] = 0, has_aux: bool = False, **kwargs: Any) -> Callable:
    """``jax.value_and_grad`` that marks the loss and every gradient leaf (see module doc)."""

    def wrapped(*args: Any, **kw: Any) -> Any:
        token = _IN_VALUE_AND_GRAD.set(True)  # a manual_layer_construction loss is then cut here, not by itself
        try:
            return differentiate(*args, **kw)
        finally:
            _IN_VALUE_AND_GRAD.reset(token)

    def differentiate(*args: Any, **kw: Any) -> Any:
        f, kw = _prepared(fun, args, kw)

        def marked(*a: Any, **k: Any) -> Any:
            return _mark_loss(f(*a, **k), has_aux)

        # a Flax NNX module among the differentiated arguments is taken as nnx.value_and_grad takes it (the gradient
        # is the nnx.State of its nnx.Param variables; what the loss changes in its other variables, a dropout's key
        # counter, is put back into it): the same function does it, with the same marks
        differentiated = _nnx_value_and_grad() if _nnx_arguments(args, argnums) else jax.value_and_grad
        value, grads = differentiated(marked, argnums=argnums, has_aux=has_aux, **kwargs)(*args, **kw)
        return value, _mark_gradients(grads)

    wrapped.__name__ = f"value_and_grad({getattr(fun, '__name__', 'fun')})"
    wrapped.__doc__ = getattr(fun, "__doc__", None)
    return wrapped


def _nnx_arguments(args: tuple, argnums: int | Sequence[int]) -> tuple[int, ...]:
    """The positions among ``argnums`` that hold a Flax NNX graph object (a module) rather than a pytree of arrays."""
    nnx = sys.modules.get("flax.nnx")
    if nnx is None:  # never imported: no argument can be one
        return ()
    positions = (argnums,) if isinstance(argnums, int) else tuple(argnums)
    return tuple(i for i in positions if i < len(args) and nnx.graph.is_graph_node(args[i]))


def _nnx_value_and_grad() -> Callable:
    from flax import nnx

    return nnx.value_and_grad


@jax.custom_vjp
def _gradient_point(x: Any) -> Any:
    """The identity, whose backward puts a gradient marker on the cotangent: on a loss function's argument, the
    marker lands on its gradient, as ``alpa_lab.grad`` marks the gradients it returns."""
    return x


def _gradient_point_fwd(x: Any) -> tuple[Any, None]:
    return x, None


def _gradient_point_bwd(_: None, g: Any) -> tuple[Any]:
    return (_mark_gradients(g),)


_gradient_point.defvjp(_gradient_point_fwd, _gradient_point_bwd)


def _is_scalar(x: Any) -> bool:
    return getattr(x, "shape", None) == () and _inexact(x)


def manual_layer_construction(
    fun: Callable | None = None, *, lift_markers: bool = False, remat_layer: bool = False, static_argnums: Sequence[int] = (),
) -> Callable:
    """Alpa's decorator for a loss function whose ``mark_pipeline_boundary()`` calls cut the program, so that
    ``jax.grad(manual_layer_construction(loss_func))`` pipelines as ``alpa_lab.grad(loss_func)`` does.

    While a plan traces the step, the loss runs as ``alpa_lab.grad`` would run it (``_prepared``): with a boundary
    marker on every tensor that crosses each argument-less boundary, which plain ``jax.grad`` differentiates like
    any marked tensor (without one, cut into the layers an ``AutoLayerOption`` asks for); with ``remat_layer``
    (or the method's ``ManualLayerOption(remat_layer=True)``) each layer under ``jax.checkpoint``. Its loss and,
    through its arguments' backward, its gradients are marked as ``alpa_lab.grad`` marks them. Run eagerly or under
    plain ``jax.jit`` it is ``loss_func``. ``lift_markers`` is accepted (the boundaries are always where you put
    them); ``static_argnums`` is not: Python values are kept static as they are.
    """
    _no_static_argnums("manual_layer_construction", static_argnums)
    if fun is None:  # @manual_layer_construction(...) with options
        return lambda f: manual_layer_construction(f, lift_markers=lift_markers, remat_layer=remat_layer)
    return _layer_constructed(fun, None, remat_layer)


def automatic_layer_construction(
    fun: Callable | None = None, *, layer_num: int | None = None, remat_layer: bool = False,
    static_argnums: Sequence[int] = (), eps: float = 0.6, cost_criteria: str = "flops", layer_eps: float = 0.0,
) -> Callable:
    """Alpa's decorator that cuts a loss function into ``layer_num`` layers of balanced cost, so that
    ``jax.grad(automatic_layer_construction(loss_func, layer_num=2))`` pipelines as ``alpa_lab.grad`` with
    ``AutoLayerOption(layer_num=2)`` does (``layer_num=None``: the method's layer option says how many).
    ``remat_layer``: each layer under ``jax.checkpoint``. ``eps``, ``cost_criteria`` and ``layer_eps`` (Alpa's
    clustering knobs) are accepted; this planner's layering balances on its own terms. Run eagerly or under plain
    ``jax.jit`` it is ``loss_func``."""
    _no_static_argnums("automatic_layer_construction", static_argnums)
    if layer_num is not None and (isinstance(layer_num, bool) or not isinstance(layer_num, (int, np.integer)) or layer_num < 1):
        raise ValueError(f"automatic_layer_construction(layer_num=...) must be a positive integer, got {layer_num!r}")
    if fun is None:
        return lambda f: automatic_layer_construction(f, layer_num=layer_num, remat_layer=remat_layer)
    return _layer_constructed(fun, None if layer_num is None else int(layer_num), remat_layer)


def manual_remat(fun: Callable | None = None, *, static_argnums: Sequence[int] = (), lift_markers: bool = False) -> Callable:
    """Alpa's decorator: ``fun`` with each piece between its ``mark_pipeline_boundary()`` calls under
    ``jax.checkpoint``, so that the backward recomputes a piece's activations from its inputs instead of keeping
    them. The argument-less boundaries then only say where to rematerialize (they cut no pipeline stages, as in
    Alpa; ``manual_layer_construction(remat_layer=True)`` does both). The numbers are ``fun``'s; it works
    eagerly, under ``jax.jit``/``jax.grad`` and in any plan. ``lift_markers`` is accepted; ``static_argnums`` is
    not (Python values are kept static as they are)."""
    _no_static_argnums("manual_remat", static_argnums)
    if fun is None:
        return lambda f: manual_remat(f, lift_markers=lift_markers)
    _check_callable("manual_remat", fun)

    @functools.wraps(fun)
    def wrapped(*args: Any, **kw: Any) -> Any:
        return _remat_at_boundaries(fun, args, kw)

    return wrapped


def automatic_remat(
    fun: Callable | None = None, *, static_argnums: Sequence[int] = (), layer_num: int | str | None = None,
    eps: float = 0.6, cost_criteria: str = "flops", layer_eps: float = 0.0,
) -> Callable:
    """Alpa's decorator: ``fun`` cut into ``layer_num`` layers of balanced cost (as ``automatic_layer_construction``
    cuts it), each under ``jax.checkpoint``, with no stage boundaries between them. ``layer_num="auto"`` (or
    None): about the square root of the number of pieces the program can be cut into (Chen et al.'s rule, which
    keeps O(sqrt n) activations; Alpa searches for it instead). A function with its own
    ``mark_pipeline_boundary()`` calls is rematerialized at those (``manual_remat``). ``eps``, ``cost_criteria``
    and ``layer_eps`` are accepted, as in ``automatic_layer_construction``."""
    _no_static_argnums("automatic_remat", static_argnums)
    if layer_num is not None and layer_num != "auto" and (
            isinstance(layer_num, bool) or not isinstance(layer_num, (int, np.integer)) or layer_num < 1):
        raise ValueError(f"automatic_remat(layer_num=...) must be a positive integer or 'auto', got {layer_num!r}")
    if fun is None:
        return lambda f: automatic_remat(f, layer_num=layer_num)
    _check_callable("automatic_remat", fun)

    @functools.wraps(fun)
    def wrapped(*args: Any, **kw: Any) -> Any:
        with _unwatched():
            num = layer_num
            if num is None or num == "auto":
                static = _Static(args)
                graph = _trace_alone(_NNXHandBack(fun, static, kw).traced, static.arrays)
                if any(is_cut(op) for op in graph.ops):
                    return _remat_at_boundaries(fun, args, kw)
                num = max(1, round(math.sqrt(len(_unit_starts(graph, 1)))))
            token = _LAYERS_ASKED.set(layer_num not in (None, "auto"))
            try:
                f = _layered(fun, int(num), args, kw, marked=False, remat=True) if num > 1 else fun
            finally:
                _LAYERS_ASKED.reset(token)
            if f is fun:
                return _remat_at_boundaries(fun, args, kw)
            return f(*args)

    return wrapped


def _check_callable(where: str, fun: Any) -> None:
    if not callable(fun):
        raise TypeError(f"{where} decorates a function (the loss function), got {type(fun).__name__}: {fun!r}")


@contextlib.contextmanager
def _unwatched() -> Iterator[None]:
    """Within this block a function traced on its own (by a remat decorator) is not the enclosing plan's trace: its
    argument-less boundaries are ops of its program, not calls that plan watches or cuts."""
    calls, cutting = _CALLS.set(None), _CUTTING.set(False)
    try:
        yield
    finally:
        _CUTTING.reset(cutting)
        _CALLS.reset(calls)


def _trace_alone(fn: Callable, arrays: Sequence[Any]) -> Any:
    from alpa_lab.graph.trace import trace

    with _unwatched():
        return trace(fn, *arrays, traced_consts=True, cut=False)


def _remat_at_boundaries(fun: Callable, args: tuple, kw: dict) -> Any:
    """``fun(*args, **kw)`` re-run with the ops between its boundaries under ``jax.checkpoint`` and its argument-less
    boundaries dropped (one piece, all checkpointed, when it has none)."""
    static = _Static(args)
    hand_back = _NNXHandBack(fun, static, kw)
    graph = _trace_alone(hand_back.traced, static.arrays)
    outs = _checkpointed(graph, static.arrays, starts=set(), drop_cuts=True)
    return hand_back.handed_back(args, jax.tree_util.tree_unflatten(graph.out_tree, outs))


def _no_static_argnums(where: str, static_argnums: Sequence[int]) -> None:
    if tuple(static_argnums or ()):
        raise ValueError(f"{where}(static_argnums={tuple(static_argnums)}) is not supported: pass Python values of the "
                         "loss function positionally as they are (they are kept static), or close over them")


def _layer_constructed(fun: Callable, layer_num: int | None, remat_layer: bool) -> Callable:
    """``fun`` that, while a plan traces the step and no ``alpa_lab.value_and_grad`` takes its gradient, runs as
    that one would run it (``_prepared``, with ``layer_num`` automatic layers and remat if asked) with its loss
    and its gradients marked; as it is otherwise (both Alpa decorators)."""

    def wrapped(*args: Any, **kw: Any) -> Any:
        if _IN_VALUE_AND_GRAD.get() or not watching_boundaries():  # alpa_lab.grad cuts it, or no plan is traced
            return fun(*args, **kw)
        tokens = []
        if layer_num is not None:
            tokens.append((_AUTO_LAYERS, _AUTO_LAYERS.set(layer_num)))
        if remat_layer:
            tokens.append((_REMAT, _REMAT.set(True)))
        try:
            f, kw = _prepared(fun, args, kw)
        finally:
            for var, token in reversed(tokens):
                var.reset(token)
        if _FORWARD_ONLY.get():  # an inference step's: cut, with no loss or gradients to mark
            return f(*args, **kw)
        # what alpa_lab.value_and_grad marks around jax's: the loss, and (through the arguments' backward) every
        # gradient leaf, so the pipeline tells the forward and backward from the update
        args = jax.tree_util.tree_map(lambda a: _gradient_point(a) if _inexact(a) else a, args)
        out = f(*args, **kw)
        if _is_scalar(out):
            return _mark_loss(out, False)
        if isinstance(out, (tuple, list)) and len(out) == 2 and _is_scalar(out[0]):  # (loss, aux): has_aux=True
            return _mark_loss(tuple(out), True)
        return out

    wrapped.__name__ = getattr(fun, "__name__", "loss_func")
    wrapped.__doc__ = getattr(fun, "__doc__", None)
    wrapped.__wrapped__ = fun  # type: ignore[attr-defined]
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
