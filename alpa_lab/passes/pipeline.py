"""The whole two-level plan (Alpa, OSDI'22, sec. 5): stages, sub-meshes, shardings, schedule.

``plan_pipeline`` puts the passes together on a traced step (traced at micro-batch size):

1. ``slice_program`` gives every op its phase and layer;
2. each layer's forward + backward is priced by the intra-op ILP on every logical mesh
   of every candidate sub-mesh (``layer_cost``). Layers with the same structure (the
   repeated blocks of a transformer, TAP) share one solve, so a deep model costs a few ILPs
   per mesh, not one per layer;
3. the stage DP (eq. 2-4) slices the layers into stages on sub-meshes, with a stage's
   t_intra the sum of its layers' costs (the resharding between two layers of one stage is
   not priced: a stage is planned as a whole in step 4, which does price it);
4. each chosen stage (all its ops, the weight update included) is planned by the intra-op
   pass on its sub-mesh and logical mesh: a ``Plan`` per stage;
5. the schedule's timeline gives the predicted step time, and eq. 5 the memory check:
   weights + peak in-flight micro-batches x activations per micro-batch <= device memory.

Costs come from the analytic model of ``cost.cluster``; measuring stages on real devices
would plug in at ``layer_cost``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import heapq
import math
import multiprocessing as mp
import os
import sys
import threading
import time
import warnings
from collections import Counter, OrderedDict
from concurrent.futures import FIRST_COMPLETED, BrokenExecutor, ProcessPoolExecutor, ThreadPoolExecutor, wait
from collections.abc import Callable, Mapping, Sequence
from typing import Any
from dataclasses import dataclass, field

import numpy as np

from alpa_lab._gc import quiet_gc
from alpa_lab.cost.cluster import ClusterSpec, LogicalMesh
from alpa_lab.cost.profile import CostParts, ProfileError
from alpa_lab.graph.analysis import batch_dimension, classify_arguments
from alpa_lab.graph.opgraph import Op, OpGraph, is_inexact
from alpa_lab.graph.subgraph import Subgraph, subgraph
from alpa_lab.passes.inter_op import (
    InterOpError, InterOpPlan, RangeCosts, StageCost, StagePlan, logical_shapes, pipeline_latency, profile_stage_options, stage_dp,
    stage_dp_capped, stage_dp_uniform,
)
from alpa_lab.passes.intra_op import (
    StrategyGraph, _op_key, build_strategy_graph, cost_signature, relabel, retie, solve_strategy_graph, weighted_by_microbatch,
    weighted_nodes,
)
from alpa_lab.passes.methods import (
    AXIS_SYMMETRIC_METHODS, TIE_PERIODS, MethodError, make_plan, method_restrictions, solve_tied,
)
from alpa_lab.passes.schedule import (
    INFERENCE, BACKWARD_INPUT, BACKWARD_WEIGHT, SPLIT_BACKWARD, WARMUP_SCHEDULES, Schedule, Timeline, make_schedule, one_f_one_b_estimate,
    one_f_one_b_windows, simulate, warmup_makespan, warmup_peaks, warmup_timeline,
)
from alpa_lab.passes.stages import APPLY, BACKWARD, FORWARD, ProgramSlicing, _is_marker, slice_program, weight_gradient_ops
from alpa_lab.passes.submesh import PlacementError, check_submesh_space, even_submesh, place_submeshes, submesh_shapes
from alpa_lab.sharding.spec import ShardingSpec
from alpa_lab.plan import PinError, PipelinePlan, Plan, PlanFormatError, StageResult, memory_per_mesh

Shape = tuple[int, int]
LOGICAL_MESH_SPACES = ("all", "single_node_model_parallel", "same_as_physical", "data_parallel_only", "model_parallel_only")
"""Alpa's spaces of logical meshes per sub-mesh (``in_logical_space``)."""


def in_logical_space(
    space: str, submesh: Shape, logical: Shape, devices_per_host: int, microbatch_size: int | None = None
) -> bool:
    """Whether the stage DP tries ``logical`` on ``submesh`` in ``space``: "all" every 2-D view;
    "single_node_model_parallel" (n / k, k) with the model-parallel axis k dividing a host's devices and the
    data-parallel axis n / k dividing the micro-batch (``microbatch_size``; None: any), or the sub-mesh's own
    shape; "same_as_physical" the sub-mesh's own shape; "data_parallel_only" (n, 1); "model_parallel_only" (1, n).

    "single_node_model_parallel" is Alpa's pruning of the views (``get_one_submesh_autosharding_config_choices``),
    with two differences: Alpa takes any k up to a host's devices that divides n (here k divides a host's devices,
    so a model-parallel group never straddles hosts; the two agree on power-of-two hosts), and forces the batch onto
    axis 0 of the (n / k, k) views (here the ILP places it). It is a heuristic, not a lossless cut: a data-parallel
    axis that cannot split the micro-batch could still split the model's own dimensions (2-D model parallelism on
    (2, 4)), which this space gives up for planning speed (GPT-39B with 1,024 micro-batches of one sequence on 64
    devices prices 7 meshes per layer instead of 19; on every GPT and Wide-ResNet row of ``benchmarks/plan_time.py``
    the simulated step stayed the same). ``"all"`` keeps every view."""
    if space == "single_node_model_parallel":
        if tuple(logical) == tuple(submesh):
            return True
        return devices_per_host % logical[1] == 0 and (microbatch_size is None or microbatch_size % logical[0] == 0)
    if space == "same_as_physical":
        return tuple(logical) == tuple(submesh)
    if space == "data_parallel_only":
        return logical[1] == 1
    if space == "model_parallel_only":
        return logical[0] == 1
    return True


LAYER_GRAPHS_KEPT = 16

FORK_MIN_WORK = 20_000
"""(ops in the distinct layers) x (meshes to price) from which the layer ILPs go to forked processes: GPT-39B
on 64 devices is about 40,000 (priced in 4.1 s there against 7.1 s in threads, 2 cores); the tiny examples on
8 devices are a few thousand, where forking a process holding JAX costs more than it saves"""

_FORKED_JOB: tuple | None = None
"""(problem, method, more) while ``prefetch_layer_costs`` runs a fork pool: what its workers inherit"""
_FORK_LOCK = threading.Lock()
"""held while a fork pool runs (``_FORKED_JOB`` is one per process). Not re-entrant: a progress callback that
started another large plan in the same thread would wait on it; the workers never plan."""


def plan_workers() -> int:
    """How many meshes the planner prices at once: ``ALPA_LAB_PLAN_WORKERS``, else this process's cores (at most 8)."""
    env = os.environ.get("ALPA_LAB_PLAN_WORKERS")
    if env:
        try:
            return max(int(env), 1)
        except ValueError:
            raise ValueError(f"ALPA_LAB_PLAN_WORKERS must be a whole number of worker processes, got {env!r}") from None
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(min(cores, 8), 2)


def _price_mesh_forked(mesh: tuple, known: dict) -> dict:
    """In a forked worker: ``_price_mesh`` on the inherited problem, after taking the costs ``known`` (a
    transposed twin's, solved by another worker); returns that mesh's entries to merge into the parent's cache."""
    problem, method, more = _FORKED_JOB
    problem.layer_costs.update(known)
    problem._price_mesh(mesh, method, more)
    return {key: cost for key, cost in problem.layer_costs.items() if (key[1], key[2]) == mesh}

__all__ = [
    "LayerCost", "PipelineProblem", "check_memory", "fixed_stages", "plan_pipeline", "plan_stages", "stage_schedule",
    "stage_tensor_specs",
]


@dataclass(frozen=True)
class LayerCost:
    """One layer's forward + backward on one logical mesh, per micro-batch."""

    forward: float
    backward: float
    weight_memory: float
    activation_memory: float

    @property
    def time(self) -> float:
        return self.forward + self.backward


@dataclass(eq=False)
class PipelineProblem:
    """The planner state a re-plan re-uses: the graph, its slicing, and cached costs."""

    graph: OpGraph
    slicing: ProgramSlicing
    cluster: ClusterSpec
    argument_kinds: dict[int, str]
    layer_keys: tuple[int, ...]
    layer_costs: dict[tuple, LayerCost | None] = field(default_factory=dict)
    stage_plans: dict[tuple, Plan] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)
    reuse: bool = True
    saved: frozenset[int] = frozenset()
    """forward ops whose results the backward reads: what a micro-batch in flight keeps."""
    stage_methods: dict = field(default_factory=dict)
    """(layers, sub-mesh, logical mesh) -> the memory-saving layout the DP priced it with."""
    batch_mesh_axis: int | None = None
    """Alpa's ``force_batch_dim_to_mesh_dim`` for every stage's plan (a method's ``default_auto_sharding_option``):
    the mesh axis each stage keeps its batch split over (``methods._forced_batch_axis``); None: the ILP's choice"""
    forbidden: tuple[str, ...] = ()
    """collective kinds no stage may issue (``LogicalMesh.forbidden``: Alpa's ``allow_all_gather=False`` /
    ``allow_all_to_all=False``): every mesh of this problem has them, so its cached costs hold only for them"""
    weight_update_sharding: bool = True
    """the paper's weight-update sharding in every stage's plan (``Plan.weight_update_sharding``; Alpa's
    ``prefer_reduce_scatter``): False leaves each stage's update as its ILP placed it. The DP's layer costs hold
    no update, so only the stage plans depend on it (``set_weight_update_sharding``)."""
    stage_batch_axes: dict = field(default_factory=dict)
    """(layers, sub-mesh, logical mesh) -> that stage's own forced batch axis (a ``ManualStageOption``'s per-stage
    auto-sharding dicts), over ``batch_mesh_axis``; -1: not forced there"""
    state_factor: float = 1.0
    """(params + optimizer state) / params: layer pieces hold no optimizer state, eq. 5 needs it."""
    pieces: dict[tuple[int, int], Subgraph] = field(default_factory=dict)
    """layers [start, end) -> that stage's program (cut once; plans, runtime and views share it)."""
    stage_graphs: dict[tuple, StrategyGraph] = field(default_factory=dict)
    """(layers, mesh costs, tie period) -> its intra-op problem: a pin re-solves only the ILP; (..., micro-batches)
    -> that problem weighted for a step of that many micro-batches (``weighted_by_microbatch``), what stages solve."""
    stage_solutions: dict[tuple, tuple] = field(default_factory=dict)
    """(layers, mesh costs, method, pins, forced batch axis, micro-batches) -> (tie period, solution): a stage placed
    elsewhere reuses it"""
    stage_twins: dict[tuple, tuple[int, int]] = field(default_factory=dict)
    """(layer keys of a stage, mesh costs, tie period) -> the first layers [start, end) built so: a stage of
    equal layers elsewhere in the stack is that problem renamed (``intra_op.relabel``)"""
    send_bytes: np.ndarray | None = None
    """[start, end]: bytes per micro-batch the stage of layers [start, end) exchanges with later ones"""
    consumers: Mapping[int, Sequence[int]] = field(default_factory=dict)
    """var -> the ops that read it (``graph.consumers()``, once: every piece cut needs it)"""
    schedules: dict[tuple, Schedule] = field(default_factory=dict)
    """(schedule, stages, micro-batches, meshes) -> its instruction lists (``_stage_schedule``): the schedules
    planning builds (interleaved, ZB, the profiling cost model's); a warm-up schedule's timeline needs none"""
    stage_timer: Callable[..., Mapping[tuple[int, str], float]] | None = None
    """the profiling cost model (``runtime.stage_profile``): (problem, stages, schedule) -> measured
    seconds per (stage, phase); when set, planned stages are timed on the devices, not priced"""
    layer_graphs: OrderedDict = field(default_factory=OrderedDict)
    """(layer key, sub-mesh, logical mesh) -> that layer's intra-op problem, the last few: the
    DP asks a layer's memory-saving layouts right after its fastest one, and they share it"""
    layer_pieces: dict[int, tuple[int, Subgraph, dict[int, str]]] = field(default_factory=dict)
    """layer key -> (layer, its program, argument kinds): the layer that key's problems are built from,
    cut once for every mesh"""
    prefixes: dict[tuple, tuple[np.ndarray, ...]] = field(default_factory=dict)
    """(sub-mesh, logical mesh, method) -> cumulative layer costs: a stage's cost in O(1)"""
    logical_meshes: str = "all"
    submesh_space: str = "all"
    """the DP's search space of the last ``plan_pipeline`` (re-plans search the same one)"""
    split_vars: frozenset[int] | None = None
    """the program's arguments cut into micro-batches (the API's cut, ``plan_pipeline(split_vars=)``); None where it
    was not said: what ``microbatch_size`` reads first"""
    batch_vars: frozenset[int] | None = None
    """the program's batch arguments where the user named them (``parallelize(batch_argnums=)``): what the
    data-parallel methods split in each layer and stage; None: each piece's data leaves leading with the
    batch size (``StrategyGraph.batch_vars``)"""
    reads: tuple[np.ndarray, ...] | None = None
    """(var, reading op, producing op, bytes) of every read of a tensor computed before the update, by an
    op before the update (``stage_reads``): what a boundary between stages can carry"""
    inference: bool = False
    """a step without gradients (``schedule="inference"``): forward ops only, planned and run with that schedule"""
    candidates: list[tuple[InterOpPlan, float, float | None]] = field(default_factory=list)
    """the last ``plan_pipeline``'s candidates: (the DP's stages, their floor (``estimated_step``), their
    simulated step once planned; None: not planned, as the floor was above a planned step; inf: over memory)"""

    def piece(self, layers: tuple[int, int]) -> Subgraph:
        """The program of the stage holding ``layers`` [start, end)."""
        if layers not in self.pieces:
            ops = _by_layer(self.graph, self.slicing, self.slicing.ops_of(range(*layers)))
            self.pieces[layers] = subgraph(self.graph, ops, consumers=self.consumers or None, ordered=True)
        return self.pieces[layers]

    @classmethod
    def build(
        cls, graph: OpGraph, cluster: ClusterSpec, *, reuse: bool = True, inference: bool = False,
        batch: frozenset[int] | None = None,
    ) -> PipelineProblem:
        """Slice ``graph``; with ``reuse`` layers of equal structure share their costs (TAP).

        ``inference``: a step without gradients (``schedule="inference"``), whose ``batch`` (the arguments cut into
        micro-batches) is its data and whose other arguments are its weights (none is returned as new state)."""
        t0 = time.perf_counter()
        slicing = slice_program(graph, inference=inference, batch=batch)
        consumers = graph.consumers()
        results = frozenset(graph.outvars)
        keys: dict[tuple, int] = {}
        layer_keys = []
        for lay in range(slicing.num_layers):
            ops = slicing.ops_of([lay], (FORWARD, BACKWARD))
            key = tuple(
                (slicing.phase[i], _layer_op_key(graph.ops[i], graph))
                for i in ops if not _passes_through(graph.ops[i], graph, consumers, results)
            ) if reuse else (lay,)
            layer_keys.append(keys.setdefault(key, len(keys)))
        saved = frozenset(
            op.index
            for op in graph.ops
            if slicing.phase[op.index] == FORWARD
            and any(slicing.phase[c] == BACKWARD for v in op.outputs for c in consumers[v])
        )
        if inference:  # nothing is returned as new state: the batch is data, every other argument a weight
            kinds = {v: "data" if v in slicing.data else "param" for v in graph.invars}
        else:
            kinds = classify_arguments(graph)
        sizes = {"param": 0.0, "optimizer_state": 0.0}
        for v, kind in kinds.items():
            if kind in sizes:
                sizes[kind] += graph.vars[v].nbytes
        factor = 1.0 + sizes["optimizer_state"] / sizes["param"] if sizes["param"] else 1.0
        problem = cls(
            graph, slicing, cluster, kinds, tuple(layer_keys), reuse=reuse, saved=saved, state_factor=factor, consumers=consumers,
            inference=inference, split_vars=batch,
        )
        problem.seconds["slicing"] = time.perf_counter() - t0
        return problem

    def microbatch_size(self) -> int | None:
        """The micro-batch's size: the leading dimension the arguments cut into micro-batches share (``split_vars``;
        else those the user named; else the program's data, ``graph.analysis.batch_dimension``, which for a step
        returning no state counts its weights too); None where they have none."""
        batch = next((b for b in (self.split_vars, self.batch_vars) if b is not None), self.slicing.data)
        return batch_dimension([tuple(self.graph.vars[v].shape) for v in batch])

    def piece_batch(self, piece: Subgraph) -> frozenset[int] | None:
        """The named batch arguments (``batch_vars``) a piece reads, as its own vars; None where none were named."""
        if self.batch_vars is None:
            return None
        return frozenset(piece.var_map[v] for v in piece.invars if v in self.batch_vars)

    def with_batch(self, sg: StrategyGraph, piece: Subgraph) -> StrategyGraph:
        """``sg`` (the problem of ``piece``) with the named batch it reads (``piece_batch``); as it is where none was named."""
        return sg if self.batch_vars is None else dataclasses.replace(sg, batch_vars=self.piece_batch(piece))

    def piece_kinds(self, piece: Subgraph) -> dict[int, str]:
        """Argument kinds of a piece: the program's own, or "activation" for crossing tensors."""
        return {
            piece.var_map[v]: self.argument_kinds.get(v, "activation") for v in piece.invars
        }

    def set_weight_update_sharding(self, flag: bool) -> None:
        """Plan the stages with (or without) weight-update sharding from now on: the stage plans and solutions
        cached with the other setting are dropped (the layer costs, which hold no update, are kept)."""
        flag = bool(flag)
        if flag != self.weight_update_sharding:
            self.stage_plans.clear()
            self.stage_solutions.clear()
            self.weight_update_sharding = flag

    def stage_axis(self, layers: tuple[int, int], submesh: Shape, logical: Shape) -> int | None:
        """The mesh axis the stage of ``layers`` on that mesh keeps its batch split over (None: not forced)."""
        return self.forced_axis(self.stage_batch_axes.get((layers, tuple(submesh), tuple(logical))))

    def forced_axis(self, own: int | None) -> int | None:
        """A stage's forced batch axis from its own setting (None: the default ``batch_mesh_axis``; -1: not forced)."""
        axis = self.batch_mesh_axis if own is None else own
        return None if axis is None or axis < 0 else axis

    def mesh(self, submesh: Shape, logical: Shape, device_ids: Sequence[int] | None = None) -> LogicalMesh:
        if device_ids is None:  # a canonical placement: first hosts, first devices of each
            M = self.cluster.devices_per_host
            device_ids = [h * M + d for h in range(submesh[0]) for d in range(submesh[1])]
        mesh = self.cluster.logical_mesh(logical, tuple(device_ids))
        return dataclasses.replace(mesh, forbidden=self.forbidden) if self.forbidden else mesh

    def dp_axis(self, method: str) -> int | None:
        """The mesh axis the DP's layer costs in ``method`` keep the batch split over: the plan's default forced axis
        (``batch_mesh_axis``) for the ILP's own method, as every stage the DP chooses is then planned; None otherwise
        (the memory-saving layouts keep their own rule)."""
        return self.forced_axis(None) if method == "alpa" else None

    def layer_key(self, kind: int, submesh: Shape, logical: Shape, method: str) -> tuple:
        """``layer_costs``' key: the layer's kind (``layer_keys``), the mesh, the method and its forced batch axis."""
        return (kind, submesh, logical, method, self.dp_axis(method))

    def layer_cost(self, layer: int, submesh: Shape, logical: Shape, method: str = "alpa") -> LayerCost | None:
        """The intra-op ILP's cost of a layer (cached per repeated-layer key, mesh, method and forced batch axis)."""
        key = self.layer_key(self.layer_keys[layer], submesh, logical, method)
        if key not in self.layer_costs:
            twin = self.transposed_twin(submesh, logical, method)
            if twin is not None:  # the same problem with its mesh axis renamed: the same costs
                self.layer_costs[key] = self.layer_cost(layer, submesh, twin, method)
                return self.layer_costs[key]
            t0 = time.perf_counter()
            self.layer_costs[key] = self._solve_layer(layer, submesh, logical, method)
            self.seconds["intra_op"] = self.seconds.get("intra_op", 0.0) + time.perf_counter() - t0
        return self.layer_costs[key]

    def transposed_twin(self, submesh: Shape, logical: Shape, method: str) -> Shape | None:
        """(n, 1) for a (1, n) logical mesh whose one axis costs what the (n, 1) view's axis costs; else None.

        Strategies only use axes of size > 1, so the two views of one line of devices give the same
        strategies with axis 1 renamed 0, the same costs, and one ILP serves both (for the methods
        that treat the axes alike). The check is on the two meshes' own numbers (latency, bandwidth,
        device figures), so views that ever cost differently are each solved.
        """
        if method not in AXIS_SYMMETRIC_METHODS or logical[0] != 1 or logical[1] == 1 or self.dp_axis(method) is not None:
            return None  # a forced batch axis names one of the two views' axes: they are two problems
        twin = (logical[1], 1)
        a, b = cost_signature(self.mesh(submesh, logical)), cost_signature(self.mesh(submesh, twin))
        same_axis = (a.alpha[1], a.beta[1]) == (b.alpha[0], b.beta[0])  # the axis of size n in each view
        same_rest = dataclasses.replace(a, shape=b.shape, alpha=b.alpha, beta=b.beta, axis_names=b.axis_names) == b
        return twin if same_axis and same_rest else None

    def _layer_graph(self, layer: int, submesh: Shape, logical: Shape) -> tuple[list[int], StrategyGraph, dict[int, str]]:
        """The intra-op problem of one layer on one logical mesh (the methods restrict its solve, not it)."""
        key = (self.layer_keys[layer], submesh, logical)
        if key in self.layer_graphs:
            self.layer_graphs.move_to_end(key)
            rep, sg, kinds = self.layer_graphs[key]
            return self.slicing.ops_of([rep], (FORWARD, BACKWARD)), sg, kinds
        rep, piece, kinds = self._layer_piece(layer)
        sg = self.with_batch(
            build_strategy_graph(piece.graph, self.mesh(submesh, logical), argument_kinds=kinds, reuse_repeated_blocks=self.reuse),
            piece,
        )
        self.layer_graphs[key] = (rep, sg, kinds)
        if len(self.layer_graphs) > LAYER_GRAPHS_KEPT:
            self.layer_graphs.popitem(last=False)
        return self.slicing.ops_of([rep], (FORWARD, BACKWARD)), sg, kinds

    def _layer_piece(self, layer: int) -> tuple[int, Subgraph, dict[int, str]]:
        """(the first layer of ``layer``'s kind, its program, its argument kinds), cut once per kind"""
        if self.layer_keys[layer] not in self.layer_pieces:
            piece = subgraph(self.graph, self.slicing.ops_of([layer], (FORWARD, BACKWARD)), consumers=self.consumers or None)
            self.layer_pieces[self.layer_keys[layer]] = (layer, piece, self.piece_kinds(piece))
        return self.layer_pieces[self.layer_keys[layer]]

    def _solve_layer(self, layer: int, submesh: Shape, logical: Shape, method: str) -> LayerCost | None:
        if not self.slicing.ops_of([layer], (FORWARD, BACKWARD)):
            return LayerCost(0.0, 0.0, 0.0, 0.0)
        ops, sg, kinds = self._layer_graph(layer, submesh, logical)
        axis = self.dp_axis(method)
        if axis is not None:
            sg = dataclasses.replace(sg, batch_mesh_axis=axis)
        try:
            sol = solve_strategy_graph(sg, restrictions=method_restrictions(method, sg))
        except ValueError:  # no plan (a forced axis that cannot split this layer's batch among them)
            return None
        forward = weights = activations = 0.0
        op_total = sums = forward_sums = 0.0
        accumulated = self.accumulated
        for n, node in enumerate(sg.nodes):
            s = node.strategies[sol.choice[n]]
            if node.op_index is None:
                if kinds.get(node.var) in ("param", "optimizer_state"):
                    weights += s.memory_cost
                continue
            cost = s.compute_cost + s.communication_cost
            op_total += cost
            op = self.graph.ops[ops[node.op_index]]
            if self.slicing.phase[op.index] == FORWARD:
                forward += cost
            if op.index in self.saved:
                activations += s.memory_cost
            for pos, v in enumerate(op.outputs):  # a weight gradient (or the loss) summed every micro-batch
                if v in accumulated:
                    add = sum_seconds(self.cluster, self.graph.vars[v], s.output_specs[pos].num_shards(sg.mesh.shape))
                    if self.slicing.phase[op.index] == FORWARD:
                        forward_sums += add
                    else:
                        sums += add
        forward += _clipped(sol.objective - op_total, sol.objective)  # loads and reshardings: charged to the forward
        return LayerCost(forward + forward_sums, sol.objective - forward + sums, weights * self.state_factor, activations)

    @functools.cached_property
    def accumulated(self) -> frozenset[int]:
        """The floating tensors summed over the micro-batches (``ProgramSlicing.accumulated``; an inference step's
        per-example results are put together, not summed)."""
        stacked = set(self.slicing.stacked)
        return frozenset(v for v in self.slicing.accumulated if v not in stacked and is_inexact(self.graph.vars[v].dtype))

    def stage_graph(
        self, layers: tuple[int, int], submesh: Shape, logical: Shape, device_ids: tuple[int, ...], tie_period: int = 1,
        microbatches: int = 1,
    ) -> StrategyGraph:
        """The intra-op problem of the stage holding ``layers`` on ``device_ids`` seen as ``logical`` (cached), for a
        step of ``microbatches``: its update weighs 1 / ``microbatches`` in the ILP (``weighted_by_microbatch``)."""
        mesh = self.mesh(submesh, logical, device_ids)
        if microbatches > 1:
            sg = self._weighted(layers, self.stage_graph(layers, submesh, logical, device_ids, tie_period), microbatches)
            return sg if sg.mesh == mesh else dataclasses.replace(sg, mesh=mesh)
        # keyed by the mesh's costs, not its devices: one stage placed on other hosts is the same problem
        key = (layers, cost_signature(mesh), tie_period)
        sg = self.stage_graphs.get(key)
        if sg is None:
            piece = self.piece(layers)
            sg = self._twin_graph(layers, cost_signature(mesh), tie_period)
            if sg is None:
                untied = self.stage_graphs.get((layers, cost_signature(mesh), 1)) if tie_period != 1 else None
                if untied is not None:
                    sg = retie(untied, piece.graph, tie_period)
                else:
                    sg = build_strategy_graph(piece.graph, mesh, argument_kinds=self.piece_kinds(piece), tie_period=tie_period)
                sg = self.with_batch(sg, piece)
            self.stage_graphs[key] = sg
            if self.reuse:
                self.stage_twins.setdefault(self._twin_key(layers, cost_signature(mesh), tie_period), layers)
        return sg if sg.mesh == mesh else dataclasses.replace(sg, mesh=mesh)

    def _weighted(self, layers: tuple[int, int], sg: StrategyGraph, microbatches: int) -> StrategyGraph:
        """``sg`` (the stage of ``layers``, unweighted) weighted for ``microbatches`` (cached; a renamed twin takes its
        twin's weighted costs, as it took its unweighted ones)."""
        signature = cost_signature(sg.mesh)
        key = (layers, signature, sg.tie_period, microbatches)
        found = self.stage_graphs.get(key)
        if found is None:
            twin = self.stage_twins.get(self._twin_key(layers, signature, sg.tie_period)) if self.reuse else None
            built = self.stage_graphs.get((twin, signature, sg.tie_period, microbatches)) if twin not in (None, layers) else None
            update = self.update_nodes(sg)
            if (built is not None and built.plain_cost_graph is sg.cost_graph
                    and np.array_equal(built.node_weights, weighted_nodes(len(sg.nodes), update, microbatches))):
                found = dataclasses.replace(sg, cost_graph=built.cost_graph, plain_cost_graph=sg.cost_graph,
                                            node_weights=built.node_weights)
            else:
                found = weighted_by_microbatch(sg, update, microbatches)
            self.stage_graphs[key] = found
        return found

    def update_nodes(self, sg: StrategyGraph) -> list[int]:
        """The nodes of a stage's problem that run once per step: its update's ops."""
        return [n for n, node in enumerate(sg.nodes) if node.op_index is not None and self.phase_of_op.get(node.name) == APPLY]

    @functools.cached_property
    def phase_of_op(self) -> dict[str, str]:
        """op name -> its phase (``ProgramSlicing.phase``): a stage's program names its ops as the whole program does."""
        return {op.name: self.slicing.phase[op.index] for op in self.graph.ops}

    def _twin_key(self, layers: tuple[int, int], signature: LogicalMesh, tie_period: int) -> tuple:
        return (self.layer_keys[layers[0] : layers[1]], layers[1] == self.slicing.num_layers, signature, tie_period)

    def _twin_graph(self, layers: tuple[int, int], signature: LogicalMesh, tie_period: int) -> StrategyGraph | None:
        """The problem of an already built stage of equal layers, renamed for ``layers``; None if there is none
        (or the two programs turn out to differ in more than names: ``relabel`` checks)."""
        twin = self.stage_twins.get(self._twin_key(layers, signature, tie_period)) if self.reuse else None
        if twin is None or twin == layers:
            return None
        built = self.stage_graphs[(twin, signature, tie_period)]
        if self.piece_kinds(self.piece(layers)) != dict(built.argument_kinds):
            return None
        renamed = relabel(built, self.piece(twin).graph, self.piece(layers).graph)
        return None if renamed is None else self.with_batch(renamed, self.piece(layers))

    def stage_cost(self, start: int, end: int, submesh: Shape, logical: Shape, method: str = "alpa") -> LayerCost | None:
        """Layers [start, end) on one logical mesh: the sum of their layer costs (from cumulative sums:
        the DP asks for every range, so each is a difference of two sums, not a sum over the range)."""
        forward, backward, weights, activations, infeasible = self.cumulative_costs(submesh, logical, method)
        if infeasible[end] != infeasible[start]:
            return None
        return LayerCost(
            float(forward[end] - forward[start]),
            float(backward[end] - backward[start]),
            float(weights[end] - weights[start]),
            float(activations[end] - activations[start]),
        )

    def range_costs(self, submesh: Shape, logical: Shape, method: str = "alpa") -> tuple[np.ndarray, ...]:
        """``stage_cost`` for every [start, end] at once: time, weight memory, activation memory and
        feasibility, arrays of (L + 1, L + 1) (the same differences of the same sums, so the same floats)."""
        forward, backward, weights, activations, infeasible = self.cumulative_costs(submesh, logical, method)

        def ranges(sums: np.ndarray) -> np.ndarray:
            return sums[None, :] - sums[:, None]

        return (ranges(forward) + ranges(backward), ranges(weights), ranges(activations),
                infeasible[None, :] == infeasible[:, None])

    def send_seconds(self, start: int, end: int, submesh: Shape) -> float:
        """Per micro-batch, the boundary transfer of the stage holding layers [start, end) on ``submesh``.

        As ``boundary_parts`` prices a placed stage: the heavier direction of what it sends to
        later stages (tensors it computes that later layers read) and what it gets back from them
        (tensors later layers compute that it reads), over the link the next stage is likely on:
        another host's when the stage holds whole hosts, its own host's otherwise (the DP does not
        know placements; ``boundary_parts`` prices the placed stages exactly). 0 for the last stage.
        """
        if end >= self.slicing.num_layers:
            return 0.0
        return self.exchanged_bytes(start, end) / self._send_bandwidth(submesh)

    def send_seconds_table(self, submesh: Shape) -> np.ndarray:
        """``send_seconds`` for every [start, end] of ``submesh``."""
        table = self.exchanged_bytes_table() / self._send_bandwidth(submesh)
        table[:, self.slicing.num_layers:] = 0.0
        return table

    def _send_bandwidth(self, submesh: Shape) -> float:
        c = self.cluster
        whole_hosts = submesh[1] == c.devices_per_host and c.hosts > 1
        return c.host_link if whole_hosts else c.intra_host_bandwidth

    def exchanged_bytes(self, start: int, end: int) -> float:
        """Per micro-batch, the heavier direction of what the stage of layers [start, end) exchanges
        with later stages (``_send_bytes``)."""
        return float(self.exchanged_bytes_table()[start, end])

    def exchanged_bytes_table(self) -> np.ndarray:
        """``exchanged_bytes`` for every [start, end], made once."""
        if self.send_bytes is None:
            self.send_bytes = _send_bytes(self.graph, self.slicing, self.consumers or self.graph.consumers())
        return self.send_bytes

    def prefetch_layer_costs(
        self, meshes: Sequence[tuple[Shape, Shape]], method: str, more: Callable[[Shape, Shape], Sequence[str]],
        workers: int | None = None, report: Callable[[], None] | None = None,
    ) -> None:
        """Solve the layer ILPs the DP will ask for, one mesh per task, ``workers`` tasks at a time
        (default ``plan_workers()``).

        Per mesh: every distinct layer in ``method``, then in ``more(submesh, logical)`` (the layouts
        the DP will also ask for there, which need ``method``'s costs to know) while that mesh's
        layer graphs are still kept. Each solve is the one ``layer_cost`` would make, stored under its key.
        A large problem's meshes go to forked worker processes (``_fork_pool_ok``): strategy graphs and
        reductions are Python and hold the GIL, so threads overlap only CBC; a small one's go to threads,
        where a fork would cost more than it saves. ``report`` is called (in this thread) as each mesh is done.
        """
        global _FORKED_JOB
        workers = plan_workers() if workers is None else workers
        reps = self._layer_reps()
        todo = [m for m in meshes if any(self.layer_key(k, *m, method) not in self.layer_costs for k in reps)]
        if workers < 2 or len(todo) < 2:
            return
        # a (1, n) view whose (n, 1) twin is also asked for goes once that one is done, and copies what the two
        # share; the rest go largest logical mesh first (the longest ILPs: a long one last would leave a worker idle)
        after: dict[tuple[Shape, Shape], tuple[Shape, Shape]] = {}
        for m in todo:
            twin = self.transposed_twin(*m, method)
            if twin is not None and (m[0], twin) in todo:
                after[(m[0], twin)] = m
        first = sorted((m for m in todo if m not in after.values()), key=lambda m: -m[1][0] * m[1][1])
        t0 = time.perf_counter()
        forked = self._fork_pool_ok(len(todo))
        if forked:
            for lay in reps.values():  # cut before the fork, so every worker shares the pieces
                self._layer_piece(lay)
        # one fork pool at a time in this process: its workers find their job in a module global, and the
        # warning filter below is process-wide (planners in two threads take turns here; threads need neither)
        with _FORK_LOCK if forked else contextlib.nullcontext(), warnings.catch_warnings() if forked else contextlib.nullcontext():
            if forked:
                # JAX warns at every fork of a process it runs in; the workers never call JAX (numpy, CBC)
                warnings.filterwarnings("ignore", message=r".*fork\(\)", category=RuntimeWarning)
                warnings.filterwarnings("ignore", message=r".*fork\(\)", category=DeprecationWarning)
                _FORKED_JOB = (self, method, more)
            try:
                self._run_pool(forked, workers, first, after, method, more, report)
            except BrokenExecutor:  # a worker process died (killed, out of memory): what is missing is solved here, on demand
                pass
            finally:
                _FORKED_JOB = None
        self.seconds["intra_op"] = self.seconds.get("intra_op", 0.0) + time.perf_counter() - t0

    def _run_pool(
        self, forked: bool, workers: int, first: list, after: dict, method: str,
        more: Callable[[Shape, Shape], Sequence[str]], report: Callable[[], None] | None,
    ) -> None:
        """``prefetch_layer_costs``' meshes through a fork pool (``forked``) or threads, twins after their first view."""
        if forked:
            pool: Any = ProcessPoolExecutor(max_workers=min(workers, len(first) + len(after)), mp_context=mp.get_context("fork"))
        else:
            pool = ThreadPoolExecutor(max_workers=workers)
        with pool:
            def submit(m: tuple[Shape, Shape], known: dict) -> Any:
                if forked:
                    return pool.submit(_price_mesh_forked, m, known)
                return pool.submit(self._price_mesh, m, method, more)

            running = {submit(m, {}): m for m in first}
            while running:
                done, _ = wait(running, return_when=FIRST_COMPLETED)
                for future in done:
                    m = running.pop(future)
                    found = future.result()
                    if forked:
                        self.layer_costs.update(found)
                    if m in after:
                        running[submit(after[m], found if forked else {})] = after[m]
                    if report is not None:
                        report()

    def _layer_reps(self) -> dict[int, int]:
        """layer key -> the first layer of that kind"""
        return {self.layer_keys[lay]: lay for lay in reversed(range(self.slicing.num_layers))}

    def _price_mesh(self, mesh: tuple[Shape, Shape], method: str, more: Callable[[Shape, Shape], Sequence[str]]) -> None:
        """Every distinct layer's cost on ``mesh`` in ``method``, then in ``more(*mesh)``, into ``layer_costs``."""
        reps = self._layer_reps()

        def solve(how: str) -> None:
            twin = self.transposed_twin(*mesh, how)
            for k, lay in reps.items():
                key = self.layer_key(k, *mesh, how)
                if key in self.layer_costs:
                    continue
                if twin is not None and self.layer_key(k, mesh[0], twin, how) in self.layer_costs:
                    self.layer_costs[key] = self.layer_costs[self.layer_key(k, mesh[0], twin, how)]
                else:
                    self.layer_costs[key] = self._solve_layer(lay, *mesh, how)

        solve(method)
        for how in more(*mesh):
            solve(how)

    def _fork_pool_ok(self, num_meshes: int) -> bool:
        """Price the meshes in forked processes: where the work is large enough to repay forking this process,
        the platform forks, and no Ray driver runs here (its client's threads should not be forked)."""
        ops = sum(len(self.slicing.ops_of([lay], (FORWARD, BACKWARD))) for lay in self._layer_reps().values())
        if ops * num_meshes < FORK_MIN_WORK or "fork" not in mp.get_all_start_methods():
            return False
        ray = sys.modules.get("ray")
        return not (ray is not None and getattr(ray, "is_initialized", lambda: False)())

    def cumulative_costs(self, submesh: Shape, logical: Shape, method: str = "alpa") -> tuple[np.ndarray, ...]:
        """Forward, backward, weight and activation costs summed over layers [0, k), and how many of
        those layers are infeasible, for k = 0..L (arrays of L + 1); every layer is priced once."""
        key = (submesh, logical, method, self.dp_axis(method))
        if key not in self.prefixes:
            costs = [self.layer_cost(lay, submesh, logical, method) for lay in range(self.slicing.num_layers)]
            table = np.array([(0.0, 0.0, 0.0, 0.0, 1.0) if c is None else (*dataclasses.astuple(c), 0.0) for c in costs])
            sums = np.vstack([np.zeros((1, 5)), np.cumsum(table.reshape(-1, 5), axis=0)])
            self.prefixes[key] = tuple(sums[:, j] for j in range(5))
        return self.prefixes[key]


    # ----- a PipelinePlan's edits (``plan.pipeline.PipelinePlanProblem``): the plan is data, the work is here -----
    def replan(
        self, plan: PipelinePlan, stages: Sequence[tuple], pins: Mapping[str, str], stage_pins: bool, schedule: str | None = None
    ) -> PipelinePlan:
        """``plan`` with ``stages`` (layers, sub-mesh, logical mesh, devices each) planned with ``pins`` (cached
        stages are reused) and simulated under ``schedule`` (default: the plan's); memory checked (eq. 5)."""
        schedule = schedule or plan.schedule
        results, timeline = plan_stages(
            self, stages, num_microbatches=plan.num_microbatches, schedule=schedule, method=plan.method, pins=pins
        )
        check_memory(results, ClusterSpec(**plan.cluster))
        return dataclasses.replace(plan, stages=results, timeline=timeline, stage_pins=stage_pins, schedule=schedule)

    def with_schedule(self, plan: PipelinePlan, schedule: str, chunks: int) -> PipelinePlan:
        """``PipelinePlan.with_schedule``: the same stages under ``schedule`` (interleaved: ``chunks`` per mesh)."""
        if (schedule == INFERENCE) != self.inference:
            raise InterOpError(
                "an inference plan (a step without gradients) runs the inference schedule only" if self.inference else
                f"schedule {schedule!r} runs a step without gradients; this step takes them: choose a training schedule")
        stages = plan._current_stages()
        if schedule == "interleaved_1f1b" and plan.num_meshes == plan.num_stages:
            stages = interleave(stages, plan.num_layers, chunks)
        return self.replan(plan, stages, dict(plan.pins), plan.stage_pins, schedule)

    def pin_stages(self, plan: PipelinePlan, layers: Any, submeshes: Any, logical_shapes: Any) -> PipelinePlan:
        """``PipelinePlan.pin_stages``: the stages the user gives (``fixed_stages``), op pins kept."""
        return self.replan(plan, fixed_stages(self, layers, submeshes, logical_shapes), dict(plan.pins), True)

    def unpin_stages(self, plan: PipelinePlan) -> PipelinePlan:
        """``PipelinePlan.unpin_stages``: the stages the DP chooses (layer costs from this problem's cache)."""
        return self.replan(plan, self._dp_stages(plan, ClusterSpec(**plan.cluster)), dict(plan.pins), False)

    def _dp_stages(self, plan: PipelinePlan, cluster: ClusterSpec) -> list[tuple]:
        """The stages the DP chooses for ``plan``'s program on ``cluster`` (its method, schedule, ``max_stages``);
        for an interleaved plan, 1F1B's stages interleaved again with as many chunks."""
        interleaved = plan.schedule == "interleaved_1f1b"
        _, stages, _ = plan_pipeline(
            self.graph, cluster, num_microbatches=plan.num_microbatches,
            schedule="1f1b" if interleaved else plan.schedule, method=plan.method, max_stages=plan.max_stages,
            problem=self, logical_meshes=self.logical_meshes, submesh_space=plan.submesh_space,
            batch_mesh_axis=self.batch_mesh_axis, forbidden=self.forbidden,
            weight_update_sharding=self.weight_update_sharding,
        )
        chosen = [(st.layers, st.submesh_shape, st.logical_shape, st.device_ids) for st in stages]
        if interleaved:
            chosen = interleave(chosen, plan.num_layers, plan.num_stages // plan.num_meshes)
        return chosen

    def recalibrated(self, plan: PipelinePlan, profile: Any) -> PipelinePlan:
        """``PipelinePlan.recalibrated``: ``plan`` re-solved from scratch with ``profile.cluster()``, by a new
        problem over the same program, reuse and cost model (this one's caches hold the old costs)."""
        measured_on = (profile.cluster_spec["hosts"], profile.cluster_spec["devices_per_host"])
        if measured_on != (plan.cluster["hosts"], plan.cluster["devices_per_host"]):
            raise ProfileError(
                f"the profile was measured on {profile.cluster_spec['hosts']}x{profile.cluster_spec['devices_per_host']} devices "
                f"but this plan is for {plan.cluster['hosts']}x{plan.cluster['devices_per_host']}: profile a run of a plan for this cluster"
            )
        cluster = profile.cluster()
        t0 = time.perf_counter()
        new = PipelineProblem.build(self.graph, cluster, reuse=self.reuse)
        new.forbidden, new.weight_update_sharding = self.forbidden, self.weight_update_sharding
        new.stage_timer, new.batch_vars, new.split_vars = self.stage_timer, self.batch_vars, self.split_vars
        new.batch_mesh_axis, new.stage_batch_axes = self.batch_mesh_axis, dict(self.stage_batch_axes)
        new.logical_meshes, new.submesh_space = self.logical_meshes, plan.submesh_space
        if plan.stage_pins:
            # the user fixed the stages: keep them as planned (chunks of an interleaved plan share
            # meshes, which fixed_stages would place apart), and each stage's layout (memory-saving or not)
            chosen = plan._current_stages()
            if plan.method == "alpa":
                for st in plan.stages:
                    if st.plan.method != plan.method:
                        new.stage_methods[(st.layers, st.submesh_shape, st.logical_shape)] = st.plan.method
        else:
            chosen = new._dp_stages(plan, cluster)
        fresh = dataclasses.replace(
            plan, cluster=cluster.to_dict(), problem=new,
            planning_seconds={"recalibrate": time.perf_counter() - t0, **new.seconds},
        )
        return new.replan(fresh, chosen, dict(plan.pins), plan.stage_pins)

    def attach(self, plan: PipelinePlan) -> PipelinePlan:
        """``PipelinePlan.attach``: ``plan`` (loaded from JSON) with this problem as its planner state.

        Each stage's ``Plan`` gets its strategy graph (``stage_graph``, cached here); this problem
        learns the layout each stage was planned with (a DP-chosen memory-saving one stays on
        re-plans) and caches the stage plans, so an edit re-solves only the stages it touches.
        Raises ``PlanFormatError`` when the plan does not fit (another program, another cluster,
        stage plans that are not this program's), before recording anything here but strategy graphs.
        """
        plan.check_program(self.graph)
        if self.slicing.num_layers != plan.num_layers:
            raise PlanFormatError(
                f"this pipeline plan cuts the program into {plan.num_layers} layers but the traced program has "
                f"{self.slicing.num_layers}; re-plan with step.plan(...)"
            )
        if self.cluster.to_dict() != dict(plan.cluster):
            raise PlanFormatError("the planner state given is for another cluster than this pipeline plan's")
        graphs = []
        for st in plan.stages:
            period = int(st.plan.solver.get("tie_period", 1))
            sg = self.stage_graph(st.layers, st.submesh_shape, st.logical_shape, st.device_ids, period, plan.num_microbatches)
            if sg.fingerprint != st.plan.fingerprint:
                raise PlanFormatError(
                    f"stage {st.index}'s plan (layers {st.layers[0]}..{st.layers[1] - 1}) belongs to another program "
                    f"than that stage of the traced program (or was saved by an alpa_lab that cut stages otherwise); "
                    f"re-plan with step.plan(...)"
                )
            _check_choices(st, sg)
            graphs.append(sg)
        # every stage was planned with one setting (``plan_pipeline``): re-plans keep it
        self.set_weight_update_sharding(all(st.plan.weight_update_sharding for st in plan.stages))
        stages = []
        for st, sg in zip(plan.stages, graphs):
            if plan.method == "alpa":  # as plan_pipeline records the DP's choice of layout
                if st.plan.method != plan.method:
                    self.stage_methods[(st.layers, st.submesh_shape, st.logical_shape)] = st.plan.method
                else:
                    self.stage_methods.pop((st.layers, st.submesh_shape, st.logical_shape), None)
            # as ``fixed_stages``' caller records a stage's forced batch axis: a loaded plan keeps it on re-plans
            if st.plan.batch_mesh_axis != self.stage_axis(st.layers, st.submesh_shape, st.logical_shape):
                forced = -1 if st.plan.batch_mesh_axis is None else st.plan.batch_mesh_axis
                self.stage_batch_axes[(st.layers, st.submesh_shape, st.logical_shape)] = forced
            key = (st.layers, st.logical_shape, st.device_ids, st.plan.method, tuple(sorted(dict(st.plan.pins).items())),
                   st.plan.batch_mesh_axis, plan.num_microbatches)
            if st.plan.batch_mesh_axis is not None:  # as _plan_stage solved it: a pin on the stage's plan keeps it
                sg = dataclasses.replace(sg, batch_mesh_axis=st.plan.batch_mesh_axis)
            if not st.plan.weight_update_sharding:
                sg = dataclasses.replace(sg, weight_update_sharding=False)
            cached = self.stage_plans.get(key)
            if cached is not None and cached == st.plan and (
                    cached.problem is sg or st.plan.batch_mesh_axis is not None or not st.plan.weight_update_sharding):
                stage_plan = cached
            else:
                stage_plan = dataclasses.replace(st.plan, problem=sg)
                self.stage_plans.setdefault(key, stage_plan)
            stages.append(dataclasses.replace(st, plan=stage_plan))
        return dataclasses.replace(plan, stages=tuple(stages), problem=self)


def _check_choices(st: StageResult, sg: StrategyGraph) -> None:
    """Each op of a stage's plan is a node of its strategy graph, with a strategy that node offers."""
    if [o.name for o in st.plan.ops] != [n.name for n in sg.nodes]:
        raise PlanFormatError(f"stage {st.index}'s plan does not list the ops of that stage's program; re-plan with step.plan(...)")
    for o, node in zip(st.plan.ops, sg.nodes):
        if o.strategy not in {s.name for s in node.strategies}:
            raise PlanFormatError(
                f"stage {st.index}'s plan gives {o.name!r} the strategy {o.strategy!r}, which the planner does not "
                f"offer for it (see plan.stages[{st.index}].plan.explain({o.name!r}) on a planned step)"
            )


def _send_bytes(graph: OpGraph, slicing: ProgramSlicing, consumers: Mapping[int, Sequence[int]]) -> np.ndarray:
    """[start, end] -> bytes per micro-batch the stage of layers [start, end) exchanges with later stages,
    the heavier direction: max(tensors it computes that a layer >= end reads, tensors a layer >= end
    computes that it reads), each tensor once (``boundary_parts`` counts the same tensors on placed
    stages; it counts a tensor once per reading stage). The update's tensors are left out."""
    L = slicing.num_layers
    # out[p, e]: bytes computed in layer p and read in a layer >= e (p < e); back[q, e]: bytes read first
    # in layer q and computed in a layer >= e (q < e); a stage [s, e) sums its rows s..e-1 (others are 0)
    out, back = np.zeros((L + 1, L + 2)), np.zeros((L + 1, L + 2))  # difference arrays along e
    for op in graph.ops:
        if slicing.phase[op.index] == APPLY:
            continue
        p = slicing.layer[op.index]
        for v in op.outputs:
            readers = [slicing.layer[c] for c in consumers[v] if slicing.phase[c] != APPLY]
            later = max((q for q in readers if q > p), default=None)
            first = min((q for q in readers if q < p), default=None)
            nbytes = graph.vars[v].nbytes
            if later is not None:  # sent by a stage holding p and ending at e in p + 1 .. later
                out[p, p + 1] += nbytes
                out[p, later + 1] -= nbytes
            if first is not None:  # received by a stage holding its first reader, ending at e in first + 1 .. p
                back[first, first + 1] += nbytes
                back[first, p + 1] -= nbytes
    out, back = np.cumsum(out, axis=1)[:, : L + 1], np.cumsum(back, axis=1)[:, : L + 1]
    # [s, e] = sum over rows s..L of column e (rows >= e are 0 in that column): suffix sums over rows
    out, back = np.cumsum(out[::-1], axis=0)[::-1], np.cumsum(back[::-1], axis=0)[::-1]
    return np.maximum(out, back)


def _by_layer(graph: OpGraph, slicing: ProgramSlicing, ops: Sequence[int]) -> list[int]:
    """``ops`` (in program order) with those written per parameter (the update's, and the markers of the
    gradients) after the rest, layer by layer, as far as what they read allows (a priority topological order).

    A step writes those over its parameters in their pytree order, which sorts names as strings
    (``Block_10`` and ``Block_11`` before ``Block_9``): in program order, the stage of blocks 9-11 would update
    10, 11, 9 and the stage of 3-5 update 3, 4, 5, two programs that differ in more than names, so the
    second could not take the first's plan (``relabel``)."""
    phase, layer = slicing.phase, slicing.layer
    per_parameter = {i for i in ops if phase[i] == APPLY or _is_marker(graph.ops[i], "gradient")}
    key = {i: (1, layer[i], i) if i in per_parameter else (0, 0, i) for i in ops}
    readers: dict[int, list[int]] = {i: [] for i in ops}
    waiting = dict.fromkeys(ops, 0)
    for i in ops:
        for p in {graph.vars[v].producer for v in graph.ops[i].inputs} & key.keys():
            readers[p].append(i)
            waiting[i] += 1
    ready = [key[i] for i in ops if not waiting[i]]
    heapq.heapify(ready)
    out = []
    while ready:
        i = heapq.heappop(ready)[2]
        out.append(i)
        for r in readers[i]:
            waiting[r] -= 1
            if not waiting[r]:
                heapq.heappush(ready, key[r])
    assert len(out) == len(ops), "a stage's ops read each other in a cycle"
    return out


def _clipped(rest: float, objective: float) -> float:
    """``rest``, what an ILP's ``objective`` has beyond the parts counted (loads, reshardings): the same costs added in
    another order, so its round-off (a layer of markers alone: -1e-25 s) is clipped to 0, but a cost counted twice is
    refused."""
    assert rest >= -1e-9 * max(abs(objective), 1e-12), f"the parts of a plan's costs add up to more than its objective ({rest})"
    return max(rest, 0.0)


def _passes_through(op: Op, graph: OpGraph, consumers: Mapping[int, Sequence[int]], results: frozenset[int]) -> bool:
    """A boundary marker of tensors that only cross the layer: made by ops before it, read by no op of it, only by
    the next boundary's markers (a batch norm's statistics on their way to the end of the step). A marker compiles
    to nothing and costs nothing (``bytes_accessed``), so a layer costs the same with or without such markers, and
    the blocks of a stack, each crossed by the statistics of one block more, are one kind of layer (``layer_keys``;
    tests/test_reuse.py prices each layer from its own program). Not one of an argument (a weight marked by hand:
    the layer holds it) nor one that makes a result (``results``: the program's; the layer sums it over the
    micro-batches)."""
    if op.primitive != "pipeline_marker":
        return False
    return all(graph.vars[v].producer is not None for v in op.inputs) and all(
        v not in results and all(graph.ops[c].primitive == "pipeline_marker" for c in consumers.get(v, ())) for v in op.outputs
    )


def _layer_op_key(op: Op, graph: OpGraph) -> tuple:
    """``_op_key`` without the boundary's name: layer 3 and layer 5 of a stack are the same layer."""
    if op.primitive == "pipeline_marker":
        return ("pipeline_marker", op.params["kind"], tuple(graph.vars[v].shape for v in op.inputs))
    return _op_key(op, graph)


def _plan_stage(
    problem: PipelineProblem,
    layers: tuple[int, int],
    submesh: Shape,
    logical: Shape,
    device_ids: tuple[int, ...],
    method: str,
    pins: Mapping[str, str],
    microbatches: int = 1,
) -> Plan:
    """The plan of one stage in a step of ``microbatches`` (its ILP weighs the update once per step: ``stage_graph``)."""
    method = problem.stage_methods.get((layers, submesh, logical), method) if method == "alpa" else method
    # a memory-saving layout (Megatron, ZeRO-3) fixes where the batch goes itself (``method_restrictions``)
    axis = problem.stage_axis(layers, submesh, logical) if method == "alpa" else None
    mine = {}
    if pins:  # a pin elsewhere leaves this stage's plan cached
        graph = problem.graph
        ops = problem.slicing.ops_of(range(*layers))
        names = {graph.ops[i].name for i in ops} | {graph.vars[v].name for i in ops for v in graph.ops[i].inputs}
        mine = {k: v for k, v in pins.items() if k in names}
    key = (layers, logical, device_ids, method, tuple(sorted(mine.items())), axis, microbatches)
    if key not in problem.stage_plans:
        t0 = time.perf_counter()
        # the same stage placed on other devices with the same links: the same solution
        signature = cost_signature(problem.mesh(submesh, logical, device_ids))
        same = (layers, signature, method, key[-3], axis, microbatches)

        def stage_problem(period: int) -> StrategyGraph:
            sg = problem.stage_graph(layers, submesh, logical, device_ids, period, microbatches)
            if not problem.weight_update_sharding:
                sg = dataclasses.replace(sg, weight_update_sharding=False)
            return sg if axis is None else dataclasses.replace(sg, batch_mesh_axis=axis)

        twin = None
        if same not in problem.stage_solutions and not mine and axis is None:
            twin = _twin_solution(problem, layers, signature, method, microbatches)
        if same in problem.stage_solutions:
            period, solved = problem.stage_solutions[same]
            sg = stage_problem(period)
        elif twin is not None:  # equal layers elsewhere in the stack: the same ILP, its solution renamed
            period, solved = twin
            sg = stage_problem(period)
            problem.stage_solutions[same] = (period, solved)
        else:
            sg, solved = solve_tied(stage_problem, method, mine)
            problem.stage_solutions[same] = (sg.tie_period, solved)
        if sg.weight_update_sharding != problem.weight_update_sharding:  # a cached or twin's graph: as solved
            sg = dataclasses.replace(sg, weight_update_sharding=problem.weight_update_sharding)
        problem.stage_plans[key] = make_plan(
            sg, solved, method=method, cluster=problem.cluster.to_dict(), pins=mine, memory_budget=None
        )
        problem.seconds["stage_plans"] = problem.seconds.get("stage_plans", 0.0) + time.perf_counter() - t0
    return problem.stage_plans[key]


def _twin_solution(
    problem: PipelineProblem, layers: tuple[int, int], signature: LogicalMesh, method: str, microbatches: int
) -> tuple | None:
    """(tie period, solution) of ``layers`` taken from a solved stage of equal layers on an equal mesh, if any.

    The solution chooses per group of the ILP, and a renamed problem (``relabel``) has the same
    groups and costs, so it is the solution of this stage too (at the tie period it was found at).
    """
    for period in TIE_PERIODS:
        twin = problem.stage_twins.get(problem._twin_key(layers, signature, period))
        solved_as = (twin, signature, method, (), None, microbatches)
        if twin is None or twin == layers or solved_as not in problem.stage_solutions:
            continue
        found_period, solved = problem.stage_solutions[solved_as]
        if found_period != period:
            continue
        sg = problem.stage_graphs.get((layers, signature, period)) or problem._twin_graph(layers, signature, period)
        built = problem.stage_graphs[(twin, signature, period)]
        if sg is not None and sg.cost_graph is built.cost_graph and sg.batch_vars == built.batch_vars:
            problem.stage_graphs[(layers, signature, period)] = sg
            # what the method restricted or rewrote is named after the twin's ops: rename it too
            name = {a.name: b.name for a, b in zip(built.nodes, sg.nodes)}
            rewrites = tuple(f"{name[r.split(': ', 1)[0]]}: {r.split(': ', 1)[1]}" for r in solved.rewrites)
            restrictions = {name[k]: v for k, v in solved.restrictions.items()}
            return period, dataclasses.replace(solved, restrictions=restrictions, rewrites=rewrites)
    return None


def accumulation_seconds(problem: PipelineProblem, plan: Plan, layers: tuple[int, int]) -> dict[str, float]:
    """Per op of the stage whose results are summed over the micro-batches (weight gradients, the loss): seconds
    of its sums each micro-batch (``runtime.accumulate``), on the op's planned output tiles."""
    graph, accumulated = problem.graph, problem.accumulated
    out: dict[str, float] = {}
    if not accumulated:
        return out
    planned = {o.name: o.output_specs for o in plan.ops if o.kind == "op"}
    for i in problem.slicing.ops_of(range(*layers)):
        op = graph.ops[i]
        summed = [(pos, v) for pos, v in enumerate(op.outputs) if v in accumulated]
        if summed:
            specs = planned.get(op.name)
            out[op.name] = sum(
                sum_seconds(problem.cluster, graph.vars[v], ShardingSpec.parse(specs[pos]).num_shards(plan.mesh_shape) if specs else 1)
                for pos, v in summed
            )
    return out


def sum_seconds(cluster: ClusterSpec, var: Any, tiles: int) -> float:
    """Seconds of adding one micro-batch's ``var`` into its sum on a 1/``tiles`` tile (two tiles read, one
    written): an op's roofline and overhead, and what a tensor of the sums program costs beyond (its own
    kernel and result, ``ClusterSpec.sum_overhead``)."""
    elems, nbytes = math.prod(var.shape) / tiles, var.nbytes / tiles
    return max(elems / cluster.device_flops, 3 * nbytes / cluster.memory_bandwidth) + cluster.op_overhead + cluster.sum_overhead


def stage_parts(problem: PipelineProblem, plan: Plan, layers: tuple[int, int]) -> dict[str, CostParts]:
    """A stage's predicted forward, backward and update, split into the cost model's terms (``cost.profile``).

    Each resharding is charged to the phase of the op that reads it (one into a returned
    weight's layout, to the update); what the objective has
    beyond the ops and those (reshardings read by no op of the stage) goes to the forward.
    Each phase runs as one program (a unit task) per micro-batch, the update once per step:
    one launch each. A phase that makes tensors summed over the micro-batches (the backward's
    weight gradients, the loss) adds their sums, one more program (``accumulation_seconds``). The
    average, once per step and per mesh (``runtime.accumulate.averaged``), is left out, as the
    runtime records it in no phase.
    """
    stage_ops = problem.slicing.ops_of(range(*layers))
    phase = {problem.graph.ops[i].name: problem.slicing.phase[i] for i in stage_ops}
    compute = {FORWARD: 0.0, BACKWARD: 0.0, APPLY: 0.0}
    comm = {FORWARD: 0.0, BACKWARD: 0.0, APPLY: 0.0}
    for o in plan.ops:
        if o.kind == "op":
            p = phase.get(o.name, FORWARD)
            compute[p] += o.compute_cost
            comm[p] += o.communication_cost
    rest = plan.objective - sum(compute.values()) - sum(comm.values())
    for r in plan.reshardings:
        # a program output returned in its argument's layout (the updated weights and optimizer
        # state): the update's last step, not every micro-batch's forward
        p = APPLY if r.consumer.startswith("output ") else phase.get(r.consumer, FORWARD)
        if p != FORWARD:
            comm[p] += r.cost
            rest -= r.cost
    comm[FORWARD] += _clipped(rest, plan.objective)
    launches = {p: 1.0 if (p == FORWARD or compute[p] or comm[p]) else 0.0 for p in (FORWARD, BACKWARD, APPLY)}
    for name, add in accumulation_seconds(problem, plan, layers).items():  # beyond the objective
        p = phase.get(name, FORWARD)
        compute[p] += add
        launches[p] = 2.0  # the phase's program, and its sums'
    return {p: CostParts(compute[p], comm[p], launches[p]) for p in (FORWARD, BACKWARD, APPLY)}


def _stage_figures(problem: PipelineProblem, plan: Plan, layers: tuple[int, int]) -> tuple[float, float, float, float, float]:
    """Forward, backward and update seconds; weight and activation bytes, from a stage plan."""
    stage_ops = problem.slicing.ops_of(range(*layers))
    saved = {problem.graph.ops[i].name for i in stage_ops if i in problem.saved}
    weights = activations = 0.0
    kinds_by_name = {problem.graph.vars[v].name: k for v, k in problem.argument_kinds.items()}
    for o in plan.ops:
        if o.kind != "op":
            if kinds_by_name.get(o.name) in ("param", "optimizer_state"):
                weights += o.memory_cost
        elif o.name in saved:
            activations += o.memory_cost
    parts = stage_parts(problem, plan, layers)
    forward, backward, update = (parts[p].seconds(problem.cluster) for p in (FORWARD, BACKWARD, APPLY))
    return forward, backward, update, weights, activations


def plan_stages(
    problem: PipelineProblem,
    stages: Sequence[tuple[tuple[int, int], Shape, Shape, tuple[int, ...]]],
    *,
    num_microbatches: int,
    schedule: str,
    method: str = "alpa",
    pins: Mapping[str, str] | None = None,
    records: bool = True,
) -> tuple[tuple[StageResult, ...], Timeline]:
    """Plan each stage (layers, sub-mesh, logical mesh, devices) and simulate the schedule.

    Stages that share devices are the virtual stages of an interleaved plan: stage j must
    then run on mesh j % P (P distinct meshes), as ``interleaved_1f1b`` places them.
    ``records=False``: the timeline without its per-instruction records (``simulated_timeline``
    makes them later for the candidate that is kept).
    """
    split = schedule in SPLIT_BACKWARD
    peaks = _stage_peaks(problem, stages, schedule, num_microbatches)
    deferred: set[str] = set()
    if split:
        stage_of_op = problem.slicing.stage_of_ops([layers for layers, *_ in stages])
        deferred = {problem.graph.ops[i].name for i in weight_gradient_ops(problem.graph, problem.slicing, stage_of_op)}
    results = []
    for i, (layers, submesh, logical, devices) in enumerate(stages):
        try:
            plan = _plan_stage(problem, layers, submesh, logical, devices, method, dict(pins or {}), num_microbatches)
        except PinError as exc:  # a pin made on another mesh: say where the stages put the op
            raise PinError(
                f"stage {i} (layers {layers[0]}-{layers[1] - 1}) on a {logical[0]}x{logical[1]} logical mesh: {exc}; unpin "
                "the op, or pin the stages (pin_stages) on meshes where that strategy exists", exc.pins) from exc
        except MethodError as exc:  # e.g. a forced batch axis the stage's micro-batch does not divide: say which stage
            raise MethodError(f"stage {i} (layers {layers[0]}-{layers[1] - 1}) on a {logical[0]}x{logical[1]} logical mesh: {exc}; "
                              "give that stage another logical mesh (ManualStageOption(submesh_logical_shapes=...))") from exc
        f, b, a, w, act = _stage_figures(problem, plan, layers)
        wt = sum(o.compute_cost + o.communication_cost for o in plan.ops if o.name in deferred)
        if deferred:  # the weight gradients' sums run after W, in its RUN
            sums = [add for name, add in accumulation_seconds(problem, plan, layers).items() if name in deferred]
            wt += sum(sums) + (problem.cluster.task_overhead if sums else 0.0)
        results.append(
            StageResult(i, layers, submesh, logical, devices, plan, f, b, a, w, act, peaks[i], wt)
        )
    if problem.stage_timer is not None:
        sched = _stage_schedule(problem, stages, schedule, num_microbatches)
        results = _measured(problem.stage_timer(problem, results, sched), results, split)
    return tuple(results), simulated_timeline(problem, results, schedule, num_microbatches, records=records)


def simulated_timeline(
    problem: PipelineProblem, results: Sequence[StageResult], schedule: str, num_microbatches: int, records: bool = True
) -> Timeline:
    """The schedule of planned stages simulated with their times and placed boundary transfers."""
    stages = [(r.layers, r.submesh_shape, r.logical_shape, r.device_ids) for r in results]
    if _without_lists(stages, schedule):  # the same timeline
        return warmup_timeline(schedule, [r.forward_time for r in results], [r.backward_time for r in results],
                               _transfer_time(problem, results), num_microbatches, records=records)
    sched = _stage_schedule(problem, stages, schedule, num_microbatches)
    split = sched.split_backward
    return simulate(
        sched,
        forward_time=[r.forward_time for r in results],
        backward_time=[r.backward_input_time if split else r.backward_time for r in results],
        transfer_time=_transfer_time(problem, results),
        weight_time=[r.weight_gradient_time for r in results] if split else None,
        records=records,
    )


def _without_lists(stages: Sequence[tuple], schedule: str) -> bool:
    """Whether ``schedule`` over ``stages`` is a warm-up schedule with one stage per mesh, whose makespan, timeline
    and peaks ``passes.schedule`` works out without building its instruction lists (``warmup_timeline``)."""
    return schedule in WARMUP_SCHEDULES and _num_meshes(stages, schedule) is None


def _stage_peaks(problem: PipelineProblem, stages: Sequence[tuple], schedule: str, num_microbatches: int) -> tuple[int, ...]:
    """Each stage's most micro-batches in flight: a warm-up schedule's from its shape (``warmup_peaks``), another's
    from its program."""
    if _without_lists(stages, schedule):
        return warmup_peaks(schedule, len(stages), num_microbatches)
    return _stage_schedule(problem, stages, schedule, num_microbatches).program.peak_in_flight


def _stage_schedule(problem: PipelineProblem, stages: Sequence[tuple], schedule: str, num_microbatches: int) -> Schedule:
    """The schedule of ``stages``, kept on the problem: it depends only on the stage count, meshes and
    micro-batches, which candidates share. Its program (``Schedule.program``: what each instruction waits
    for, the peaks in flight) is made once too, and refuses a deadlock. The full proof (``schedule.check``)
    is not run here: the generators are checked by the tests, up to the paper's sizes. Planning asks for it
    only where a warm-up schedule's shortcuts (``warmup_timeline``, ``warmup_peaks``) do not apply."""
    key = (schedule, len(stages), num_microbatches, _num_meshes(stages, schedule))
    if key not in problem.schedules:
        problem.schedules[key] = stage_schedule(stages, schedule, num_microbatches)
    return problem.schedules[key]


def _candidate_costs(problem: PipelineProblem, inter: InterOpPlan, method: str) -> tuple[list[tuple], list[LayerCost | None]]:
    """A DP candidate's stages (layers, sub-mesh, logical mesh, devices) and their layer costs."""
    stages = [(st.layers, st.submesh_shape, st.logical_shape, st.device_ids) for st in inter.stages]
    return stages, [problem.stage_cost(*st.layers, st.submesh_shape, st.logical_shape, st.variant or method) for st in inter.stages]


def estimated_step(problem: PipelineProblem, inter: InterOpPlan, schedule: str, method: str = "alpa") -> float:
    """A DP candidate's simulated step before its stages are planned: the schedule simulated with each
    stage's forward and backward from its layers' costs (the DP's), and the placed boundary transfers.

    It leaves out what only a stage plan knows (the update, the reshardings between a stage's layers)
    and each layer's ILP is a relaxation of its part in the stage's ILP, so it is about a floor of
    the planned candidate's step: ``plan_pipeline`` plans candidates cheapest first and skips those
    whose floor is already above the best planned step (``tests/test_plan_speed.py`` checks the floor
    against the planned steps, and the screened choice against planning every candidate).
    """
    stages, costs = _candidate_costs(problem, inter, method)
    if schedule in SPLIT_BACKWARD or any(c is None for c in costs):
        return 0.0  # a split backward's weight gradients fill bubbles: the layers' backward is no floor; plan it
    forward, backward, links = [c.forward for c in costs], [c.backward for c in costs], _transfer_time(problem, inter.stages)
    if _without_lists(stages, schedule):  # its makespan
        return warmup_makespan(schedule, forward, backward, links, inter.num_microbatches)
    sched = _stage_schedule(problem, stages, schedule, inter.num_microbatches)
    return simulate(sched, forward_time=forward, backward_time=backward, transfer_time=links, records=False).makespan


def quick_bounds(problem: PipelineProblem, inter: InterOpPlan, schedule: str, method: str = "alpa") -> tuple[float, float]:
    """A DP candidate's (floor, estimate) of its planned step from its layers' costs, without a simulation.

    Floor: stage i runs B forwards and B backwards one after another, the first cannot start
    before micro-batch 0 came through stages 0..i - 1, and the step ends after the last
    gradient went back through them: max_i sum_{j<i} (F_j + B_j + 2 c_j) + B t_i, with each
    boundary's per-micro-batch bytes (``exchanged_bytes``, at most what ``boundary_parts`` counts)
    on its placed link; below ``estimated_step`` (which simulates the same costs). Estimate: for
    1F1B ``one_f_one_b_estimate``, else the floor. (0, 0) where nothing bounds the step: a split
    backward (its weight gradients need not wait), or a stage with no cost.
    """
    stages, costs = _candidate_costs(problem, inter, method)
    if schedule in SPLIT_BACKWARD or _num_meshes(stages, schedule) is not None or any(c is None for c in costs):
        return 0.0, 0.0
    B = inter.num_microbatches
    links = [problem.exchanged_bytes(*st.layers) / bw for st, bw in zip(inter.stages, link_bandwidths(problem.cluster, inter.stages))]
    t = [x.time for x in costs]
    floor, before = 0.0, 0.0
    for i, x in enumerate(costs):
        floor = max(floor, before + B * x.time)
        if i < len(links):
            before += x.time + 2 * links[i]
    estimate = one_f_one_b_estimate(t, links, B) if schedule == "1f1b" else floor
    return floor, estimate


def boundary_parts(problem: PipelineProblem, stages: Sequence[StageResult]) -> list[CostParts]:
    """Per boundary i (stage i to i + 1): the heavier direction's transfer per micro-batch, as cost terms.

    Activations go forward, gradients come back; each direction is one message per tensor
    (``transfers`` counts the boundary once: one message's fixed cost, as the runtime overlaps them).
    """
    var, reader, producer, nbytes = stage_reads(problem)
    S = len(stages)
    stage_of_op = np.asarray(problem.slicing.stage_of_ops([st.layers for st in stages]), dtype=np.int64)
    src, dst = stage_of_op[producer], stage_of_op[reader]
    _, first = np.unique(var * S + dst, return_index=True)  # a tensor crosses to a stage once, however many ops read it
    src, dst, nbytes = src[first], dst[first], nbytes[first]
    ahead, back = src < dst, src > dst
    # bytes stage i sends to i + 1 (activations), and receives back from it (gradients), per micro-batch;
    # whole byte counts, so the sums are exact in any order
    forward = np.bincount(src[ahead], weights=nbytes[ahead], minlength=S)
    backward = np.bincount(dst[back], weights=nbytes[back], minlength=S)
    out = []
    for i, bw in enumerate(link_bandwidths(problem.cluster, stages)):
        crossing = float(max(forward[i], backward[i]))
        out.append(CostParts(communication=crossing / bw, transfers=1.0 if crossing else 0.0))
    return out


def stage_reads(problem: PipelineProblem) -> tuple[np.ndarray, ...]:
    """(var, reading op, producing op, bytes) arrays of every read, by an op outside the update, of a tensor an op
    outside the update computed: made once per problem (``boundary_parts`` prices every candidate's boundaries)."""
    if problem.reads is None:
        graph, phase = problem.graph, problem.slicing.phase
        rows = [
            (v, op.index, p, graph.vars[v].nbytes)
            for op in graph.ops if phase[op.index] != APPLY
            for v in op.inputs
            if (p := graph.vars[v].producer) is not None and phase[p] != APPLY
        ]
        table = np.asarray(rows, dtype=np.int64).reshape(-1, 4)
        problem.reads = (table[:, 0], table[:, 1], table[:, 2], table[:, 3].astype(np.float64))
    return problem.reads


def link_bandwidths(cluster: ClusterSpec, stages: Sequence[Any]) -> list[float]:
    """Per boundary i (placed stage i to i + 1): the link between them, inside a host (its stages' devices
    on the same hosts) or between hosts (a host's network link, ``ClusterSpec.host_link``)."""
    hosts = [{d // cluster.devices_per_host for d in st.device_ids} for st in stages]
    return [cluster.intra_host_bandwidth if a == b else cluster.host_link for a, b in zip(hosts, hosts[1:])]


def _measured(times: Mapping[tuple[int, str], float], stages: Sequence[StageResult], split: bool) -> list[StageResult]:
    """Stage results with the profiling cost model's times in place of the analytic ones."""
    out = []
    for st in stages:
        i = st.index
        if split:
            w = times.get((i, BACKWARD_WEIGHT), 0.0)
            backward = times.get((i, BACKWARD_INPUT), 0.0) + w
        else:
            w, backward = 0.0, times.get((i, BACKWARD), 0.0)
        out.append(dataclasses.replace(
            st, forward_time=times.get((i, FORWARD), 0.0), backward_time=backward, apply_time=times.get((i, APPLY), 0.0),
            weight_gradient_time=w,
        ))
    return out


def _transfer_time(problem: PipelineProblem, stages: Sequence[StageResult]) -> list[float]:
    """Per boundary (stage i to i + 1), its activation (or gradient) transfer per micro-batch."""
    return [p.seconds(problem.cluster) for p in boundary_parts(problem, stages)]


@quiet_gc()
def plan_pipeline(
    graph: OpGraph,
    cluster: ClusterSpec,
    *,
    num_microbatches: int,
    schedule: str = "1f1b",
    method: str = "alpa",
    max_stages: int | None = None,
    problem: PipelineProblem | None = None,
    progress: Callable[[str], None] | None = None,
    logical_meshes: str = "all",
    stage_timer: Callable[..., Mapping[tuple[int, str], float]] | None = None,
    transfers: bool = True,
    submesh_space: str = "all",
    screen_candidates: bool = True,
    batch_vars: frozenset[int] | None = None,
    split_vars: frozenset[int] | None = None,
    fixed: Callable[[PipelineProblem], tuple] | None = None,
    batch_mesh_axis: int | None = None,
    stage_axes: Callable[[int], Sequence[int | None]] | None = None,
    forbidden: tuple[str, ...] = (),
    weight_update_sharding: bool = True,
) -> tuple[PipelineProblem, tuple[StageResult, ...], Timeline]:
    """Stage DP over the layers, then one intra-op plan per chosen stage (module docstring).

    ``transfers``: each stage's t_i in the DP includes its outgoing boundary transfer per
    micro-batch (``PipelineProblem.send_seconds``), and the paper's eq. 2 candidates are planned
    too; False gives the paper's eq. 2 alone. Every candidate's stages are then
    planned and simulated (transfers, update) and the fastest that fits memory is kept.

    ``logical_meshes`` is the space of logical mesh shapes per sub-mesh (``in_logical_space``): ``"all"`` 2-D
    views, or one of Alpa's: ``"single_node_model_parallel"``, (n / k, k) with the model-parallel axis k
    inside one host and n / k dividing the micro-batch, and the sub-mesh's own shape, which prices far fewer
    meshes on a large cluster; ``"same_as_physical"``; ``"data_parallel_only"``; ``"model_parallel_only"``.
    ``submesh_space`` is the space of sub-mesh shapes (``submesh.SUBMESH_SPACES``): ``"all"``
    whole-host counts 2..N as the paper, or ``"power_of_two"`` as Alpa's implementation
    (log2 N shapes instead of N - 1: what makes 128 hosts plannable; the DP's optimum is then
    over that space). ``screen_candidates=False`` plans every candidate (see ``estimated_step``).
    ``batch_vars``: the batch arguments the user named (``PipelineProblem.batch_vars``). ``split_vars``: the
    arguments cut into micro-batches, named or found (an inference step's data, ``PipelineProblem.build``).
    ``fixed``: the stages are given, not searched: called with the problem, it returns ([first, last] layers,
    sub-meshes or None, logical meshes or None) per stage, as ``fixed_stages`` takes them (Alpa's manual and
    uniform stage options, ``parallel_method``); no DP runs.
    ``batch_mesh_axis``: Alpa's ``force_batch_dim_to_mesh_dim`` for every stage's plan (``PipelineProblem.batch_mesh_axis``;
    the DP prices the layers with it too, ``PipelineProblem.dp_axis``); ``stage_axes(number of fixed stages)``: each
    fixed stage's own (None: the default; -1: not forced), kept for re-plans of those stages (``stage_batch_axes``).
    ``forbidden``: collective kinds no stage may issue (``PipelineProblem.forbidden``); a ``problem`` made for others
    is not reused, as its cached layer costs priced them.
    ``weight_update_sharding``: the paper's weight-update sharding in every stage's plan (Alpa's
    ``prefer_reduce_scatter``; ``PipelineProblem.weight_update_sharding``).
    """
    if logical_meshes not in LOGICAL_MESH_SPACES:
        raise ValueError(f"unknown logical mesh space {logical_meshes!r}; choose one of {', '.join(LOGICAL_MESH_SPACES)}")
    check_submesh_space(submesh_space)
    inference = schedule == INFERENCE
    forbidden = tuple(forbidden)
    if problem is not None and problem.forbidden != forbidden:
        problem = None
    if problem is None:
        problem = PipelineProblem.build(graph, cluster, inference=inference, batch=split_vars)
        problem.forbidden = forbidden
    if problem.inference != inference:
        raise InterOpError(
            f"this step {'has no gradients' if problem.inference else 'takes gradients'}: plan it with "
            f"{'the inference schedule' if problem.inference else 'a training schedule (1f1b, gpipe, ...)'}, not {schedule!r}")
    if batch_vars is not None:
        problem.batch_vars = batch_vars
    if split_vars is not None:
        problem.split_vars = split_vars
    problem.batch_mesh_axis = batch_mesh_axis
    problem.set_weight_update_sharding(weight_update_sharding)
    problem.stage_batch_axes.clear()  # what an earlier fixed plan or a loaded one forced: this plan's come below
    problem.logical_meshes, problem.submesh_space = logical_meshes, submesh_space
    if stage_timer is not None:
        problem.stage_timer = stage_timer
    N, M = cluster.hosts, cluster.devices_per_host
    memory = cluster.device_memory
    if fixed is not None:
        ranges, submeshes, logicals = fixed(problem)
        axes = list(stage_axes(len(ranges))) if stage_axes else [None] * len(ranges)
        stages = fixed_stages(problem, ranges, submeshes, logicals, axes)
        for (layers, submesh, logical, _), axis in zip(stages, axes):
            if axis is not None:
                problem.stage_batch_axes[(layers, submesh, logical)] = axis
        results, timeline = plan_stages(problem, stages, num_microbatches=num_microbatches, schedule=schedule, method=method)
        check_memory(results, cluster)
        return problem, results, timeline

    batch = problem.microbatch_size()  # the DP's logical meshes depend on it (``in_logical_space``)
    solved_before, last_report = len(problem.layer_costs), [time.perf_counter()]

    def report() -> None:  # at most twice a second: how many layer ILPs this plan has solved
        if progress and time.perf_counter() - last_report[0] > 0.5:
            last_report[0] = time.perf_counter()
            progress(f"layer costs: {len(problem.layer_costs) - solved_before} intra-op ILPs solved "
                     f"({len(problem.layer_costs)} cached)")

    layouts: dict[tuple, tuple[tuple[float, float, int | None, str], ...]] = {}  # shared by the DP's runs (with and without transfers)

    def cost(start: int, end: int, submesh: Shape, logical: Shape, transfers: bool = transfers) -> StageCost | None:
        if not in_logical_space(logical_meshes, submesh, logical, M, batch):
            return None
        key = (start, end, submesh, logical)
        found = layouts.get(key)
        if found is None:
            found = layouts[key] = stage_layouts(start, end, submesh, logical)
            report()
        if not found:
            return None
        # the stage's outgoing cross-mesh transfer, per micro-batch, is on its critical path (issue 11 part 3)
        send = problem.send_seconds(start, end, submesh) if transfers else 0.0
        return [StageCost(t + send, m, fits, how) for t, m, fits, how in found]

    def stage_layouts(start: int, end: int, submesh: Shape, logical: Shape) -> tuple[tuple[float, float, int | None, str], ...]:
        """(time, memory, micro-batches it holds, layout) of the stage in ``method``, and in the memory-saving
        layouts where the DP may need them."""
        fast = problem.stage_cost(start, end, submesh, logical, method)
        if fast is None:
            return ()
        found = [(fast, method)]
        if wants_savers(start, submesh, fast):
            for saver in MEMORY_SAVING_METHODS:
                alt = problem.stage_cost(start, end, submesh, logical, saver)
                if alt is not None:
                    found.append((alt, saver))
        return tuple((c.time, c.weight_memory + c.activation_memory, _fits(c, memory), how) for c, how in found)

    def wants_savers(start: int, submesh: Shape, fast: LayerCost) -> bool:
        """Where the fastest plan (often replicated weights) may not hold the micro-batches of the
        earliest position this stage can take, the DP is offered the memory-saving layouts too."""
        return method == "alpa" and _fits(fast, memory) is not None and _fits(fast, memory) < need(start, submesh)

    def need(start: int, submesh: Shape) -> int:
        """The micro-batches in flight at the earliest position a stage starting at layer ``start`` can take."""
        return rule(min(problem.slicing.num_layers - start, N * M - submesh[0] * submesh[1] + 1))

    def savers_on(submesh: Shape, logical: Shape) -> tuple[str, ...]:
        """The layouts ``cost`` will ask for on this mesh besides ``method`` (longest stages first: they fail first)."""
        L = problem.slicing.num_layers
        for start in range(L):
            for end in range(L, start, -1):
                fast = problem.stage_cost(start, end, submesh, logical, method)
                if fast is not None and wants_savers(start, submesh, fast):
                    return MEMORY_SAVING_METHODS
        return ()

    def ranges(submesh: Shape, logical: Shape, transfers: bool = transfers) -> list[RangeCosts]:
        """``cost`` over every range at once (``RangeCosts``): ``stage_layouts`` on arrays, the savers where
        ``wants_savers`` would ask for them, the same transfer added."""
        if not in_logical_space(logical_meshes, submesh, logical, M, batch):
            return []
        report()
        L = problem.slicing.num_layers
        send = problem.send_seconds_table(submesh) if transfers else 0.0
        seconds, weights, activations, feasible = problem.range_costs(submesh, logical, method)
        limit = _fits_ranges(weights, activations, memory)
        found = [RangeCosts(np.where(feasible, seconds + send, np.nan), limit, method)]
        if method == "alpa":
            needs = np.asarray([need(start, submesh) for start in range(L)] + [0])
            savers = feasible & (limit != -1) & (limit < needs[:, None])
            if np.triu(savers, 1).any():
                for saver in MEMORY_SAVING_METHODS:
                    seconds, weights, activations, feasible = problem.range_costs(submesh, logical, saver)
                    found.append(RangeCosts(np.where(savers & feasible, seconds + send, np.nan),
                                            _fits_ranges(weights, activations, memory), saver))
        return found

    rule = in_flight_rule(schedule, num_microbatches)
    profiled: dict = {}  # the DP's table of stage costs, profiled once for every stage-count cap
    meshes = [(shape, lg) for shape in submesh_shapes(N, M, submesh_space) for lg in logical_shapes(shape)
              if in_logical_space(logical_meshes, shape, lg, M, batch)]
    problem.prefetch_layer_costs(meshes, method, savers_on, report=report)

    if progress:
        progress(f"stage DP: {problem.slicing.num_layers} layers on {N}x{M} devices")
    t0, ilp0 = time.perf_counter(), problem.seconds.get("intra_op", 0.0)
    L = problem.slicing.num_layers

    def plain_cost(*a: Any) -> StageCost | None:
        return cost(*a, transfers=False)

    def not_fitting(err: InterOpError) -> InterOpError:
        return InterOpError(f"{err}; the model may not fit this cluster: use more devices or more micro-batches")

    # Both tables are profiled here, so the DP runs below call no cost function: the paper's eq. 2
    # candidates (``plain``: the transfer term guesses links, so eq. 2's own optima stay and the
    # simulation picks from more) are searched in another thread meanwhile. The DP is numpy over
    # large rows, which runs outside the GIL: on GPT-3 175B the two searches take 1.6x less together.
    try:
        profile_stage_options(L, N, M, cost, profiled, submesh_space, ranges)
    except InterOpError as err:
        raise not_fitting(err) from err
    plain_table: dict | None = {} if transfers else None
    if plain_table is not None:
        try:
            profile_stage_options(L, N, M, plain_cost, plain_table, submesh_space,
                                  functools.partial(ranges, transfers=False))
        except InterOpError:  # as the DP below would: eq. 2's own candidates are then left out
            plain_table = None

    def plain_candidates() -> list[InterOpPlan]:
        try:
            plain = stage_dp(L, N, M, num_microbatches, plain_cost, max_stages=max_stages, in_flight=rule,
                             cache=plain_table, submesh_space=submesh_space)
        except InterOpError:  # e.g. eq. 2's optimum cannot be placed: not a candidate
            return []
        return [plain] + _fewer_stage_optima(problem, plain, num_microbatches, max_stages, plain_cost, rule, plain_table)

    with ThreadPoolExecutor(max_workers=1) as pool:
        plain_found = pool.submit(plain_candidates) if plain_table is not None else None
        try:
            inter = stage_dp(L, N, M, num_microbatches, cost, max_stages=max_stages, in_flight=rule, cache=profiled,
                             submesh_space=submesh_space)
        except InterOpError as err:
            raise not_fitting(err) from err
        candidates = [inter] + _fewer_stage_optima(problem, inter, num_microbatches, max_stages, cost, rule, profiled)
        if max_stages is None:  # equal sub-meshes spread the hops between hosts over more stages (stage_dp_uniform)
            candidates += stage_dp_uniform(L, N, M, num_microbatches, cost, in_flight=rule, cache=profiled,
                                           submesh_space=submesh_space).values()
        if plain_found is not None:
            candidates += plain_found.result()
    candidates = _distinct(candidates)
    if schedule == "1f1b":  # each candidate's boundaries, moved to where its placed links cost least (_rebalanced)
        candidates = _distinct(candidates + [r for c in candidates if (r := _rebalanced(problem, c, rule, method)) is not None])
        # and its odd sub-mesh taken to where the fill costs least (_relocated), then that one's boundaries moved too
        moved = [r for c in candidates if (r := _relocated(problem, c, rule, method)) is not None]
        candidates = _distinct(candidates + moved + [r for c in moved if (r := _rebalanced(problem, c, rule, method)) is not None])
    problem.seconds["stage_dp"] = time.perf_counter() - t0 - (problem.seconds.get("intra_op", 0.0) - ilp0)
    if progress:
        progress(f"planning the stages of {len(candidates)} candidate(s): {', '.join(str(c.num_stages) for c in candidates)} stages")
    # likeliest first (``quick_bounds``' estimate); a candidate whose floor is above the best planned step
    # is not planned: first its quick bound, then ``estimated_step`` (a simulation) where that one does not
    # decide (the measured profile replaces the costs the floors are made of: then plan every one)
    screen = screen_candidates and problem.stage_timer is None
    quick = [quick_bounds(problem, c, schedule, method) if screen else (0.0, 0.0) for c in candidates]
    floors = [lower for lower, _ in quick]
    best, refused = None, None
    steps: list[float | None] = [None] * len(candidates)
    for i in sorted(range(len(candidates)), key=lambda i: (quick[i][1], i)):
        cand = candidates[i]
        if best is not None and screen:
            if (floors[i], i) > (best[0], best[1]):
                continue
            floors[i] = max(floors[i], estimated_step(problem, cand, schedule, method))
            if (floors[i], i) > (best[0], best[1]):
                continue
        _remember_variants(problem, cand, method)
        stages = [(st.layers, st.submesh_shape, st.logical_shape, st.device_ids) for st in cand.stages]
        # the likeliest candidate, planned first, is usually the one kept: its timeline is made with its records
        # at once, not simulated again at the end (GPT-39B: 200,000 instructions)
        first = not any(s is not None for s in steps)
        results, timeline = plan_stages(
            problem, stages, num_microbatches=num_microbatches, schedule=schedule, method=method, records=first
        )
        try:
            check_memory(results, cluster)
        except InterOpError as err:
            refused = refused or err
            steps[i] = math.inf
            continue
        step_time = steps[i] = timeline.makespan + max(r.apply_time for r in results)
        if best is None or (step_time, i) < (best[0], best[1]):  # ties: the earlier candidate, as unscreened
            best = (step_time, i, cand, results, timeline if first else None)
    problem.candidates = list(zip(candidates, floors, steps))
    if best is None:
        raise refused
    _, _, chosen, results, timeline = best
    _remember_variants(problem, chosen, method)  # re-plans (pins) of its stages use the same layouts
    return problem, results, timeline or simulated_timeline(problem, results, schedule, num_microbatches)


def _slicing(inter: InterOpPlan) -> tuple:
    """What a candidate plans: its stages' layers, meshes, devices and layouts (not the DP's times)."""
    return tuple((st.layers, st.submesh_shape, st.logical_shape, st.device_ids, st.variant) for st in inter.stages)


def _distinct(candidates: Sequence[InterOpPlan]) -> list[InterOpPlan]:
    """Each slicing once (``_slicing``), the first kept, in order."""
    out, seen = [], set()
    for c in candidates:
        if _slicing(c) not in seen:
            seen.add(_slicing(c))
            out.append(c)
    return out


def _remember_variants(problem: PipelineProblem, inter: InterOpPlan, method: str) -> None:
    """Record the layout the DP chose for each stage where it is not ``method``'s fastest."""
    for st in inter.stages:
        key = (st.layers, st.submesh_shape, st.logical_shape)
        if st.variant != method:
            problem.stage_methods[key] = st.variant
        else:
            problem.stage_methods.pop(key, None)


def _fewer_stage_optima(
    problem: PipelineProblem,
    best: InterOpPlan,
    num_microbatches: int,
    max_stages: int | None,
    cost: Callable,
    rule: Callable[[int], int],
    cache: dict | None = None,
) -> list[InterOpPlan]:
    """The DP's optima with at most 1, 2, 4, ... stages (fewer than ``best`` has).

    Eq. 2 leaves out the activations and gradients crossing stage boundaries and the weight
    update, as the paper does (it expects transfers to overlap with compute). Where they do
    not (slow links between hosts, small layers), fewer stages can be faster, so
    ``plan_pipeline`` plans these candidates too and keeps the one whose simulated step
    (the schedule with its transfers, then the update) is fastest. Each is an optimum of the
    DP's cost for its stage count; the profiled table is kept (``cache``) and one search finds them all
    (``stage_dp_capped``).
    """
    caps, k = [], 1
    while k < best.num_stages and (max_stages is None or k < max_stages):
        caps.append(k)
        k *= 2
    found = stage_dp_capped(problem.slicing.num_layers, problem.cluster.hosts, problem.cluster.devices_per_host,
                            num_microbatches, cost, caps, in_flight=rule, cache=cache, submesh_space=problem.submesh_space)
    out: list[InterOpPlan] = []
    for k in caps:  # fewer stages that do not fit (memory) are not candidates
        cand = found.get(k)
        if cand is not None and all(cand.stages != c.stages for c in out):
            out.append(cand)
    return out


def _rebalanced(problem: PipelineProblem, inter: InterOpPlan, rule: Callable[[int], int], method: str) -> InterOpPlan | None:
    """``inter`` with its stage boundaries moved to where 1F1B's period is lowest once the stages are
    placed; each stage keeps its sub-mesh, devices, logical mesh and layout, and must fit memory
    at its position. None if the boundaries stay or the estimated step does not fall.

    Eq. 2 has many optima that tie (every slicing whose slowest stage is the same), and it does
    not see that 1F1B waits for each boundary's transfer on every micro-batch: a slow hop
    between hosts next to two full stages sets the period. The DP cannot see which boundary
    crosses hosts (placement comes after it); once placed, this search can. The period is
    ``one_f_one_b_windows``' largest window; every window is within P when Kadane's recurrence
    (the heaviest window ending at stage k: E_k = a_k + max(0, E_{k-1} + 2 c_{k-1}), a_k = t_k - P)
    stays <= 0, and the least E_k dominates, so a DP over the stages' end layers decides P and
    bisection on P finds the lowest one.
    """
    stages, S, L = inter.stages, inter.num_stages, problem.slicing.num_layers
    if S < 2:
        return None
    c = problem.cluster
    memory, B = c.device_memory, inter.num_microbatches
    bandwidth = link_bandwidths(c, stages)
    nbytes = problem.exchanged_bytes_table()
    ranges = np.arange(L + 1)[:, None] < np.arange(L + 1)[None, :]  # [start, end): start < end
    times, links = [], []
    for k, st in enumerate(stages):
        f, b, w, a, bad = problem.cumulative_costs(st.submesh_shape, st.logical_shape, st.variant or method)
        weight, act = w[None, :] - w[:, None], a[None, :] - a[:, None]
        with np.errstate(divide="ignore", invalid="ignore"):
            held = np.where(act > 0, np.floor((memory - weight) / act), np.inf)
        ok = ranges & (bad[None, :] == bad[:, None]) & (weight <= memory) & (held >= rule(S - k))
        times.append(np.where(ok, (f + b)[None, :] - (f + b)[:, None], np.inf))
        if k < S - 1:
            links.append(nbytes / bandwidth[k] + np.where(nbytes > 0, c.transfer_overhead, 0.0))

    def cuts_within(P: float) -> list[int] | None:
        """Boundaries with every window's period <= P, or None."""
        H = np.full(L + 1, np.inf)
        H[0] = 0.0  # stage 0 starts at layer 0, after nothing
        best_start = []
        for k in range(S):
            G = times[k] - P + np.maximum(H, 0.0)[:, None]
            G[G > 1e-12 * P] = np.inf  # some window ending at stage k is slower than P
            if k == S - 1:
                if not np.isfinite(G[:, L]).any():
                    return None
                cuts = [L, int(np.argmin(G[:, L]))]
                for starts in reversed(best_start):
                    cuts.append(int(starts[cuts[-1]]))
                return cuts[::-1]
            nxt = G + 2 * links[k]
            best_start.append(np.argmin(nxt, axis=0))
            H = nxt.min(axis=0)
        return None

    def figures(cuts: list[int]) -> tuple[list[float], list[float]]:
        return ([float(times[k][cuts[k], cuts[k + 1]]) for k in range(S)],
                [float(links[k][cuts[k], cuts[k + 1]]) for k in range(S - 1)])

    old = [st.layers[0] for st in stages] + [L]
    t, x = figures(old)
    if not all(math.isfinite(v) for v in t):
        return None
    before = one_f_one_b_estimate(t, x, B)
    lo, hi, best = 0.0, float(one_f_one_b_windows(t, x).max()), old
    while hi - lo > 1e-6 * hi:
        mid = (lo + hi) / 2
        found = cuts_within(mid)
        if found is None:
            lo = mid
        else:
            hi, best = mid, found
    t, x = figures(best)
    if best == old or one_f_one_b_estimate(t, x, B) >= before * (1 - 1e-9):
        return None
    new = tuple(
        dataclasses.replace(st, layers=(best[i], best[i + 1]), time=t[i] + (x[i] if i < S - 1 else 0.0))
        for i, st in enumerate(stages)
    )
    t = [st.time for st in new]
    return dataclasses.replace(inter, stages=new, total_time=pipeline_latency(t, B), t_max=max(t))


RELOCATIONS = 16
"""Positions ``_relocated`` simulates per odd stage (spread evenly over the stages of equal layers)"""


def _relocated(problem: PipelineProblem, inter: InterOpPlan, rule: Callable[[int], int], method: str) -> InterOpPlan | None:
    """``inter`` with one stage's sub-mesh, logical mesh and layout traded with another stage's of the same
    kinds of layers, where the simulated step (``estimated_step``) falls most; None if no trade makes it fall.

    Eq. 2 sees the stages' times as a sum and a maximum, which no order changes, so slicings that differ
    only in which of several equal layer ranges holds an odd sub-mesh tie in the DP (GPT-3 on 128 hosts of
    8: one 2x8 stage among 1x8 ones, its slowest), and it keeps one of them. With fewer micro-batches than
    stages, 1F1B's fill depends on where the slowest stage sits: GPT-3 175B's simulated step was 96.6 s with
    the 2x8 stage at layer 68 and 100.3 s at layer 94, both eq. 2 optima. Each stage whose (sub-mesh,
    logical mesh, layout) is not its equal stages' most common one is tried at up to ``RELOCATIONS`` of
    their positions (``4 * RELOCATIONS`` trades in all at most), placed again and checked against memory at
    its new position (eq. 5).
    """
    stages, S = inter.stages, inter.num_stages
    config = [(st.submesh_shape, st.logical_shape, st.variant or method) for st in stages]
    groups: dict[tuple, list[int]] = {}
    for k, st in enumerate(stages):
        groups.setdefault(problem.layer_keys[st.layers[0] : st.layers[1]], []).append(k)
    moves: dict[frozenset, tuple[int, int]] = {}  # a trade once, whichever of its two stages asks for it
    for members in groups.values():
        common = Counter(config[k] for k in members).most_common(1)[0][0]
        for i in members:
            if config[i] == common:
                continue
            others = [j for j in members if config[j] != config[i]]
            step = max(len(others) / RELOCATIONS, 1.0)
            for j in (others[int(n * step)] for n in range(min(len(others), RELOCATIONS))):
                moves.setdefault(frozenset((i, j)), (i, j))
    trades = list(moves.values())
    if not trades:
        return None
    if len(trades) > 4 * RELOCATIONS:  # many odd stages (a mix of meshes): as many simulations as four of them get
        trades = trades[:: -(-len(trades) // (4 * RELOCATIONS))]
    c, memory = problem.cluster, problem.cluster.device_memory
    best, best_step = None, estimated_step(problem, inter, "1f1b", method)
    for i, j in trades:
        order = list(range(S))
        order[i], order[j] = j, i  # stage i takes j's mesh and layout, j takes i's
        try:
            placed = place_submeshes([stages[order[k]].submesh_shape for k in range(S)], c.hosts, c.devices_per_host)
        except PlacementError:
            continue
        moved = []
        for k, p in enumerate(placed):
            (sub, logical, how), layers = config[order[k]], stages[k].layers
            cost = problem.stage_cost(*layers, sub, logical, how)
            held = None if cost is None else _fits(cost, memory)
            if cost is None or (k in (i, j) and held is not None and held < rule(S - k)):  # the others stay as they fit
                break
            moved.append(StagePlan(layers, sub, logical, p.device_ids, cost.time + problem.send_seconds(*layers, sub), how))
        else:
            times = [st.time for st in moved]
            cand = InterOpPlan(tuple(moved), pipeline_latency(times, inter.num_microbatches), max(times), inter.num_microbatches)
            step = estimated_step(problem, cand, "1f1b", method)
            if step < best_step * (1 - 1e-9):
                best, best_step = cand, step
    return best


MEMORY_SAVING_METHODS = ("megatron", "zero3")
"""Layouts the DP falls back to for a stage whose fastest plan does not fit device memory."""


def _fits(c: LayerCost, memory: float) -> int | None:
    """Micro-batches in flight a stage of cost ``c`` can hold (eq. 5); None: no limit."""
    if c.weight_memory > memory:
        return 0
    return math.floor((memory - c.weight_memory) / c.activation_memory) if c.activation_memory else None


def _fits_ranges(weights: np.ndarray, activations: np.ndarray, memory: float) -> np.ndarray:
    """``_fits`` on arrays of weight and activation memory (-1: no limit)."""
    with np.errstate(divide="ignore", invalid="ignore"):
        held = np.floor((memory - weights) / np.where(activations == 0, 1.0, activations))
    held = np.minimum(held, 2.0**62).astype(np.int64)  # more micro-batches than any schedule holds
    return np.where(weights > memory, 0, np.where(activations == 0, -1, held))


def in_flight_rule(schedule: str, num_microbatches: int) -> Callable[[int], int]:
    """Micro-batches in flight on the stage that has s stages from it to the last (eq. 5).

    The same counts ``schedule.check`` measures: GPipe keeps all B; 1F1B and ZB-H1 (until the
    input gradient) min(s, B); eager-1F1B min(2s - 1, B).
    """
    B = num_microbatches
    rules = {
        "gpipe": lambda s: B,
        "inference": lambda s: B,  # forwards only: nothing is kept for a backward (eq. 5's activations are 0)
        "1f1b": lambda s: min(s, B),
        "zb_h1": lambda s: min(s, B),
        "eager_1f1b": lambda s: min(2 * s - 1, B),
    }
    if schedule not in rules:
        raise InterOpError(
            f"schedule {schedule!r} cannot be planned by the stage DP (one stage per sub-mesh); plan with one of "
            f"{', '.join(rules)}, then plan.with_schedule('interleaved_1f1b', chunks=2) interleaves its stages"
        )
    return rules[schedule]


def fixed_stages(
    problem: PipelineProblem,
    layer_ranges: Sequence[tuple[int, int]],
    submeshes: Sequence[Shape] | None,
    logical: Sequence[Shape] | None,
    batch_axes: Sequence[int | None] | None = None,
) -> list[tuple[tuple[int, int], Shape, Shape, tuple[int, ...]]]:
    """User-pinned stages: check the layer ranges and sub-meshes, place them, choose logical meshes (for a stage
    whose batch is forced onto a mesh axis, ``batch_axes[i]`` or the problem's default, among those where that
    axis has devices, as a single-mesh plan chooses its grid)."""
    L = problem.slicing.num_layers
    cluster = problem.cluster
    N, M = cluster.hosts, cluster.devices_per_host
    ranges = [tuple(r) for r in layer_ranges]
    if not ranges:
        raise InterOpError("pin_stages needs at least one stage")
    expect = 0
    for r in ranges:
        if len(r) != 2 or r[0] != expect or r[1] < r[0]:
            raise InterOpError(
                f"stage layer ranges must be [first, last] pairs covering layers 0..{L - 1} in order without gaps; "
                f"got {[list(x) for x in ranges]}"
            )
        expect = r[1] + 1
    if expect != L:
        raise InterOpError(f"the stages cover layers 0..{expect - 1} but the program has {L} layers (0..{L - 1})")
    if len(ranges) > N * M:
        raise InterOpError(f"{len(ranges)} stages need at least {len(ranges)} devices; the cluster has {N * M}")
    if submeshes is None:
        if (N * M) % len(ranges):
            raise InterOpError(
                f"cannot split {N * M} devices evenly over {len(ranges)} stages; give submeshes=[...] explicitly"
            )
        submeshes = [even_submesh(N, M, len(ranges))] * len(ranges)
    submeshes = [tuple(s) for s in submeshes]
    if len(submeshes) != len(ranges):
        raise InterOpError(f"{len(ranges)} stages but {len(submeshes)} sub-meshes")
    valid = submesh_shapes(N, M)
    for s in submeshes:
        if s not in valid:
            raise InterOpError(f"sub-mesh {s} is not one of the shapes Alpa places on {N}x{M}: {valid}")
    try:
        placed = place_submeshes(submeshes, N, M)
    except PlacementError as err:
        raise InterOpError(str(err)) from err
    out = []
    for i, ((a, b), shape, p) in enumerate(zip(ranges, submeshes, placed)):
        if logical is not None:
            lg = tuple(logical[i])
            if lg not in logical_shapes(shape):
                raise InterOpError(f"stage {i}: logical mesh {lg} does not fit sub-mesh {shape}; choose from {logical_shapes(shape)}")
        else:
            axis = problem.forced_axis(batch_axes[i] if batch_axes is not None else None)
            shapes = logical_shapes(shape)
            if axis is not None:
                shapes = tuple(lg for lg in shapes if lg[axis] > 1) or shapes
            options = [(problem.stage_cost(a, b + 1, shape, lg), lg) for lg in shapes]
            options = [(c.time, lg) for c, lg in options if c is not None]
            if not options:
                raise InterOpError(f"stage {i} (layers {a}..{b}) has no feasible sharding on sub-mesh {shape}")
            lg = min(options)[1]
        out.append(((a, b + 1), shape, lg, p.device_ids))
    return out


def stage_schedule(stages: Sequence[tuple], schedule: str, num_microbatches: int) -> Schedule:
    """The schedule ``schedule`` for these stages (layers, sub-mesh, logical mesh, devices);
    stages that share devices are interleaved (planning and the runtime both build it here)."""
    return make_schedule(schedule, len(stages), num_microbatches, num_meshes=_num_meshes(stages, schedule))


def _num_meshes(stages: Sequence[tuple], schedule: str) -> int | None:
    """P for an interleaved plan (stages share meshes round-robin), None for one stage per mesh."""
    meshes = list(dict.fromkeys(devices for *_, devices in stages))
    if len(meshes) == len(stages):
        return None
    if schedule != "interleaved_1f1b":
        raise InterOpError(
            f"these {len(stages)} stages share {len(meshes)} meshes (an interleaved plan); schedule {schedule!r} runs "
            "one stage per mesh: choose contiguous stages again with pin_stages(...) or unpin_stages()"
        )
    P = len(meshes)
    wrong = [j for j, (*_, devices) in enumerate(stages) if devices != meshes[j % P]]
    if wrong:
        raise InterOpError(f"interleaved stages must run on meshes in turn (stage j on mesh j % {P}); stages {wrong} do not")
    return P


def interleave(stages: Sequence[tuple], num_layers: int, chunks: int) -> list[tuple]:
    """Megatron's interleaving: the layers cut into P x ``chunks`` virtual stages, stage j on mesh j % P.

    ``stages`` are P contiguous stages (layers, sub-mesh, logical mesh, devices); their
    meshes are kept, the layers re-cut evenly (the first ones get one more when they do
    not divide).
    """
    P = len(stages)
    S = P * chunks
    if chunks < 2:
        raise InterOpError(f"interleaving needs at least 2 chunks per mesh, got {chunks}")
    if num_layers < S:
        raise InterOpError(
            f"interleaving {P} meshes x {chunks} chunks needs at least {S} layers, the step has {num_layers}: "
            f"plan it with layers={S} (or more), or use fewer chunks"
        )
    sizes = [num_layers // S + (1 if j < num_layers % S else 0) for j in range(S)]
    starts = [sum(sizes[:j]) for j in range(S)]
    return [((starts[j], starts[j] + sizes[j]), *stages[j % P][1:]) for j in range(S)]


def check_memory(stages: Sequence[StageResult], cluster: ClusterSpec) -> None:
    """Eq. 5 for the chosen schedule, with a specific error naming the stage that overflows.

    Virtual stages that share a mesh (interleaved) add up on its devices.
    """
    for devices, total in memory_per_mesh(stages).items():
        shared = [st.index for st in stages if st.device_ids == devices]
        if len(shared) > 1 and total > cluster.device_memory:
            raise InterOpError(
                f"the mesh of devices {list(devices)} holds stages {shared}, which need {total / 2**30:.2f} GiB per "
                f"device together but a device has {cluster.device_memory / 2**30:.2f} GiB: use fewer chunks or more devices"
            )
    for st in stages:
        if st.memory_per_device > cluster.device_memory:
            raise InterOpError(
                f"stage {st.index} (layers {st.layers[0]}..{st.layers[1] - 1}) needs "
                f"{st.memory_per_device / 2**30:.2f} GiB per device (weights {st.weight_memory / 2**30:.2f} GiB + "
                f"{st.in_flight} micro-batches in flight x {st.activation_memory / 2**30:.2f} GiB) but a device has "
                f"{cluster.device_memory / 2**30:.2f} GiB: give it more devices, use more stages, smaller "
                "micro-batches, or a schedule with fewer micro-batches in flight (1f1b)"
            )
    if not all(math.isfinite(st.memory_per_device) for st in stages):
        raise InterOpError("a stage's memory is not finite")


def stage_tensor_specs(
    graph: OpGraph, slicing: ProgramSlicing, stages: Sequence[StageResult], pieces: Sequence[Subgraph] | None = None
) -> list[dict[int, str]]:
    """Per stage, the sharding spec every tensor it touches has there (var id -> spec text).

    ``pieces`` are the stages' programs if already cut (``PipelineProblem.piece``).

    A tensor the stage reads but does not compute (an argument of the step, or a tensor from
    another stage) has the spec of the stage plan's input; a tensor it computes has its
    producer's output spec. The runtime compiles each stage with these, and the cross-mesh
    transfers are the moves from the producer stage's spec to a reader stage's.
    """
    stage_of_op = slicing.stage_of_ops([st.layers for st in stages])
    specs_per_stage: list[dict[int, str]] = []
    for st in stages:
        by_name = {o.name: o for o in st.plan.ops if o.kind == "op"}
        piece = pieces[st.index] if pieces else subgraph(graph, [i for i, s in enumerate(stage_of_op) if s == st.index])
        # by path, not position: the planned piece takes its update layer by layer (``_by_layer``), one cut again here
        # in program order reads its arguments in another order
        by_path = {t.path: t.spec for t in st.plan.inputs}
        specs = {v: by_path[path] for v, path in zip(piece.invars, piece.graph.in_paths)}
        for i in sorted(set(piece.var_map) - set(piece.invars)):
            p = graph.vars[i].producer
            if p is not None and stage_of_op[p] == st.index:
                op = graph.ops[p]
                specs[i] = by_name[op.name].output_specs[op.outputs.index(i)]
        specs_per_stage.append(specs)
    return specs_per_stage
