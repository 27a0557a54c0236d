"""The tensors a pipeline plan moves between its sub-meshes, as cross-mesh reshardings.

A tensor computed by one stage and read by another moves from the producer's sub-mesh
and sharding to the reader's (Alpa, OSDI'22, sec. 6; its decomposition into unit tasks is
MLSys'23, see ``sharding.cross_mesh``). Forward activations and backward gradients move
once per micro-batch; what the weight update reads from another stage (averaged
gradients, the loss, results of another stage's update piece) moves once per step. A
tensor read by several ops of one stage moves once; arguments of the step are placed,
not transferred, except the state: a state leaf whose new value is made on one stage and
read on another (a tied embedding, a step counter) moves once per step, at its end
(phase ``state``).

This mirrors what ``runtime.pipeline`` does with ``jax.device_put`` and is what the
"resharding traffic" view reads: bytes between meshes and hosts per step, and the unit
tasks behind each figure.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from alpa_lab.graph.opgraph import OpGraph
from alpa_lab.graph.subgraph import Subgraph, cross_path
from alpa_lab.passes.pipeline import stage_tensor_specs
from alpa_lab.passes.stages import APPLY, ProgramSlicing
from alpa_lab.plan import PlanFormatError, StageResult
from alpa_lab.sharding.cross_mesh import CrossMeshResharding, cross_mesh_resharding

__all__ = ["STATE", "StageTransfer", "host_traffic", "pipeline_transfers", "stage_traffic", "stage_transfers"]

STATE = "state"
"""The phase of a new state leaf moving to the stages that read it next step."""


@dataclass(frozen=True)
class StageTransfer:
    """One tensor moved from ``src_stage``'s sub-mesh to ``dst_stage``'s.

    ``phase`` says when: ``forward`` (an activation) and ``backward`` (a gradient) are the
    phase of the op that computes it, and such a tensor moves once per micro-batch;
    ``apply`` is a tensor the weight update reads, moved once per step; ``state`` a new state
    leaf, moved once per step to the stages that read the leaf (``var`` is the argument).
    """

    var: int
    name: str
    """``<producer op:output>`` (for new state, the argument's path): the path the reader stage's plan gives this input."""
    shape: tuple[int, ...]
    dtype: str
    src_stage: int
    dst_stage: int
    phase: str
    resharding: CrossMeshResharding

    @property
    def per_microbatch(self) -> bool:
        return self.phase not in (APPLY, STATE)

    @property
    def nbytes(self) -> int:
        """Bytes over links for one move (one micro-batch, or the step for ``apply``)."""
        return self.resharding.total_bytes

    def times_per_step(self, num_microbatches: int) -> int:
        return num_microbatches if self.per_microbatch else 1


def stage_transfers(
    graph: OpGraph,
    slicing: ProgramSlicing,
    stages: Sequence[StageResult],
    *,
    devices_per_host: int | None = None,
    pieces: Sequence[Subgraph] | None = None,
    consumers: Mapping[int, Sequence[int]] | None = None,
) -> tuple[StageTransfer, ...]:
    """Every tensor read by a stage other than its producer's, in program order of first read.

    ``pieces``: the stages' programs if already cut (``PipelineProblem.piece``); ``consumers``: the graph's
    (``graph.consumers()``) if already known."""
    stage_of_op = slicing.stage_of_ops([st.layers for st in stages])
    specs = stage_tensor_specs(graph, slicing, stages, pieces)
    # (var, dst, when) -> (var as made, src, phase); when: 0 per micro-batch, 1 once per step, 2 new state
    found: dict[tuple[int, int, int], tuple[int, int, str]] = {}
    for op in graph.ops:
        dst = stage_of_op[op.index]
        once = slicing.phase[op.index] == APPLY
        for v in op.inputs:
            p = graph.vars[v].producer
            if p is None or stage_of_op[p] == dst or (v, dst, int(once)) in found:
                continue
            found[(v, dst, int(once))] = (v, stage_of_op[p], APPLY if once else slicing.phase[p])
    readers = consumers or graph.consumers()
    for o, v in graph.state_carries():
        p = graph.vars[o].producer
        if p is None:
            continue  # returned unchanged (or a constant): stays where it is
        for dst in sorted({stage_of_op[i] for i in readers[v]} - {stage_of_op[p]}):
            found[(v, dst, 2)] = (o, stage_of_op[p], STATE)
    out = []
    for (v, dst, _), (made, src, phase) in found.items():
        var = graph.vars[v]
        a, b = stages[src], stages[dst]
        resharding = cross_mesh_resharding(
            var.shape, var.dtype,
            specs[src][made], a.logical_shape, a.device_ids,
            specs[dst][v], b.logical_shape, b.device_ids,
            devices_per_host=devices_per_host,
        )
        name = graph.in_paths[graph.invars.index(v)] if phase == STATE else cross_path(graph, v)
        out.append(StageTransfer(v, name, var.shape, var.dtype, src, dst, phase, resharding))
    return tuple(out)


def pipeline_transfers(plan: Any) -> tuple[StageTransfer, ...]:
    """The cross-mesh transfers of a ``PipelinePlan`` (it needs its planner state attached)."""
    problem = getattr(plan, "problem", None)
    if problem is None:
        raise PlanFormatError("this pipeline plan has no planner state attached (a loaded plan?); re-plan it with its step")
    pieces = [problem.piece(st.layers) for st in plan.stages]
    return stage_transfers(
        problem.graph, problem.slicing, plan.stages, devices_per_host=problem.cluster.devices_per_host, pieces=pieces,
        consumers=problem.consumers or None,
    )


def stage_traffic(transfers: Sequence[StageTransfer], num_microbatches: int) -> dict[tuple[int, int], int]:
    """(source stage, destination stage) -> bytes moved per step."""
    out: dict[tuple[int, int], int] = defaultdict(int)
    for t in transfers:
        out[(t.src_stage, t.dst_stage)] += t.nbytes * t.times_per_step(num_microbatches)
    return dict(out)


def host_traffic(transfers: Sequence[StageTransfer], num_microbatches: int, devices_per_host: int) -> dict[tuple[int, int], int]:
    """(sender host, receiver host) -> bytes moved per step; (h, h) stays inside host h."""
    out: dict[tuple[int, int], int] = defaultdict(int)
    for t in transfers:
        k = t.times_per_step(num_microbatches)
        for hosts, n in t.resharding.bytes_between(lambda d: d // devices_per_host).items():
            out[hosts] += n * k
    return dict(out)
