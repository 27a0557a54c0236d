"""The operator graph every pass reads.

``trace.py`` turns a JAX function into an ``OpGraph``: a flat list of ``Op`` (one per jaxpr
equation, with nested calls inlined) over ``Var`` (one per tensor). Ops keep the JAX
primitive and its parameters so the runtime can re-run the graph with sharding
constraints; everything a pass needs (shapes, dtypes, FLOPs, bytes, names) is plain data.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np


EXTENDED_DTYPES: dict[str, Any] = {}
"""name -> JAX's extended dtype of that name (``key<fry>``: a typed PRNG key, as flax's dropout makes)
seen by a trace; ``dtype_of`` also knows JAX's key implementations by name without one."""


@functools.lru_cache(maxsize=None)
def key_impl(name: str) -> str | None:
    """The name of JAX's PRNG implementation whose typed keys have the dtype ``name`` (``key<fry>``), or None."""
    if not name.startswith("key<"):
        return None
    import jax

    return next((impl for impl in ("threefry2x32", "rbg", "unsafe_rbg") if str(jax.random.key(0, impl=impl).dtype) == name), None)


@functools.lru_cache(maxsize=None)
def dtype_of(name: str) -> Any:
    """The dtype a graph's dtype name stands for: a NumPy dtype, or JAX's extended dtype of a PRNG key."""
    if name in EXTENDED_DTYPES:
        return EXTENDED_DTYPES[name]
    impl = key_impl(name)
    if impl is not None:
        import jax

        return jax.random.key(0, impl=impl).dtype
    return np.dtype(name)


@functools.lru_cache(maxsize=None)
def is_inexact(name: str) -> bool:
    """Floating or complex (what has a gradient and is summed over micro-batches); a key is not.

    Cached: the runtimes ask it for every summed tensor of every micro-batch (jax's ``issubdtype`` takes
    microseconds a call)."""
    import jax  # its issubdtype knows bfloat16 and float8 as floating (NumPy's does not) and keys as neither

    return bool(jax.dtypes.issubdtype(dtype_of(name), np.inexact))


@functools.lru_cache(maxsize=None)
def _itemsize(dtype: str) -> int:
    return dtype_of(dtype).itemsize  # parsing the name is most of the cost: once per dtype


@dataclass(frozen=True)
class Var:
    """A tensor of the graph.

    ``kind`` is ``"input"`` (a leaf of the traced function's arguments), ``"const"`` (an
    array the function closed over), ``"literal"`` (a scalar written into the program) or
    ``"op"`` (the output of ``producer``).
    """

    id: int
    shape: tuple[int, ...]
    dtype: str
    kind: str
    producer: int | None = None
    name: str = ""

    @functools.cached_property
    def itemsize(self) -> int:
        return _itemsize(self.dtype)

    @functools.cached_property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.itemsize

    @property
    def rank(self) -> int:
        return len(self.shape)


@dataclass(frozen=True, eq=False)
class Op:
    """One primitive application: ``outputs = primitive.bind(*inputs, **params)``.

    ``name`` is ``<primitive>_<k>``, the k-th use of that primitive in program order (among the ops the
    program needs: ``graph.trace`` makes none for dead code, as XLA would drop it), so a
    pin written against it survives re-tracing the same program. ``label`` is the source
    location in the user's model (JAX's name stack, e.g. ``transformer/Dense_0``).
    """

    index: int
    name: str
    primitive: str
    inputs: tuple[int, ...]
    outputs: tuple[int, ...]
    params: dict[str, Any] = field(repr=False)
    flops: float
    bytes_accessed: float
    label: str = ""
    bind: Any = field(default=None, repr=False, compare=False)
    """The JAX primitive object (for re-execution); never serialised."""
    signature: str = field(default="", repr=False, compare=False)
    """``graph.trace.param_signature(params)``, worked out once when traced (op keys and fingerprints read it
    for every piece a planner cuts); "" for an op made elsewhere, whose readers work it out."""


@dataclass(frozen=True, eq=False)
class OpGraph:
    """A traced program: ops in program order over vars; ``invars`` are the flat arguments."""

    vars: tuple[Var, ...]
    ops: tuple[Op, ...]
    invars: tuple[int, ...]
    outvars: tuple[int, ...]
    in_tree: Any = field(repr=False)
    out_tree: Any = field(repr=False)
    in_paths: tuple[str, ...] = ()
    out_paths: tuple[str, ...] = ()
    consts: dict[int, Any] = field(default_factory=dict, repr=False)
    literals: dict[int, Any] = field(default_factory=dict, repr=False)
    fingerprint: str = ""
    checkpoints: tuple[tuple[int, int, Any, bool], ...] = field(default=(), repr=False)
    """(first op, end op, policy, prevent_cse) of each ``jax.checkpoint`` body the trace inlined (outermost
    ones): a re-run of the program (automatic layering) checkpoints those ops again, as the user asked."""
    batch_invars: frozenset[int] = frozenset()
    """Argument vars the user named as the batch (``batch_argnums``): never state, whatever the results look like
    (``analysis.find_aliases``)."""

    def consumers(self) -> dict[int, list[int]]:
        """Var id -> indices of the ops that read it."""
        out: dict[int, list[int]] = {v.id: [] for v in self.vars}
        for op in self.ops:
            for v in op.inputs:
                out[v].append(op.index)
        return out

    def state_carries(self) -> tuple[tuple[int, int], ...]:
        """(result var, argument var) per leaf of the state, for a step that returns its first argument's
        structure first (``step(state, batch) -> (new_state, ...)``) or alone (``-> new_state``); empty for
        any other step.

        The new value of a state leaf is read next step wherever the old one was read.
        """
        ins = self.in_tree.children()
        if self.returns_state_alone:
            return tuple(zip(self.outvars, self.invars[: ins[0].num_leaves]))
        outs = self.out_tree.children() if self.out_tree.num_nodes > 1 else []
        if not ins or not outs or ins[0] != outs[0]:
            return ()
        n = ins[0].num_leaves
        return tuple(zip(self.outvars[:n], self.invars[:n]))

    @property
    def returns_state_alone(self) -> bool:
        """Whether the step returns its first argument's structure and nothing else (``-> new_state``)."""
        ins = self.in_tree.children()
        return bool(ins) and self.out_tree == ins[0]

    @property
    def total_flops(self) -> float:
        return sum(op.flops for op in self.ops)

    def summary(self) -> str:
        counts: dict[str, int] = {}
        for op in self.ops:
            counts[op.primitive] = counts.get(op.primitive, 0) + 1
        top = ", ".join(f"{k} x{v}" for k, v in sorted(counts.items(), key=lambda kv: -kv[1])[:8])
        return f"OpGraph: {len(self.ops)} ops, {len(self.vars)} vars, {self.total_flops:.3g} FLOPs ({top})"


def did_you_mean(name: str, known: list[str]) -> str:
    """"; did you mean 'a', 'b'?" for the known names closest to a mistyped one, or ""."""
    import difflib

    close = difflib.get_close_matches(name, known, n=5)
    return f"; did you mean {', '.join(repr(c) for c in close)}?" if close else ""
