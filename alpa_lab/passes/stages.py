"""Slicing a traced training step into layers and phases (Alpa, OSDI'22, sec. 5.1).

The inter-op pass needs to know, for every op of the step, *when* it runs and *where*:

* its phase: ``forward`` and ``backward`` run once per micro-batch; ``apply`` (the weight
  update) runs once per step on the gradients averaged over micro-batches;
* its layer: the stage that holds a layer runs that layer's forward, its backward
  (sec. 5.1, constraint 1: the backward of an op lives on the stage of its forward) and
  the update of the weights it uses.

Both come from the markers ``alpa_lab.value_and_grad`` leaves in the program: boundary
markers (hand-placed, or from ``auto_layers``) cut the forward into layers, and their
mirrors in the backward cut it the same way; the mirror of the ``loss`` marker is where
the backward starts; gradient markers are where the update starts. An op between markers
takes the layer of its inputs (forward: the latest; backward: the earliest, as the
backward runs the layers in reverse); an op that reads only weights (a cast, a transpose
of a weight) takes the layer of its first reader. Forward ops that JAX re-runs inside the
backward (the body of a ``jax.checkpoint``: after the backward starts, needed by the
gradients, reading no gradient) are backward ops of the latest layer that reads them, so
the forward keeps only the checkpoint's inputs and the backward pays for the recompute. The
same rule files the few ops JAX's transposes compute from weights alone in the backward (a
convolution's flipped kernel, zeros) with the backward that runs them, not as activations kept.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

from alpa_lab.graph.analysis import classify_arguments
from alpa_lab.graph.markers import LOSS
from alpa_lab.graph.opgraph import OpGraph

__all__ = ["APPLY", "BACKWARD", "FORWARD", "ProgramSlicing", "SlicingError", "slice_program", "weight_gradient_ops"]

FORWARD, BACKWARD, APPLY = "forward", "backward", "apply"


class SlicingError(ValueError):
    """The step cannot be cut into pipeline stages (and why, and what to change)."""


@dataclass(frozen=True)
class ProgramSlicing:
    """Phase and layer of every op of one traced step (indexed by op index)."""

    num_layers: int
    phase: tuple[str, ...]
    layer: tuple[int, ...]
    owner: dict[int, int]
    """argument var -> the layer that keeps it (its first reader's layer)."""
    accumulated: tuple[int, ...]
    """tensors computed per micro-batch that the update reads or the step returns: the
    pipeline averages them over micro-batches (gradients, the loss, batch statistics)."""
    data: tuple[int, ...]
    """argument vars that are per-step data (split into micro-batches)."""
    stacked: tuple[int, ...] = ()
    """an inference step's results with a micro-batch's rows (its outputs per example): the pipeline puts the
    micro-batches' values back together along the first axis instead of averaging them."""

    def ops_of(self, layers: range | Sequence[int], phases: Sequence[str] = (FORWARD, BACKWARD, APPLY)) -> list[int]:
        """Op indices in ``layers`` with a phase in ``phases``, in program order."""
        index = self._ops_by_layer
        return sorted(i for lay in set(layers) for p in set(phases) for i in index.get((lay, p), ()))

    @functools.cached_property
    def _ops_by_layer(self) -> dict[tuple[int, str], tuple[int, ...]]:
        """(layer, phase) -> its ops: the planner asks ``ops_of`` for every stage it prices."""
        index: dict[tuple[int, str], list[int]] = {}
        for i, key in enumerate(zip(self.layer, self.phase)):
            index.setdefault(key, []).append(i)
        return {key: tuple(ops) for key, ops in index.items()}

    def stage_of_ops(self, layer_ranges: Sequence[tuple[int, int]]) -> tuple[int, ...]:
        """Stage of every op, stage i holding the half-open layer range ``layer_ranges[i]``."""
        stage_of_layer = {lay: i for i, (start, end) in enumerate(layer_ranges) for lay in range(start, end)}
        return tuple(stage_of_layer[lay] for lay in self.layer)


def _is_marker(op, kind: str) -> bool:
    return op.primitive == "pipeline_marker" and op.params["kind"] == kind


def slice_program(graph: OpGraph, inference: bool = False, batch: frozenset[int] | None = None) -> ProgramSlicing:
    """Phase and layer of every op; raises ``SlicingError`` if the step is not pipelinable.

    ``inference``: the step has no gradients (an evaluation, Alpa's ``pipeline_schedule="inference"``): every op
    is a forward op, cut into layers by its boundaries; results with a micro-batch's rows (``stacked``) are put
    back together along their first axis. ``batch``: an inference step's arguments cut into micro-batches (its
    data; the others are weights); None: every argument not returned, as for a training step."""
    ops = graph.ops
    producer = [graph.vars[v].producer for v in range(len(graph.vars))]
    loss_markers = [op.index for op in ops if _is_marker(op, "boundary") and op.params["name"] == LOSS]
    grad_markers = {op.index for op in ops if _is_marker(op, "gradient")}
    if inference:
        if grad_markers:
            raise SlicingError(
                "the step takes gradients (alpa_lab.value_and_grad / alpa_lab.grad), but the inference schedule runs "
                "a forward only: plan a training step with a training schedule ('1f1b', 'gpipe', ...), and an "
                "evaluation without gradients with 'inference'"
            )
        return _forward_slicing(graph, batch)
    if not grad_markers or len(loss_markers) < 2:
        raise SlicingError(
            "the step has no gradient markers, so the pipeline cannot tell the forward/backward "
            "from the weight update: compute gradients with alpa_lab.value_and_grad (or alpa_lab.grad) "
            "instead of jax.value_and_grad / jax.grad; a step without gradients (an evaluation, inference) "
            "pipelines with schedule='inference' (Alpa's pipeline_schedule='inference')"
        )
    if len(loss_markers) > 2:
        raise SlicingError(
            f"the step differentiates {len(loss_markers) // 2} losses; pipelining supports one "
            "alpa_lab.value_and_grad call per step"
        )
    backward_start = loss_markers[1]

    # ---- phases ------------------------------------------------------------------------
    needed = set()  # ops the gradients depend on
    stack = [i for i in grad_markers]
    while stack:
        i = stack.pop()
        if i in needed:
            continue
        needed.add(i)
        stack.extend(producer[v] for v in ops[i].inputs if producer[v] is not None)
    phase = [FORWARD] * len(ops)
    rerun: set[int] = set()  # forward ops re-run in the backward (remat), and what only they feed
    for op in ops:
        srcs = [producer[v] for v in op.inputs if producer[v] is not None]
        if op.index in grad_markers or op.index == backward_start:
            phase[op.index] = BACKWARD
        elif any(s in grad_markers or phase[s] == APPLY for s in srcs):
            phase[op.index] = APPLY
        elif any(phase[s] == BACKWARD for s in srcs):
            phase[op.index] = BACKWARD
            if all(s in rerun for s in srcs if phase[s] == BACKWARD):
                rerun.add(op.index)
        elif op.index > backward_start and op.index in needed:
            # a forward op re-run inside the backward pass (the body of a jax.checkpoint): it
            # runs with the backward and reads only what the forward saved (the point of remat)
            phase[op.index] = BACKWARD
            rerun.add(op.index)
    kinds = classify_arguments(graph)
    data = tuple(v for v in graph.invars if kinds[v] == "data")
    per_step = set(data)  # tensors that differ between micro-batches, and their descendants
    for op in ops:
        if any(v in per_step for v in op.inputs):
            per_step.update(op.outputs)
    consumers = graph.consumers()
    for op in reversed(ops):  # e.g. the optimizer's step count: once per step, with the update
        if (
            phase[op.index] == FORWARD
            and op.index not in needed
            and not any(v in per_step for v in op.outputs)
            and all(phase[c] == APPLY for v in op.outputs for c in consumers[v])
        ):
            phase[op.index] = APPLY
    for op in ops:
        if phase[op.index] == APPLY:
            bad = [graph.vars[v].name for v in op.inputs if v in data]
            if bad:
                raise SlicingError(
                    f"the weight update ({op.name}, {op.label or 'no label'}) reads the batch ({', '.join(bad)}) "
                    "directly; the pipeline only gives the update gradients averaged over micro-batches"
                )

    # ---- forward boundaries and their backward mirrors -----------------------------------
    # a named boundary is its name; unnamed markers adjacent in the program (one
    # mark_stage_boundary call) are one boundary, and the backward mirrors them in reverse
    forward_cuts: dict[str, int] = {}  # boundary key -> ordinal 1..n
    unnamed_forward: list[list[int]] = []
    mirror: dict[int, int] = {}  # boundary marker op -> ordinal of its forward boundary
    unnamed_backward: list[list[int]] = []
    for op in ops:
        if not _is_marker(op, "boundary") or op.params["name"] == LOSS or op.index in rerun:
            # (a boundary inside a jax.checkpoint body runs again in the backward: a copy, not a mirror)
            continue
        name = op.params["name"]
        if phase[op.index] == FORWARD:
            if not name:
                if unnamed_forward and unnamed_forward[-1][-1] == op.index - 1:
                    unnamed_forward[-1].append(op.index)
                else:
                    unnamed_forward.append([op.index])
            key = name or f"#{len(unnamed_forward)}"
            forward_cuts.setdefault(key, len(forward_cuts) + 1)
            mirror[op.index] = forward_cuts[key]
        elif phase[op.index] == BACKWARD:
            if name:
                if name not in forward_cuts:
                    raise SlicingError(f"boundary marker {name!r} appears in the backward pass only")
                mirror[op.index] = forward_cuts[name]
            elif unnamed_backward and unnamed_backward[-1][-1] == op.index - 1:
                unnamed_backward[-1].append(op.index)
            else:
                unnamed_backward.append([op.index])
    for group, fgroup in zip(unnamed_backward, reversed(unnamed_forward)):
        for b in group:
            mirror[b] = mirror[fgroup[0]]
    num_layers = len(forward_cuts) + 1

    # ---- layers ----------------------------------------------------------------------------
    layer: list[int | None] = [None] * len(ops)
    var_layer: dict[int, int] = {v: 0 for v in data}  # the batch enters at the first layer
    for op in ops:  # forward: latest input layer; a boundary opens its layer
        i = op.index
        if phase[i] != FORWARD:
            continue
        if i in mirror:
            layer[i] = mirror[i]
        else:
            known = [var_layer[v] for v in op.inputs if v in var_layer]
            layer[i] = max(known) if known else None
        if layer[i] is not None:
            var_layer.update((v, layer[i]) for v in op.outputs)
    back_layer: dict[int, int] = {}
    for op in ops:  # backward: earliest backward-input layer; a mirror closes its layer
        i = op.index
        if phase[i] != BACKWARD:
            continue
        if i == backward_start:
            layer[i] = num_layers - 1
        elif i in mirror:
            layer[i] = mirror[i] - 1
        elif i in rerun:
            continue  # below, once its readers have layers
        else:
            known = [back_layer[v] for v in op.inputs if v in back_layer]
            layer[i] = min(known) if known else num_layers - 1
        back_layer.update((v, layer[i]) for v in op.outputs)
    for op in reversed(ops):  # re-run ops: the latest layer whose backward reads them (the backward runs
        i = op.index  # the layers in reverse, so every reader gets it in time)
        if i in rerun and layer[i] is None:
            readers = [layer[c] for v in op.outputs for c in consumers[v] if layer[c] is not None and phase[c] != APPLY]
            forward_known = [var_layer[v] for v in op.inputs if v in var_layer]
            layer[i] = max(readers) if readers else max(forward_known, default=num_layers - 1)
    for op in reversed(ops):  # forward ops that read only weights: their first reader's layer
        i = op.index
        if phase[i] == FORWARD and layer[i] is None:
            readers = [layer[c] for v in op.outputs for c in consumers[v] if layer[c] is not None]
            layer[i] = min(readers) if readers else 0
    owner = {}
    for v in graph.invars:
        readers = [layer[c] for c in consumers[v] if phase[c] != APPLY and layer[c] is not None]
        if readers:
            owner[v] = min(readers)
    known_var: dict[int, int] = dict(owner)
    for op in ops:
        if phase[op.index] != APPLY:
            known_var.update((v, layer[op.index]) for v in op.outputs)
    for op in ops:  # the update: with the weights and gradients it reads
        i = op.index
        if phase[i] != APPLY:
            continue
        known = [known_var[v] for v in op.inputs if v in known_var]
        if known:
            layer[i] = min(known)
            known_var.update((v, layer[i]) for v in op.outputs)
    for op in reversed(ops):  # update ops on optimizer state alone (a step count)
        i = op.index
        if layer[i] is None:
            readers = [layer[c] for v in op.outputs for c in consumers[v] if layer[c] is not None]
            layer[i] = min(readers) if readers else 0
    for v in graph.invars:
        if v not in owner:
            readers = [layer[c] for c in consumers[v]]
            owner[v] = min(readers) if readers else 0

    # a weight read by several layers (tied embeddings) gets its gradient as a sum of
    # contributions from several layers: sum them once per step, in the update, from their
    # micro-batch averages (the sum is linear), instead of sending a contribution across
    # stages every micro-batch
    merged: set[int] = set()
    for op in reversed(ops):
        i = op.index
        if phase[i] != BACKWARD or op.primitive not in ("add_any", "add") or i in grad_markers:
            continue
        readers = [c for v in op.outputs for c in consumers[v]]
        if not readers or not all(c in grad_markers or c in merged for c in readers):
            continue
        sources = {layer[graph.vars[v].producer] for v in op.inputs if graph.vars[v].producer is not None}
        if len(sources) > 1:
            merged.add(i)
    for i in merged:
        phase[i] = APPLY
        for v in ops[i].outputs:
            for c in consumers[v]:
                phase[c] = APPLY  # the gradient marker (or the next sum) moves with it

    returned = set(graph.outvars)
    accumulated = tuple(
        v
        for op in ops
        if phase[op.index] != APPLY
        for v in op.outputs
        if v in returned or any(phase[c] == APPLY for c in consumers[v])
    )
    return ProgramSlicing(
        num_layers=num_layers,
        phase=tuple(phase),
        layer=tuple(int(x) for x in layer),
        owner=owner,
        accumulated=accumulated,
        data=data,
    )


def _forward_slicing(graph: OpGraph, batch: frozenset[int] | None) -> ProgramSlicing:
    """``slice_program`` of a step without gradients: every op a forward op. An op takes the latest layer of its
    inputs and a boundary marker opens its layer (a training step's forward rule); an op reading only weights
    takes its first reader's layer, and an argument is kept by its first reader's."""
    ops = graph.ops
    if batch is None:
        kinds = classify_arguments(graph)
        batch = frozenset(v for v in graph.invars if kinds[v] == "data")
    data = tuple(v for v in graph.invars if v in batch)
    cuts: dict[str, int] = {}  # boundary key -> ordinal 1..n (as a training step's forward boundaries)
    unnamed: list[int] = []  # the last op of each run of adjacent unnamed markers (one mark_stage_boundary call)
    layer: list[int | None] = [None] * len(ops)
    var_layer: dict[int, int] = {v: 0 for v in data}  # the batch enters at the first layer
    for op in ops:
        if _is_marker(op, "boundary") and op.params["name"] != LOSS and op.inputs:
            name = op.params["name"]
            if not name:
                if unnamed and unnamed[-1] == op.index - 1:
                    unnamed[-1] = op.index
                else:
                    unnamed.append(op.index)
            key = name or f"#{len(unnamed)}"
            layer[op.index] = cuts.setdefault(key, len(cuts) + 1)
        else:
            known = [var_layer[v] for v in op.inputs if v in var_layer]
            layer[op.index] = max(known) if known else None
        if layer[op.index] is not None:
            var_layer.update((v, layer[op.index]) for v in op.outputs)
    consumers = graph.consumers()
    for op in reversed(ops):  # ops reading only weights: with their first reader
        if layer[op.index] is None:
            readers = [layer[c] for v in op.outputs for c in consumers[v] if layer[c] is not None]
            layer[op.index] = min(readers) if readers else 0
    owner = {v: min((layer[c] for c in consumers[v]), default=0) for v in graph.invars}
    per_step = set(data)  # tensors that differ between micro-batches
    for op in ops:
        if any(v in per_step for v in op.inputs):
            per_step.update(op.outputs)
    rows = {graph.vars[v].shape[0] for v in data if graph.vars[v].shape}
    returned = set(graph.outvars)
    accumulated = tuple(v for op in ops for v in op.outputs if v in returned)
    stacked = tuple(v for v in accumulated if v in per_step and graph.vars[v].shape and graph.vars[v].shape[0] in rows)
    return ProgramSlicing(
        num_layers=len(cuts) + 1,
        phase=(FORWARD,) * len(ops),
        layer=tuple(int(x) for x in layer),
        owner=owner,
        accumulated=accumulated,
        data=data,
        stacked=stacked,
    )


def weight_gradient_ops(graph: OpGraph, slicing: ProgramSlicing, stage_of_op: Sequence[int]) -> frozenset[int]:
    """Zero-bubble's W (Qi et al. 2024): backward ops that no other stage waits for.

    A stage's backward splits into B, the ops the previous stage's backward needs (the
    gradient w.r.t. the stage's input, and what it is computed from), and W, the rest (the
    weight gradients), which a ZB schedule defers to fill bubbles.
    """
    consumers = graph.consumers()
    backward = [i for i, p in enumerate(slicing.phase) if p == BACKWARD]
    urgent: set[int] = set()
    stack = [
        i
        for i in backward
        if any(slicing.phase[c] == BACKWARD and stage_of_op[c] != stage_of_op[i] for v in graph.ops[i].outputs for c in consumers[v])
    ]
    while stack:
        i = stack.pop()
        if i in urgent:
            continue
        urgent.add(i)
        for v in graph.ops[i].inputs:
            p = graph.vars[v].producer
            if p is not None and slicing.phase[p] == BACKWARD and stage_of_op[p] == stage_of_op[i]:
                stack.append(p)
    return frozenset(i for i in backward if i not in urgent)
