"""Trace a JAX function into an ``OpGraph``.

``jax.make_jaxpr`` gives the program as equations; calls that only structure the program
(nested ``jit``, ``custom_jvp``/``custom_vjp`` wrappers, ``checkpoint``) are inlined so that
every op the planner sees is a real computation. Their custom derivative rules are not
needed: the traced function is the whole training step, already differentiated.
Control flow (``scan``, ``while``, ``cond``) stays one op; it has no sharding rule and is
planned replicated.

A step that calls ``mark_stage_boundary()`` without arguments is traced twice: the second
time with ``markers.cutting_boundaries`` on, so that ``value_and_grad`` puts boundary
markers on the tensors crossing each such point (see ``graph.markers``).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import math
import re
import sys
from collections.abc import Sequence
from typing import Any, Callable

import jax
import numpy as np
from jax._src import source_info_util
from jax.extend import core as jcore

from alpa_lab._gc import quiet_gc
from alpa_lab.graph import markers
from alpa_lab.graph.analysis import find_aliases, under_autodiff
from alpa_lab.graph.opgraph import EXTENDED_DTYPES, Op, OpGraph, Var

# primitive -> name of the param holding the body to inline
INLINED_CALLS = {
    "jit": "jaxpr",
    "pjit": "jaxpr",
    "closed_call": "call_jaxpr",
    "core_call": "call_jaxpr",
    "custom_jvp_call": "call_jaxpr",
    "custom_vjp_call": "call_jaxpr",
    "custom_vjp_call_jaxpr": "fun_jaxpr",
    "remat": "jaxpr",
    "remat2": "jaxpr",
    "checkpoint": "jaxpr",
}

ELEMENTWISE_FLOP_FREE = {
    "convert_element_type", "broadcast_in_dim", "reshape", "transpose", "squeeze", "expand_dims",
    "slice", "dynamic_slice", "dynamic_update_slice", "concatenate", "pad", "gather", "select_n",
    "copy", "copy_p", "stop_gradient", "iota", "rev", "pipeline_marker",
}


_SEGMENT_RE = re.compile(re.escape(markers.SEGMENT_TOKEN).replace(r"\{\}", r"(\d+)"))
_OP_RE = re.compile(re.escape(markers.OP_TOKEN).replace(r"\{\}", r"(\d+)"))


class TraceError(ValueError):
    """The function could not be traced with the example arguments."""


@quiet_gc()
def trace(
    fn: Callable, *args: Any, traced_consts: bool = False, cut: bool = True, batch_leaves: Sequence[bool] | None = None
) -> OpGraph:
    """Trace ``fn(*args)`` into an OpGraph (args are example arrays or pytrees of them).

    ``traced_consts`` lets ``fn`` close over tracers of an enclosing transformation (the
    graph is then only valid inside that trace); ``value_and_grad``'s automatic layering
    traces a loss function that way from inside the training step.
    ``cut=False`` is for a plan on one mesh (not traced per micro-batch): an argument-less
    ``mark_stage_boundary()`` is then a no-op wherever it is, as under ``jax.jit`` and as
    Alpa's ``ShardParallel`` treats a model written with ``mark_pipeline_boundary()``.
    ``batch_leaves``: which flat arguments the user named as the batch (``OpGraph.batch_invars``).
    """
    if batch_leaves is not None:
        return with_batch(trace(fn, *args, traced_consts=traced_consts, cut=cut), batch_leaves)
    if markers.watching_boundaries() or not cut:  # inside another trace, that one handles boundaries
        return _trace(fn, args, traced_consts)
    with markers.watch_boundaries() as calls:
        try:
            graph = _trace(fn, args, traced_consts)
        except markers.BoundaryFound:  # stopped at the first one: no use tracing the rest
            graph = None
    if graph is not None and not calls and not any(markers.is_cut(op) for op in graph.ops):
        return graph
    with markers.watch_boundaries(), markers.cutting_boundaries():
        graph = _trace(fn, args, traced_consts)
    stray = [op for op in graph.ops if markers.is_cut(op)]
    if stray and not any(under_autodiff(op.label) for op in graph.ops):
        return graph  # a program with no backward (an evaluation): nothing to mirror, the markers are no-ops
    if stray:
        where = stray[0].label or "the step's top level"
        if under_autodiff(where):  # inside jax.grad: the usual case of code written for jax.grad
            raise TraceError(
                f"could not trace {getattr(fn, '__name__', fn)!r}: mark_stage_boundary() without arguments (at {where}) "
                "is inside a gradient that jax.grad / jax.value_and_grad takes, which cannot mirror the cut in the "
                "backward pass: take the gradient with alpa_lab.grad / alpa_lab.value_and_grad (the same arguments), "
                "decorate the loss function with @alpa_lab.manual_layer_construction (as Alpa's code does), or mark the "
                "tensors that cross: x = mark_stage_boundary(x)"
            )
        raise TraceError(
            f"could not trace {getattr(fn, '__name__', fn)!r}: mark_stage_boundary() without arguments (at {where}) "
            "is outside the loss function given to alpa_lab.value_and_grad / alpa_lab.grad, where the cut cannot "
            "be mirrored in the backward pass: move it into the loss function, or mark the tensors that cross: "
            "x = mark_stage_boundary(x)"
        )
    return graph


def with_batch(graph: OpGraph, batch_leaves: Sequence[bool]) -> OpGraph:
    """``graph`` with the flat arguments ``batch_leaves`` marks as the user's batch (``OpGraph.batch_invars``), kept
    only where that changes what is state: otherwise the program (and its fingerprint) is the unnamed one's."""
    named = dataclasses.replace(graph, batch_invars=frozenset(v for v, b in zip(graph.invars, batch_leaves, strict=True) if b))
    return graph if find_aliases(named) == find_aliases(graph) else _with_fingerprint(named)


def static_hint(exc: BaseException | None, args: tuple) -> str:
    """What to do when the step branched in Python on an argument that is a Python value: numbers and bools are
    traced as arrays unless ``static_argnums`` names them (Alpa's "auto" would make them static)."""
    for _ in range(8):  # the JAX error may sit under our own wrappers (a pipelined step's micro-batch trace)
        if exc is None or isinstance(exc, jax.errors.ConcretizationTypeError):
            break
        exc = exc.__cause__
    if not isinstance(exc, jax.errors.ConcretizationTypeError):
        return ""
    plain = [f"argument {i} ({a!r})" for i, a in enumerate(args) if isinstance(a, (bool, int, float, str))]
    if not plain:
        return ""
    positions = ", ".join(str(i) for i, a in enumerate(args) if isinstance(a, (bool, int, float, str)))
    return (
        f"\n{', '.join(plain)} is a Python value, traced as an array: make it static with "
        f"parallelize(..., static_argnums=({positions},)) (each new value plans anew), or close over it "
        "(functools.partial(step, flag=...))"
    )


class _LostUpdates(Exception):
    """The step changed Flax NNX objects among its arguments in place and returned none of the changes."""


class LostUpdatesError(TraceError):
    """``trace``'s refusal of a step that changes Flax NNX objects among its arguments in place and returns none
    of it. A parallelized step catches it and traces ``with_nnx_changes(step)`` instead, as ``nnx.jit`` does."""


def with_nnx_changes(fn: Callable) -> Callable:
    """``fn`` that also returns the Flax NNX objects among its arguments, as they are after it ran, so that a step
    written for ``nnx.jit`` (it changes its model and optimizer in place and returns the loss) hands the changes
    back; ``write_back_nnx`` puts them into the caller's objects.

    The program is then the functional form that returns the changed objects: ``(*args, out)`` with every leaf of
    the arguments that is not in an NNX object left out (None), so each object's arrays come back at the tree
    paths they came in at, which is how the planner tells the state (returned in place) from the batch."""
    nnx = _nnx()

    @functools.wraps(fn)
    def step(*args: Any) -> tuple:
        out = fn(*args)
        kept = jax.tree_util.tree_map(lambda x: x if nnx.graph.is_graph_node(x) else None, args, is_leaf=nnx.graph.is_graph_node)
        return (*kept, out)

    return step


def write_back_nnx(args: tuple, results: tuple) -> Any:
    """What the step returned, after putting the state of the NNX objects ``with_nnx_changes`` returned with it into
    the caller's objects among ``args`` (they change in place, as under ``nnx.jit``)."""
    nnx = _nnx()
    for (_, mine), (_, changed) in zip(nnx_objects(args), nnx_objects(tuple(results[:-1]))):
        nnx.update(mine, nnx.state(changed))
    return results[-1]


def _nnx() -> Any:
    from flax import nnx

    return nnx


def nnx_objects(args: tuple) -> list[tuple[str, Any]]:
    """(where, object) of each Flax NNX graph object (a module, an optimizer) among ``args``, outermost ones only."""
    nnx = sys.modules.get("flax.nnx")
    if nnx is None:  # never imported: no argument can be one
        return []
    found, _ = jax.tree_util.tree_flatten_with_path(args, is_leaf=nnx.graph.is_graph_node)
    return [(f"args[{p[0].idx}]" + jax.tree_util.keystr(p[1:]), x) for p, x in found if nnx.graph.is_graph_node(x)]


def _check_no_lost_updates(fn: Callable, watched: list[tuple[str, Any]], before: set[int], out: Any) -> None:
    """Refuse a step that changes the NNX objects ``watched`` among its arguments in place
    (``optimizer.update(model, grads)``, a dropout's key counter) without returning them: as under ``jax.jit``, the
    caller's objects would not change, and the training would silently not train. Changes that the step also
    returns are fine. ``before``: the ids of their arrays before the step ran."""
    returned = {id(x) for x in jax.tree_util.tree_leaves(out)}
    lost = [
        f"{where}{jax.tree_util.keystr(path)}"
        for where, obj in watched
        for path, x in jax.tree_util.tree_flatten_with_path(obj)[0]
        if id(x) not in before and id(x) not in returned
    ]
    if lost:
        raise _LostUpdates(
            f"{getattr(fn, '__name__', fn)!r} changes Flax NNX objects among its arguments in place "
            f"({', '.join(lost[:4])}{', ...' if len(lost) > 4 else ''}: {len(lost)} arrays) and returns none of it; a "
            "program traced from it as it stands (as jax.jit traces it) would leave the caller's objects unchanged, so "
            "the changes would be lost. Call it as a parallelized step in this process (each call hands them back, as "
            "nnx.jit does), or return the new state: split outside the step (graphdef, state = nnx.split((model, "
            "optimizer))), merge inside it (model, optimizer = nnx.merge(graphdef, state)), and return "
            "nnx.state((model, optimizer)) with the loss; or return the changed objects themselves"
        )


def _trace(fn: Callable, args: tuple, traced_consts: bool) -> OpGraph:
    def fresh(*a: Any) -> Any:
        # a new function each time: JAX caches traces by function identity, and the same
        # step traced inside ``auto_layers`` is another program (it has layer markers)
        # NNX objects among the arguments are watched for changes made in place (an object stays itself when
        # changed); a loss function traced inside a step (automatic layering) is not: its changes come back through
        # its re-run (``markers._NNXHandBack``) into the step, which returns them
        watched = [] if traced_consts else nnx_objects(a)
        before = {id(x) for _, obj in watched for x in jax.tree_util.tree_leaves(obj)}
        out = fn(*a)
        if watched:
            _check_no_lost_updates(fn, watched, before, out)
        return out

    try:
        # return_shape: the output structure from the same trace (eval_shape would trace again)
        with markers.segment_labels() as segments:
            closed, out_shape = jax.make_jaxpr(fresh, return_shape=True)(*args)
    except markers.BoundaryFound:  # for ``trace`` to trace again, cutting
        raise
    except _LostUpdates as exc:
        raise LostUpdatesError(f"could not plan {exc}") from None
    except jax.errors.UnexpectedTracerError as exc:  # newer JAX finds the leak while tracing (older: _Builder.const)
        raise TraceError(f"could not trace {getattr(fn, '__name__', fn)!r}: {_LEAKED}.\nJAX says: {exc}") from exc
    except Exception as exc:  # the user's own code failed: say so, keep their traceback
        raise TraceError(
            f"could not trace {getattr(fn, '__name__', fn)!r} with the given example arguments: "
            f"{type(exc).__name__}: {exc}"
        ) from exc
    flat_args, in_tree = jax.tree_util.tree_flatten_with_path(args)
    flat_out, out_tree = jax.tree_util.tree_flatten_with_path(out_shape)
    builder = _Builder(traced_consts, segments)
    env: dict[Any, int] = {}
    invars = []
    try:
        for v, const in zip(closed.jaxpr.constvars, closed.consts):
            env[v] = builder.const(v.aval, const)
        for v, (path, _) in zip(closed.jaxpr.invars, flat_args):
            vid = builder.new_var(v.aval, "input", name=_path_str(path))
            env[v] = vid
            invars.append(vid)
        builder.emit_jaxpr(closed.jaxpr, env, prefix="")
    except TraceError as exc:
        raise TraceError(f"could not trace {getattr(fn, '__name__', fn)!r}: {exc}") from None
    outvars = tuple(builder.read(env, v) for v in closed.jaxpr.outvars)
    graph = OpGraph(
        vars=tuple(builder.vars),
        ops=tuple(builder.ops),
        invars=tuple(invars),
        outvars=outvars,
        in_tree=jax.tree_util.tree_structure(args),
        out_tree=jax.tree_util.tree_structure(out_shape),
        in_paths=tuple(_path_str(p) for p, _ in flat_args),
        out_paths=tuple(_path_str(p) for p, _ in flat_out),
        consts=builder.consts,
        literals=builder.literals,
        checkpoints=tuple(builder.checkpoints),
    )
    return _with_fingerprint(graph)


def _path_str(path: tuple) -> str:
    return jax.tree_util.keystr(path) or "[]"


_LEAKED = (
    "a traced value escaped its transformation, e.g. a custom_vjp/custom_jvp function closing over an array "
    "computed inside the step (JAX raises UnexpectedTracerError when running it); pass that array as an "
    "argument, or use jax.closure_convert"
)


class _Builder:
    def __init__(self, traced_consts: bool = False, segments: Sequence[tuple[str, ...]] = ()) -> None:
        self.traced_consts = traced_consts
        self.segments = segments
        self.vars: list[Var] = []
        self.ops: list[Op] = []
        self.consts: dict[int, Any] = {}
        self.literals: dict[int, Any] = {}
        self.counts: dict[str, int] = {}
        self.checkpoints: list[tuple[int, int, Any, bool]] = []
        self._in_checkpoint = False
        self._const_ids: dict[int, tuple[Any, int]] = {}

    def const(self, aval: Any, value: Any) -> int:
        """A var for a closed-over array; the same array object gets the same var.

        Inlining a jit body once per call site would otherwise copy its consts each time.
        """
        is_tracer = isinstance(value, jax.core.Tracer)
        if is_tracer and not self.traced_consts:
            raise TraceError(f"it closes over a traced value ({type(value).__name__} {aval.str_short()}): {_LEAKED}")
        seen = self._const_ids.get(id(value))
        if seen is not None and seen[0] is value:
            return seen[1]
        keep = is_tracer or jax.dtypes.issubdtype(aval.dtype, jax.dtypes.extended)  # a typed key has no NumPy form
        vid = self.new_var(aval, "const", value=value if keep else np.asarray(value))
        self._const_ids[id(value)] = (value, vid)  # keeps value alive so its id is not reused
        return vid

    def new_var(self, aval: Any, kind: str, producer: int | None = None, name: str = "", value: Any = None) -> int:
        vid = len(self.vars)
        self.vars.append(Var(vid, tuple(map(int, aval.shape)), _dtype_name(aval.dtype), kind, producer, name))
        if kind == "const":
            self.consts[vid] = value
        elif kind == "literal":
            self.literals[vid] = value
        return vid

    def read(self, env: dict, v: Any) -> int:
        if isinstance(v, jcore.Literal):
            return self.new_var(v.aval, "literal", value=v.val)
        return env[v]

    def name_stack(self, eqn: Any, segment: int | None) -> tuple[str, int | None]:
        """``eqn``'s module path, and the shared segment it belongs to (``markers._checkpointed``): a
        segment's token scope is dropped and each op token becomes the path of the op at that position
        in that segment's call, so an op of a shared body reads as it would have unshared."""
        stack = eqn.source_info.name_stack
        if not self.segments:
            return str(stack), segment
        elems = []
        for e in stack.stack:
            if isinstance(e, source_info_util.Scope):
                if m := _SEGMENT_RE.fullmatch(e.name):
                    segment = int(m.group(1))
                    continue
                if segment is not None and (m := _OP_RE.fullmatch(e.name)):
                    label = self.segments[segment][int(m.group(1))]
                    if label:
                        elems.append(source_info_util.Scope(label))
                    continue
            elems.append(e)
        return str(source_info_util.NameStack(tuple(elems))), segment

    def emit_jaxpr(
        self, jaxpr: Any, env: dict, prefix: str, segment: int | None = None, used_outputs: Sequence[bool] | None = None
    ) -> None:
        """Ops for ``jaxpr``'s live equations (``live_equations``: those ``used_outputs`` of its results need);
        ``segment``: the shared segment whose call this body is. A dead equation makes no op and no name."""
        live = live_equations(jaxpr, used_outputs)
        for eqn, keep in zip(jaxpr.eqns, live):
            if not keep:
                continue
            name_stack, inner_segment = self.name_stack(eqn, segment)
            label = "/".join(p for p in (prefix, name_stack) if p)
            prim = eqn.primitive.name
            if prim in INLINED_CALLS and INLINED_CALLS[prim] in eqn.params:
                body = eqn.params[INLINED_CALLS[prim]]
                inner = body.jaxpr if hasattr(body, "jaxpr") else body
                consts = body.consts if hasattr(body, "consts") else []
                inner_env: dict[Any, int] = {}
                for cv, c in zip(inner.constvars, consts):
                    inner_env[cv] = self.const(cv.aval, c)
                args = [self.read(env, v) for v in eqn.invars]
                # custom_jvp/vjp calls pass their consts first; the body's invars cover all
                for iv, a in zip(inner.invars, args[len(args) - len(inner.invars):]):
                    inner_env[iv] = a
                sub = eqn.params.get("name", "") if prim in ("jit", "pjit") else ""
                outermost = prim in ("checkpoint", "remat", "remat2") and not self._in_checkpoint
                first = len(self.ops)
                self._in_checkpoint |= outermost
                used = [keep is True or ov in keep for ov in eqn.outvars]
                self.emit_jaxpr(inner, inner_env, "/".join(p for p in (label, sub) if p), inner_segment, used)
                if outermost:
                    self._in_checkpoint = False
                    if len(self.ops) > first:
                        self.checkpoints.append(
                            (first, len(self.ops), eqn.params.get("policy"), bool(eqn.params.get("prevent_cse", True)))
                        )
                for ov, iv, u in zip(eqn.outvars, inner.outvars, used):
                    if u:  # a result nothing reads was not made
                        env[ov] = self.read(inner_env, iv)
                continue
            inputs = tuple(self.read(env, v) for v in eqn.invars)
            index = len(self.ops)
            outputs = tuple(self.new_var(v.aval, "op", producer=index) for v in eqn.outvars)
            for v, vid in zip(eqn.outvars, outputs):
                env[v] = vid
            k = self.counts.get(prim, 0)
            self.counts[prim] = k + 1
            in_vars = [self.vars[i] for i in inputs]
            out_vars = [self.vars[i] for i in outputs]
            params = dict(eqn.params)
            self.ops.append(
                Op(
                    index=index,
                    name=f"{prim}_{k}",
                    primitive=prim,
                    inputs=inputs,
                    outputs=outputs,
                    params=params,
                    flops=op_flops(prim, params, in_vars, out_vars),
                    # a marker is the identity: it compiles to nothing, so it moves no bytes
                    bytes_accessed=0.0 if prim == "pipeline_marker" else float(sum(v.nbytes for v in in_vars + out_vars)),
                    label=label,
                    bind=eqn.primitive,
                    signature=param_signature(params),
                )
            )


KEPT_WHEN_DEAD = frozenset({"pipeline_marker"})
"""Equations kept even where nothing reads their results: our stage and gradient markers say where the user
cut the program, which the slicing reads."""


def live_equations(jaxpr: Any, used_outputs: Sequence[bool] | None = None) -> list[Any]:
    """Per equation of ``jaxpr``, whether the program needs it: True, or for a call to inline the set of its
    results something reads (its body is then made for those alone).

    An equation is live when a live equation or a used result of ``jaxpr`` reads one of its results, or when it
    has effects (a callback, a print). What is dead is what XLA would drop when compiling the step: the forward
    that ``model.init`` runs to find shapes, a derivative nobody reads. Planning it would price work that never
    runs and reshardings to serve it (it held a parallelized initialisation's weights whole, to feed a dead matmul).
    """
    outs = jaxpr.outvars if used_outputs is None else [v for v, u in zip(jaxpr.outvars, used_outputs) if u]
    needed = {v for v in outs if isinstance(v, jcore.Var)}
    live: list[Any] = [False] * len(jaxpr.eqns)
    for i in range(len(jaxpr.eqns) - 1, -1, -1):
        eqn = jaxpr.eqns[i]
        read = [v for v in eqn.outvars if v in needed]
        if not (read or eqn.effects or eqn.primitive.name in KEPT_WHEN_DEAD):
            continue
        prim = eqn.primitive.name
        inlined = prim in INLINED_CALLS and INLINED_CALLS[prim] in eqn.params
        live[i] = set(read) if inlined and len(read) < len(eqn.outvars) and not eqn.effects else True
        needed.update(v for v in eqn.invars if isinstance(v, jcore.Var))
    return live


@functools.lru_cache(maxsize=None)
def _dtype_name(dtype: Any) -> str:
    if jax.dtypes.issubdtype(dtype, jax.dtypes.extended):  # a typed PRNG key: kept by name for dtype_of
        EXTENDED_DTYPES[str(dtype)] = dtype
        return str(dtype)
    return np.dtype(dtype).name


def op_flops(prim: str, params: dict, ins: list[Var], outs: list[Var]) -> float:
    """FLOPs of one op: 2*M*N*K for contractions, one per output element for math."""
    out_elems = sum(math.prod(v.shape) for v in outs)
    if prim == "dot_general":
        (lc, _), _ = params["dimension_numbers"]
        k = math.prod(ins[0].shape[d] for d in lc)
        return 2.0 * out_elems * k
    if prim == "conv_general_dilated":
        dn = params["dimension_numbers"]
        rhs = ins[1].shape
        kernel_spatial = math.prod(rhs[d] for d in dn.rhs_spec[2:])
        in_ch = rhs[dn.rhs_spec[1]]
        # lhs dilation (the input gradient of a strided conv) inserts zeros between inputs:
        # only 1 / prod(dilation) of the kernel taps meet a real input
        dilation = math.prod(params.get("lhs_dilation") or (1,))
        return 2.0 * out_elems * kernel_spatial * in_ch / dilation
    if prim.startswith("reduce_") or prim in ("argmax", "argmin", "cumsum", "cumprod", "cummax"):
        return float(sum(math.prod(v.shape) for v in ins[:1]))
    if prim in ELEMENTWISE_FLOP_FREE:
        return 0.0
    return float(out_elems)


def leaf_aval(x: Any, shape: Sequence[int] | None = None) -> jax.ShapeDtypeStruct:
    """An argument leaf's shape and dtype as ``jax.jit`` sees them (``shape`` in place of its own):
    an array's dtype, canonical (float64 -> float32 unless x64 is on), and a Python scalar's
    (a flax ``TrainState``'s ``step=0``, a learning rate) as JAX types it, int32/float32/bool."""
    try:
        dtype = x.dtype if hasattr(x, "dtype") else jax.numpy.result_type(x)
    except TypeError as e:  # what jax.jit refuses too: say which leaf, in our words
        raise TraceError(
            f"a {type(x).__name__} ({repr(x)[:60]}) is not an array, number or bool, so JAX cannot take it as a "
            "step argument: close over it in the step, or keep it out of the arguments' pytree"
        ) from e
    shape = tuple(np.shape(x)) if shape is None else tuple(shape)
    # weak, as jit makes a Python scalar: ``params - lr * grads`` keeps a bfloat16 model bfloat16
    weak = bool(getattr(x, "weak_type", not hasattr(x, "dtype")))
    return jax.ShapeDtypeStruct(shape, jax.dtypes.canonicalize_dtype(dtype, allow_extended_dtype=True), weak_type=weak)


def args_signature(args: Any) -> Any:
    """The arguments' tree structure and each leaf's shape and dtype: what a trace depends on, so a
    cache key for traced programs (``ParallelizedStep``, ``Plan.jit``, a training run's program)."""
    leaves, tree = jax.tree_util.tree_flatten(args)
    try:
        avals = [leaf_aval(x) for x in leaves]
    except TraceError as e:  # name the argument it is
        for path, x in jax.tree_util.tree_flatten_with_path(args)[0]:
            try:
                leaf_aval(x)
            except TraceError:
                raise TraceError(f"argument {_path_str(path)}: {e}") from e.__cause__
        raise
    return tree, tuple((a.shape, str(a.dtype), a.weak_type) for a in avals)


def param_signature(params: dict) -> str:
    """Parameters that define an op's meaning, as text (bodies of control flow by size)."""
    parts = []
    for k in sorted(params):
        v = params[k]
        if hasattr(v, "eqns") or hasattr(v, "jaxpr"):
            inner = v.jaxpr if hasattr(v, "jaxpr") else v
            parts.append(f"{k}=<jaxpr {len(inner.eqns)} eqns>")
        elif isinstance(v, (tuple, list)) and v and (hasattr(v[0], "eqns") or hasattr(v[0], "jaxpr")):
            parts.append(f"{k}=<{len(v)} jaxprs>")
        elif isinstance(v, (int, float, str, bool, tuple, type(None))) or hasattr(v, "_fields"):
            parts.append(f"{k}={v!r}")
        else:
            parts.append(f"{k}=<{type(v).__name__}>")
    return ",".join(parts)


def _with_fingerprint(graph: OpGraph) -> OpGraph:
    """Hash of the program: ops, wiring, shapes, defining parameters, and the values of its literals and constants
    (a step traced with other static arguments, ``api.StaticArgs``, may differ in those alone, and its compiled
    program must not be taken for the other's)."""
    h = hashlib.sha256()
    for v in graph.vars:
        h.update(f"{v.id}:{v.shape}:{v.dtype}:{v.kind};".encode())
    for op in graph.ops:
        h.update(f"{op.name}:{op.inputs}:{op.outputs}:{op.signature or param_signature(op.params)};".encode())
    h.update(f"{graph.invars}->{graph.outvars}".encode())
    if graph.batch_invars:  # which results are new state, and so what the program returns in place
        h.update(f"batch {sorted(graph.batch_invars)}".encode())
    for vid in sorted(graph.literals):
        h.update(f"{vid}={_value_digest(graph.literals[vid], graph.vars[vid].dtype)};".encode())
    for vid in sorted(graph.consts):
        h.update(f"{vid}={_value_digest(graph.consts[vid], graph.vars[vid].dtype)};".encode())
    return dataclasses.replace(graph, fingerprint=h.hexdigest()[:16])


def _value_digest(value: Any, dtype: str) -> str:
    """A literal's or constant's value as hashed text: its bytes in the var's dtype where it has a NumPy form (a
    literal 1 may come as a Python int or a 0-d array, as the argument it meets is weakly typed or not: one value),
    else its type."""
    try:
        arr = np.asarray(value, dtype=np.dtype(dtype))
    except Exception:  # noqa: BLE001 - a tracer or a typed key: no concrete value to hash
        return f"<{type(value).__name__}>"
    if arr.dtype == object:
        return f"<{type(value).__name__}>"
    return f"{arr.dtype}{arr.shape}:{hashlib.sha256(np.ascontiguousarray(arr).tobytes()).hexdigest()[:16]}"
