"""A piece of a program as a program of its own (a pipeline stage, a layer, a unit task).

The inter-op pass plans and runs pieces of one traced step: a layer's forward and
backward (to price it on a logical mesh), a stage (to plan its shardings), a stage's
forward on one micro-batch (to run it). Each piece is an ``OpGraph`` whose arguments are
the tensors it reads but does not compute and whose results are the tensors others read.
Op names, labels and argument/result paths are kept, so pins and the train state's
aliasing (argument path == result path) mean the same in the piece as in the whole.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from alpa_lab.graph.opgraph import Op, OpGraph, Var
from alpa_lab.graph.trace import _with_fingerprint


@dataclass(frozen=True, eq=False)
class Subgraph:
    """``graph``: the piece, renumbered; ``invars``/``outvars``: its arguments and results as
    var ids of the *whole* program (in the piece's order); ``var_map``: whole id -> piece id."""

    graph: OpGraph
    invars: tuple[int, ...]
    outvars: tuple[int, ...]
    var_map: dict[int, int]


def cross_path(graph: OpGraph, vid: int) -> str:
    """Path of a tensor that crosses between pieces: the op and output that computed it."""
    var = graph.vars[vid]
    producer = graph.ops[var.producer]
    return f"<{producer.name}:{producer.outputs.index(vid)}>"


def subgraph(
    graph: OpGraph,
    op_indices: Iterable[int],
    *,
    outputs: Iterable[int] | None = None,
    consumers: Mapping[int, Sequence[int]] | None = None,
    ordered: bool = False,
) -> Subgraph:
    """The ops ``op_indices`` of ``graph`` (kept in program order; ``ordered``: in the order given, which must
    be an order they can run in) as a program.

    Its results are the tensors it computes that ops outside it or the whole program's
    results read, or exactly ``outputs`` when given (a unit task's needed results).
    ``consumers`` (``graph.consumers()``, computed once by a caller that cuts many pieces)
    spares a scan of the whole program per piece.
    """
    chosen = list(dict.fromkeys(op_indices)) if ordered else sorted(set(op_indices))
    inside = set(chosen)
    produced = {v for i in chosen for v in graph.ops[i].outputs}
    in_pos = {v: i for i, v in enumerate(graph.invars)}
    out_pos: dict[int, int] = {}
    for i, v in enumerate(graph.outvars):
        out_pos.setdefault(v, i)

    invars: list[int] = []
    seen: set[int] = set()
    for i in chosen:
        for v in graph.ops[i].inputs:
            kind = graph.vars[v].kind
            if v in produced or kind in ("const", "literal") or v in seen:
                continue
            seen.add(v)
            invars.append(v)
    if outputs is None:
        if consumers is None:
            read_outside = {v for op in graph.ops if op.index not in inside for v in op.inputs}
        else:
            read_outside = {v for v in produced if any(c not in inside for c in consumers[v])}
        outvars = [v for i in chosen for v in graph.ops[i].outputs if v in read_outside or v in out_pos]
    else:
        outvars = list(outputs)
        missing = [v for v in outvars if v not in produced and v not in seen]
        if missing:
            raise ValueError(f"results {missing} are neither computed nor read by this piece")

    var_map: dict[int, int] = {}
    new_vars: list[Var] = []
    consts, literals = {}, {}

    def add(v: int, producer: int | None = None, crossing: str = "") -> int:
        """v's id in the piece, copying v in on first use: produced by the piece's op ``producer``, or (``crossing``:
        its path) an argument computed by another piece. Var's fields spelled out (``_copy_fields`` checks them):
        ``dataclasses.replace`` cost a third of a stage's cut on GPT-39B."""
        found = var_map.get(v)
        if found is not None:
            return found
        var, k = graph.vars[v], len(new_vars)
        var_map[v] = k
        if crossing:
            new_vars.append(Var(k, var.shape, var.dtype, "input", None, crossing))
        else:
            new_vars.append(Var(k, var.shape, var.dtype, var.kind, producer, var.name))
            if var.kind == "const":
                consts[k] = graph.consts[v]
            elif var.kind == "literal":
                literals[k] = graph.literals[v]
        return k

    in_paths = []
    for v in invars:
        if v in in_pos:
            add(v)
            in_paths.append(graph.in_paths[in_pos[v]])
        else:
            path = cross_path(graph, v)
            add(v, crossing=path)
            in_paths.append(path)
    new_ops: list[Op] = []
    for i in chosen:
        op = graph.ops[i]
        if ordered and any(v in produced and v not in var_map for v in op.inputs):
            raise ValueError(f"{op.name} reads a tensor this piece computes after it: the order given cannot run")
        ins = tuple([add(v) for v in op.inputs])
        k = len(new_ops)
        outs = tuple([add(v, producer=k) for v in op.outputs])
        new_ops.append(Op(k, op.name, op.primitive, ins, outs, op.params, op.flops, op.bytes_accessed, op.label, op.bind, op.signature))
    out_paths = [graph.out_paths[out_pos[v]] if v in out_pos else cross_path(graph, v) for v in outvars]
    piece = OpGraph(
        vars=tuple(new_vars),
        ops=tuple(new_ops),
        invars=tuple(var_map[v] for v in invars),
        outvars=tuple(var_map[v] for v in outvars),
        in_tree=None,
        out_tree=None,
        in_paths=tuple(in_paths),
        out_paths=tuple(out_paths),
        consts=consts,
        literals=literals,
        batch_invars=frozenset(var_map[v] for v in invars if v in graph.batch_invars),
    )
    # hashed from its contents, as a traced program is: a saved stage plan names the piece by it
    return Subgraph(_with_fingerprint(piece), tuple(invars), tuple(outvars), var_map)


def _copy_fields() -> None:
    """``subgraph`` copies Var and Op field by field: a field added to either must be copied there too."""
    var_fields = tuple(f.name for f in dataclasses.fields(Var))
    op_fields = tuple(f.name for f in dataclasses.fields(Op))
    assert var_fields == ("id", "shape", "dtype", "kind", "producer", "name"), var_fields
    assert op_fields == (
        "index", "name", "primitive", "inputs", "outputs", "params", "flops", "bytes_accessed", "label", "bind", "signature"
    ), op_fields


_copy_fields()
