"""The intra-operator pass (Alpa paper, sec. 4): one sharding strategy per op, by ILP.

``build_strategy_graph`` turns an ``OpGraph`` on a ``LogicalMesh`` into the ILP's data:
every op (and every argument, whose strategies are the ways to store it) gets its
strategies from ``sharding.rules``; every operand edge gets the matrix of resharding costs
between the producer's output spec and the spec the consumer wants (Table 2). Trivial ops
(element-wise, layout) are merged into the op that produces their largest operand
(sec. 4.2): they take the strategy that keeps that operand's spec, which shrinks the ILP
without changing what the plan can express for the ops that matter.

``solve_strategy_graph`` applies pins (fixed strategies), solves with ``passes.ilp`` and
maps the group choices back to every op. It is pure: same inputs, same result.
"""

from __future__ import annotations

import dataclasses
import functools
import re
import time
import weakref
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Collection, Mapping

import numpy as np

from alpa_lab.cost.cluster import LogicalMesh
from alpa_lab.graph.analysis import classify_arguments, find_aliases
from alpa_lab.graph.opgraph import Op, OpGraph, Var, did_you_mean
from alpa_lab.graph.trace import param_signature
from alpa_lab.passes.ilp import ILP_TIME_LIMIT, CostGraph, ILPSolution, InfeasibleError, evaluate, solve
from alpa_lab.plan import Alternative, Explanation, PinError, Plan  # PinError: defined with the plan, raised here too
from alpa_lab.sharding.resharding import resharding
from alpa_lab.sharding.rules import has_rule, is_follower, planned_strategies
from alpa_lab.sharding.spec import ShardingSpec, enumerate_specs
from alpa_lab.sharding.strategy import Strategy


@dataclass(frozen=True, eq=False)
class PlanningNode:
    """An op, or an argument/constant array, with the strategies the ILP chooses among."""

    name: str
    kind: str  # "op", "input" or "const"
    strategies: tuple[Strategy, ...]
    op_index: int | None = None
    var: int | None = None
    label: str = ""
    primitive: str = ""

    def strategy_index(self, name: str) -> int:
        for i, s in enumerate(self.strategies):
            if s.name == name:
                return i
        # "S0R x RS1" names a dot strategy by its operands alone
        matches = [i for i, s in enumerate(self.strategies) if s.name.split(" = ")[-1] == name]
        if len(matches) == 1:
            return matches[0]
        known = ", ".join(repr(s.name) for s in self.strategies[:12])
        more = f" (and {len(self.strategies) - 12} more)" if len(self.strategies) > 12 else ""
        raise PinError(f"op {self.name!r} has no strategy {name!r}; its strategies are {known}{more}", (self.name,))


@dataclass(frozen=True)
class OperandEdge:
    """Operand ``operand`` of node ``consumer`` is output ``output`` of node ``producer``.

    ``consumer`` is ``-1 - i`` for the i-th output of the program when that output must
    return in the layout of the argument it replaces (the next step reads it back).
    """

    producer: int
    output: int
    consumer: int
    operand: int
    var: int


@dataclass(frozen=True, eq=False)
class StrategyGraph:
    """The intra-op problem for one program on one logical mesh: plain numpy data."""

    mesh: LogicalMesh
    nodes: tuple[PlanningNode, ...]
    node_of_var: Mapping[int, tuple[int, int]]
    edges: tuple[OperandEdge, ...]
    group_of_node: np.ndarray
    member_map: tuple[np.ndarray, ...]
    """member_map[n][r]: node n's strategy when its group's representative takes strategy r."""
    cost_graph: CostGraph
    aliases: Mapping[int, int] = field(default_factory=dict)
    """program output position -> argument var it replaces (same path, shape and dtype)."""
    unplanned_primitives: tuple[str, ...] = ()
    build_seconds: float = 0.0
    fingerprint: str = ""
    invars: tuple[int, ...] = ()
    outvars: tuple[int, ...] = ()
    in_paths: tuple[str, ...] = ()
    out_paths: tuple[str, ...] = ()
    var_info: Mapping[int, tuple[tuple[int, ...], int]] = field(default_factory=dict)
    """var id -> (shape, itemsize) of every tensor, so plans need no OpGraph."""
    var_dtype: Mapping[int, str] = field(default_factory=dict)
    argument_kinds: Mapping[int, str] = field(default_factory=dict)
    """argument var -> "param", "optimizer_state", "data" (``graph.analysis``) or "activation"."""
    tie_period: int = 1
    """repeats this far apart share a strategy (``build_strategy_graph``'s ``tie_period``)"""
    ties: int = 0
    """groups the repeated-block tying merged (0: nothing repeats, the period changes nothing)"""
    merged_groups: np.ndarray | None = None
    """group_of_node before repeated-block tying (``retie`` ties it again at another period)"""
    batch_vars: frozenset[int] | None = None
    """the data arguments that are the batch, where the user named them (``batch_argnums``); None: the data
    leaves leading with the batch size (``graph.analysis.batch_dimension``)"""
    batch_mesh_axis: int | None = None
    """Alpa's ``force_batch_dim_to_mesh_dim``: every tensor with a batch dimension keeps it split over this mesh
    axis alone (whole where that axis has one device); None: the ILP chooses (``passes.methods``)"""
    weight_update_sharding: bool = True
    """whether the ILP's own method applies the paper's post-ILP weight-update sharding (``methods.shard_weight_update``);
    False for Alpa's ``ShardParallel`` without ``prefer_reduce_scatter``, which leaves the update replicated"""
    node_weights: np.ndarray | None = None
    """per node, the weight of its cost (and of the reshardings into it) in what the ILP minimises; None: all 1, the
    program runs once. A pipeline stage runs its forward and backward once per micro-batch and its update once per
    step (``weighted_by_microbatch``): the update weighs 1 / micro-batches, so the ILP minimises a step's time"""
    plain_cost_graph: CostGraph | None = None
    """where ``cost_graph`` is weighted (``node_weights``), the same graph with every cost once: what a solution's
    ``objective`` and a plan's report (each op's and each resharding's cost, summed)"""

    @functools.cached_property
    def _node_indices(self) -> dict[str, int]:
        """name -> node index, the first of a name, made once: a data-parallel method restricts every batch op by name."""
        out: dict[str, int] = {}
        for i, n in enumerate(self.nodes):
            out.setdefault(n.name, i)
        return out

    def node_index(self, name: str) -> int:
        i = self._node_indices.get(name)
        if i is not None:
            return i
        hint = did_you_mean(name, [n.name for n in self.nodes])
        raise PinError(f"no op or argument named {name!r} in this program{hint}", (name,))

    # ----- what a Plan of this problem asks (``plan.single.PlanProblem``): the plan is data, the work is here -----
    def replan(self, plan: Plan, pins: Mapping[str, str]) -> Plan:
        """``Plan.pin`` / ``unpin``: ``plan`` re-solved with ``pins``, by its method, memory budget and mesh."""
        from alpa_lab.passes.methods import make_plan, solve_method  # methods builds on this module

        solved = solve_method(self, plan.method, pins, memory_budget=plan.memory_budget)
        return make_plan(
            self, solved, method=plan.method, cluster=plan.cluster, pins=pins,
            memory_budget=plan.memory_budget, mesh_candidates=plan.mesh_candidates,
        )

    def explain(self, plan: Plan, op: str) -> Explanation:
        """``Plan.explain``: every strategy of ``op`` with its cost, the rest of ``plan`` held fixed, weighed as the
        ILP weighed them (a pipeline stage's update and what runs with it: 1 / micro-batches, ``node_weights``)."""
        sg = self
        n = sg.node_index(op)
        w = sg.node_weights if sg.node_weights is not None else np.ones(len(sg.nodes))
        node = sg.nodes[n]
        chosen = {o.name: o.strategy for o in plan.ops}
        choice = {i: sg.nodes[i].strategy_index(chosen[nd.name]) for i, nd in enumerate(sg.nodes)}
        layouts = split_output_pins(sg, dict(plan.pins))[1]
        alts = []
        for j, s in enumerate(node.strategies):
            reshard = 0.0
            for e in sg.edges:
                if e.consumer < 0 and -1 - e.consumer in layouts:  # a pinned new state: priced through its layout below
                    continue
                if e.consumer == n:
                    src = sg.nodes[e.producer].strategies[choice[e.producer]].output_specs[e.output]
                    dst = s.input_specs[e.operand]
                elif e.producer == n:
                    src = s.output_specs[e.output]
                    if e.consumer >= 0:
                        dst = sg.nodes[e.consumer].strategies[choice[e.consumer]].input_specs[e.operand]
                    else:
                        dst = sg.nodes[e.operand].strategies[choice[e.operand]].output_specs[0]
                elif e.consumer < 0 and e.operand == n:
                    src = sg.nodes[e.producer].strategies[choice[e.producer]].output_specs[e.output]
                    dst = s.output_specs[0]
                else:
                    continue
                shape, itemsize = sg.var_info[e.var]
                reshard += resharding_weight(sg.node_weights, e) * resharding(src, dst, shape, itemsize, sg.mesh).cost
            for pos, dst in layouts.items():  # a result it makes, returned in a pinned layout; a state read back from it
                v = sg.outvars[pos]
                shape, itemsize = sg.var_info[v]
                if sg.node_of_var[v][0] == n:
                    reshard += w[n] * resharding(s.output_specs[sg.node_of_var[v][1]], dst, shape, itemsize, sg.mesh).cost
                alias = _alias_edge(sg, pos)
                if alias is not None and alias.operand == n:
                    reshard += resharding_weight(sg.node_weights, alias) * resharding(dst, s.output_specs[0], shape, itemsize, sg.mesh).cost
            alts.append(Alternative(s.name, float(w[n]) * s.cost, reshard, j == choice[n]))
        leader = sg.nodes[int(sg.group_of_node[n])].name
        return Explanation(plan.op(op), tuple(alts), leader)


@dataclass(frozen=True)
class IntraOpSolution:
    """A choice of strategy for every node of a StrategyGraph.

    ``objective``: every cost once (the plan's objective); ``minimised``: what the ILP minimised, which differs
    from it on a weighted graph (``StrategyGraph.node_weights``) and is what solutions are compared by."""

    choice: tuple[int, ...]
    objective: float
    ilp: ILPSolution

    @property
    def minimised(self) -> float:
        return self.ilp.objective


def build_strategy_graph(
    graph: OpGraph,
    mesh: LogicalMesh,
    *,
    merge_trivial_ops: bool = True,
    reuse_repeated_blocks: bool = True,
    argument_kinds: Mapping[int, str] | None = None,
    tie_period: int = 1,
) -> StrategyGraph:
    """Enumerate strategies and resharding costs for ``graph`` on ``mesh``.

    With ``reuse_repeated_blocks`` the same op in every repeat of a block (``Block_3`` and
    ``Block_7`` of a transformer) takes the same strategy, as TAP does: the ILP then has
    one layer's variables however deep the model is.

    ``argument_kinds`` overrides ``classify_arguments`` (a pipeline stage's graph gets
    ``"activation"`` for tensors that arrive from another stage: stored, not loaded from
    the host).

    ``tie_period`` 2 ties every other repeat (blocks 0, 2, 4 and 1, 3, 5): a stack whose best
    plan alternates (Megatron's column- then row-split kernels) keeps its optimum that way;
    ``passes.methods.solve_tied`` tries both.
    """
    t0 = time.perf_counter()
    strategy_cache = _cache(_STRATEGIES, mesh)
    nodes: list[PlanningNode] = []
    node_of_var: dict[int, tuple[int, int]] = {}
    argument_kinds = dict(argument_kinds) if argument_kinds is not None else classify_arguments(graph)
    for vid in graph.invars + tuple(graph.consts):
        var = graph.vars[vid]
        if var.kind == "const" and var.rank == 0:
            continue
        node_of_var[vid] = (len(nodes), 0)
        name = var.name if var.kind == "input" else f"const_{vid}"
        per_step = argument_kinds.get(vid) == "data"
        key = ("storage", var.shape, var.dtype, per_step)
        if key not in strategy_cache:
            strategy_cache[key] = _storage_strategies(var, mesh, per_step)
        nodes.append(PlanningNode(name, var.kind, strategy_cache[key], var=vid))

    unplanned = []
    for op, key in zip(graph.ops, _op_keys(graph)):
        if key not in strategy_cache:
            strategy_cache[key] = tuple(planned_strategies(op, graph, mesh))
        if not has_rule(op.primitive):
            unplanned.append(op.primitive)
        for pos, vid in enumerate(op.outputs):
            node_of_var[vid] = (len(nodes), pos)
        nodes.append(PlanningNode(op.name, "op", strategy_cache[key], op_index=op.index, label=op.label, primitive=op.primitive))

    edges = []
    for node_idx, node in enumerate(nodes):
        if node.op_index is None:
            continue
        for pos, vid in enumerate(graph.ops[node.op_index].inputs):
            if vid in node_of_var:
                producer, out = node_of_var[vid]
                edges.append(OperandEdge(producer, out, node_idx, pos, vid))
    aliases = find_aliases(graph)
    for out_pos, in_var in aliases.items():
        vid = graph.outvars[out_pos]
        if vid in node_of_var and in_var in node_of_var and graph.vars[vid].kind == "op":
            producer, out = node_of_var[vid]
            edges.append(OperandEdge(producer, out, -1 - out_pos, node_of_var[in_var][0], vid))

    merged, member_map = _merge_trivial_ops(graph, nodes, node_of_var, merge_trivial_ops)
    group_of_node, ties = _tied(graph, nodes, merged, tie_period) if reuse_repeated_blocks else (merged, 0)
    var_info = {v.id: (v.shape, v.itemsize) for v in graph.vars}
    cost_graph = _cost_graph(var_info, mesh, nodes, edges, group_of_node, member_map)
    return StrategyGraph(
        mesh=mesh,
        nodes=tuple(nodes),
        node_of_var=node_of_var,
        edges=tuple(edges),
        group_of_node=group_of_node,
        member_map=tuple(member_map),
        cost_graph=cost_graph,
        aliases=aliases,
        unplanned_primitives=tuple(sorted(set(unplanned))),
        build_seconds=time.perf_counter() - t0,
        fingerprint=graph.fingerprint,
        invars=graph.invars,
        outvars=graph.outvars,
        in_paths=graph.in_paths,
        out_paths=graph.out_paths,
        var_info=var_info,
        var_dtype={v.id: v.dtype for v in graph.vars},
        argument_kinds=argument_kinds,
        tie_period=tie_period,
        ties=ties,
        merged_groups=merged if reuse_repeated_blocks else None,
    )


def _tied(graph: OpGraph, nodes: list[PlanningNode], merged: np.ndarray, period: int) -> tuple[np.ndarray, int]:
    """Groups after repeated-block tying at ``period``, and how many groups the tying merged."""
    group_of_node = _tie_repeated_blocks(graph, nodes, merged, period)
    return group_of_node, len(set(merged.tolist())) - len(set(group_of_node.tolist()))


def retie(sg: StrategyGraph, graph: OpGraph, tie_period: int) -> StrategyGraph:
    """``sg`` (built from ``graph``) with its repeated blocks tied at ``tie_period`` instead.

    The same as ``build_strategy_graph(graph, sg.mesh, tie_period=...)`` without enumerating
    strategies again: only the grouping and the ILP's cost graph change with the period.
    """
    if sg.merged_groups is None or tie_period == sg.tie_period:
        return sg
    t0 = time.perf_counter()
    nodes = list(sg.nodes)
    group_of_node, ties = _tied(graph, nodes, sg.merged_groups, tie_period)
    cost_graph = _cost_graph(sg.var_info, sg.mesh, nodes, list(sg.edges), group_of_node, list(sg.member_map))
    plain = None
    if sg.node_weights is not None:  # weighted as sg was
        plain, cost_graph = cost_graph, _cost_graph(
            sg.var_info, sg.mesh, nodes, list(sg.edges), group_of_node, list(sg.member_map), sg.node_weights)
    return dataclasses.replace(
        sg, group_of_node=group_of_node, cost_graph=cost_graph, plain_cost_graph=plain, tie_period=tie_period, ties=ties,
        build_seconds=time.perf_counter() - t0,
    )


def resharding_weight(weights: np.ndarray | None, e: OperandEdge) -> float:
    """The weight of edge ``e``'s resharding in a weighted ILP (``StrategyGraph.node_weights``): the lighter of its two
    ends' (one into the update runs with it); a new state's into its argument's layout, the lightest weight (once a
    step, at its end, whichever op makes it: BatchNorm's statistics come from the forward)."""
    if weights is None:
        return 1.0
    if e.consumer < 0:
        return float(weights.min())
    return float(min(weights[e.producer], weights[e.consumer]))


def weighted_nodes(num_nodes: int, per_step: Collection[int], microbatches: int) -> np.ndarray:
    """``StrategyGraph.node_weights`` of a stage: 1 / ``microbatches`` on the ``per_step`` nodes, 1 elsewhere."""
    weights = np.ones(num_nodes)
    weights[np.fromiter(per_step, dtype=np.int64)] = 1.0 / microbatches
    return weights


def weighted_by_microbatch(sg: StrategyGraph, per_step: Collection[int], microbatches: int) -> StrategyGraph:
    """``sg`` as a pipeline stage's problem: its ``per_step`` nodes (the update) run once per step, the rest once
    per micro-batch, so the ILP weighs the update's costs (and the reshardings into it) 1 / ``microbatches``.

    Unweighted, a stage's ILP prices a step's update like one micro-batch's forward and backward: on
    256 devices across hosts it kept GPT-3's weights split and gathered them every micro-batch (1.30 s
    per micro-batch) to save one gather of the updated weights a step, where replicated weights and split
    gradients took 0.68 s (the layer's own ILP, which the stage DP prices, has no update). Weighted,
    the objective is a step's time / ``microbatches``, which the schedule multiplies out.
    """
    if microbatches <= 1 or not per_step:
        return sg if sg.node_weights is None else dataclasses.replace(
            sg, cost_graph=sg.plain_cost_graph, plain_cost_graph=None, node_weights=None)
    weights = weighted_nodes(len(sg.nodes), per_step, microbatches)
    if sg.node_weights is not None and np.array_equal(weights, sg.node_weights):
        return sg
    weighted = _cost_graph(sg.var_info, sg.mesh, list(sg.nodes), list(sg.edges), sg.group_of_node, list(sg.member_map),
                           weights)
    return dataclasses.replace(sg, cost_graph=weighted, plain_cost_graph=sg.plain_cost_graph or sg.cost_graph,
                               node_weights=weights)


def relabel(sg: StrategyGraph, built_from: OpGraph, graph: OpGraph) -> StrategyGraph | None:
    """``sg`` (built from ``built_from``) as the problem of ``graph``: another run of the same layers.

    Two stages of equal layers (blocks 4-9 and 10-15 of a stack) cut from one program have the
    same ops, operands, shapes and argument kinds in the same order; only names differ. Their
    strategies, resharding costs, groups and ILP are then the same, so the problem is ``sg``
    with the new names, without enumerating or pricing anything. None when ``graph`` differs
    in anything but names, or its repeated blocks tie otherwise (the caller builds it then).
    """
    if not _same_structure(built_from, graph) or find_aliases(graph) != dict(sg.aliases):
        return None
    nodes = []
    for n in sg.nodes:  # the constructor, not dataclasses.replace: a stage has thousands of nodes
        if n.op_index is not None:
            op = graph.ops[n.op_index]
            nodes.append(PlanningNode(op.name, n.kind, n.strategies, n.op_index, n.var, op.label, n.primitive))
        else:
            var = graph.vars[n.var]
            name = var.name if var.kind == "input" else f"const_{n.var}"
            nodes.append(PlanningNode(name, n.kind, n.strategies, n.op_index, n.var, n.label, n.primitive))
    if sg.merged_groups is not None:  # tying reads the module paths in the labels: it must tie alike
        regrouped, _ = _tied(graph, nodes, sg.merged_groups, sg.tie_period)
        if not np.array_equal(regrouped, sg.group_of_node):
            return None
    return dataclasses.replace(
        sg, nodes=tuple(nodes), fingerprint=graph.fingerprint, in_paths=graph.in_paths, out_paths=graph.out_paths
    )


def _same_structure(a: OpGraph, b: OpGraph) -> bool:
    """Whether ``a`` and ``b`` are one program up to names (op names, labels, paths, boundary names)."""
    if (len(a.ops), len(a.vars), a.invars, a.outvars) != (len(b.ops), len(b.vars), b.invars, b.outvars):
        return False
    if set(a.consts) != set(b.consts) or a.literals.keys() != b.literals.keys():
        return False
    if any(not np.array_equal(np.asarray(a.literals[k]), np.asarray(b.literals[k])) for k in a.literals):
        return False
    for u, v in zip(a.vars, b.vars):
        if (u.shape, u.dtype, u.kind, u.producer) != (v.shape, v.dtype, v.kind, v.producer):
            return False
    keys_a, keys_b = _op_keys(a), _op_keys(b)
    for x, y in zip(a.ops, b.ops):
        if (x.primitive, x.inputs, x.outputs) != (y.primitive, y.inputs, y.outputs):
            return False
        if x.primitive == "pipeline_marker":
            if x.params["kind"] != y.params["kind"]:
                return False
        elif keys_a[x.index] != keys_b[y.index]:
            return False
    return True


_STRATEGIES: dict[LogicalMesh, dict[tuple, tuple[Strategy, ...]]] = {}
_RESHARDING_TABLES: dict[LogicalMesh, dict[tuple, np.ndarray]] = {}
_EDGE_TABLES: dict[LogicalMesh, dict[tuple, tuple]] = {}
_CACHED_MESHES = 256


def _cache(store: dict, mesh: LogicalMesh) -> dict:
    """A per-mesh cache that outlives one build: the pipeline planner builds a strategy graph
    per layer and mesh, and repeated layers share op keys (strategies) and tensor shapes
    (resharding tables), so the second layer on a mesh costs little."""
    key = cost_signature(mesh)
    if key not in store and len(store) >= _CACHED_MESHES:
        store.clear()
    return store.setdefault(key, {})


def cost_signature(mesh: LogicalMesh) -> LogicalMesh:
    """``mesh`` without its device ids: everything a strategy's cost depends on.

    Two placements of one sub-mesh shape with the same links (the stages of a pipeline on
    different hosts) share strategies, resharding tables and whole stage problems.
    """
    return dataclasses.replace(mesh, device_ids=()) if mesh.device_ids else mesh


def _storage_strategies(var: Var, mesh: LogicalMesh, per_step: bool) -> tuple[Strategy, ...]:
    """An argument can be stored in any spec that fits it.

    State stays on the devices between steps and costs memory only; data (the batch) is
    copied from the host every step, each device receiving its tile.
    """
    out = []
    for spec in enumerate_specs(var.shape, mesh.shape):
        tile = var.nbytes / spec.num_shards(mesh.shape)
        load = tile / mesh.host_to_device_bandwidth if per_step else 0.0
        out.append(Strategy(str(spec), (spec,), (), load, 0.0, tile))
    return tuple(out)


_OP_KEYS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _op_keys(graph: OpGraph) -> tuple[tuple, ...]:
    """Every op's ``_op_key``, worked out once per graph: a layer's graph is built on every logical mesh."""
    keys = _OP_KEYS.get(graph)
    if keys is None:
        keys = _OP_KEYS[graph] = tuple(_op_key(op, graph) for op in graph.ops)
    return keys


def _op_key(op: Op, graph: OpGraph) -> tuple:
    """Ops with equal keys have equal strategies (repeated layers share one enumeration)."""
    ins = tuple((graph.vars[v].shape, graph.vars[v].dtype, graph.vars[v].kind == "literal") for v in op.inputs)
    outs = tuple((graph.vars[v].shape, graph.vars[v].dtype) for v in op.outputs)
    return (op.primitive, op.signature or param_signature(op.params), ins, outs, op.flops)


def _followed_operand(graph: OpGraph, op: Op, node_of_var: Mapping[int, tuple[int, int]]) -> tuple[int, int] | None:
    """(position, var) of the operand a trivial op follows (``_merge_trivial_ops``): its largest planned one, the
    first of equals; None if it has none planned."""
    operands = [(graph.vars[v].nbytes, -pos, pos, v) for pos, v in enumerate(op.inputs) if v in node_of_var]
    return max(operands)[2:] if operands else None


def _merge_trivial_ops(
    graph: OpGraph, nodes: list[PlanningNode], node_of_var: dict[int, tuple[int, int]], enabled: bool
) -> tuple[np.ndarray, list[np.ndarray]]:
    """Group each trivial op with the producer of its largest operand (Alpa sec. 4.2).

    A follower joins only if, for every strategy of the group, it has a strategy that
    takes that operand in exactly the spec the group makes; otherwise it stays alone.
    And it joins only if one op at most reads its result, not counting ops that follow it in turn: merged, it
    takes its operand as made, so a resharding it needs moves after it, onto each of its readers' edges, where
    unmerged one resharding before it served them all (Alpa's MoE layer on 4 devices: a transpose read twice,
    resharded twice by all-to-alls, 2.8% over the optimum; the tiny MLP on 4 preset devices, 29%). With one
    reader, before or after costs the same. Counting its followers too kept every optimum but made GPT-39B's
    layer ILPs half as slow again; as counted, the example models' plans are within 1% of the unmerged ILP's.
    """
    group_of_node = np.arange(len(nodes))
    member_map = [np.arange(len(n.strategies)) for n in nodes]
    if not enabled:
        return group_of_node, member_map
    # each op's readers that are not followers of it (a follower of its result joins its group, taking its layout:
    # no resharding between them): a layout a follower needs is resharded once per such reader when merged
    followed = {op.index: _followed_operand(graph, op, node_of_var) for op in graph.ops if is_follower(op)}
    readers: Counter = Counter(graph.outvars)
    for op in graph.ops:
        lead = followed.get(op.index)
        readers.update(v for v in op.inputs if lead is None or v != lead[1])
    follows: dict[tuple, np.ndarray] = {}
    for idx, node in enumerate(nodes):
        if node.op_index is None:
            continue
        op = graph.ops[node.op_index]
        if followed.get(op.index) is None or readers[op.outputs[0]] > 1:
            continue
        pos, vid = followed[op.index]
        leader, out = node_of_var[vid]
        key = (id(nodes[leader].strategies), out, id(node.strategies), pos)
        if key not in follows:  # repeated layers share strategy tuples: computed once each
            follows[key] = _follow_table(nodes[leader].strategies, out, node.strategies, pos)
        mapped = follows[key][member_map[leader]]
        if (mapped >= 0).all():
            group_of_node[idx] = group_of_node[leader]
            member_map[idx] = mapped
    return group_of_node, member_map


def _follow_table(
    leader: tuple[Strategy, ...], out: int, follower: tuple[Strategy, ...], operand: int
) -> np.ndarray:
    """For each leader strategy, the follower strategy that takes the leader's output ``out`` as
    operand ``operand`` unchanged; -1 where the follower has none, or several that lay out its
    results differently (a scalar broadcast to a matrix may make it whole or split: merged, it
    would be held to one of them, and the group could not choose the other)."""
    best: dict[ShardingSpec, int] = {}
    layouts: dict[ShardingSpec, set] = {}
    for j, s in enumerate(follower):
        spec = s.input_specs[operand]
        layouts.setdefault(spec, set()).add(s.output_specs)
        if spec not in best or s.cost < follower[best[spec]].cost:
            best[spec] = j
    return np.array(
        [best[s.output_specs[out]] if len(layouts.get(s.output_specs[out], ())) == 1 else -1 for s in leader], dtype=np.int64)


def _tie_repeated_blocks(
    graph: OpGraph, nodes: list[PlanningNode], group_of_node: np.ndarray, period: int = 1
) -> np.ndarray:
    """Give the same op in each repeat of a block one shared strategy choice (TAP).

    An op's *role* is its source label with every index replaced (``Block_#/Dense_#``),
    its op key (primitive, parameters, shapes) and its rank among ops of that key under
    its exact label (for an argument: its tree path, shape and dtype, so the parameters of
    repeated blocks are tied too). Ops of one role are the same computation in repeated
    blocks; their groups are united when they choose among identical strategy lists, so
    strategy ``r`` means the same for all of them. Ops whose label has no index stay alone.
    With ``period`` p > 1 the role also holds each index modulo p: repeats p apart are tied.
    """
    parent = {int(g): int(g) for g in set(group_of_node.tolist())}

    def find(g: int) -> int:
        while parent[g] != g:
            parent[g] = parent[parent[g]]
            g = parent[g]
        return g

    first_of_role: dict[tuple, int] = {}
    rank: dict[tuple, int] = {}
    for n, node in enumerate(nodes):
        if node.op_index is None:  # an argument: its tree path is its label
            var = graph.vars[node.var]
            label, key = node.name, (var.shape, var.dtype)
        else:
            # ops of one op key share one strategy tuple (built once per key and mesh): its identity is the key
            label, key = node.label, id(node.strategies)
        if not re.search(r"\d", label):
            continue
        k = rank[(label, key)] = rank.get((label, key), -1) + 1
        phase = tuple(int(d) % period for d in re.findall(r"\d+", label)) if period > 1 else ()
        role = (re.sub(r"\d+", "#", label), key, k, phase)
        if role not in first_of_role:
            first_of_role[role] = n
            continue
        a, b = find(int(group_of_node[first_of_role[role]])), find(int(group_of_node[n]))
        if a != b and nodes[a].strategies is nodes[b].strategies:
            parent[b] = a
    return np.array([find(int(g)) for g in group_of_node])


def _cost_graph(
    var_info: Mapping[int, tuple[tuple[int, ...], int]],
    mesh: LogicalMesh,
    nodes: list[PlanningNode],
    edges: list[OperandEdge],
    group_of_node: np.ndarray,
    member_map: list[np.ndarray],
    weights: np.ndarray | None = None,
) -> CostGraph:
    """Costs per group (sum over members) and resharding matrices between groups; with ``weights``, each node's
    costs times its weight and each resharding's times ``resharding_weight``."""
    gindex = group_index(group_of_node)
    groups = list(gindex)
    costs = [np.zeros(len(nodes[g].strategies)) for g in groups]
    memory = [np.zeros(len(nodes[g].strategies)) for g in groups]
    per_strategy: dict[int, tuple[np.ndarray, np.ndarray]] = {}
    for n, node in enumerate(nodes):
        gi = gindex[int(group_of_node[n])]
        if id(node.strategies) not in per_strategy:
            per_strategy[id(node.strategies)] = (
                np.array([s.cost for s in node.strategies]),
                np.array([s.memory_cost for s in node.strategies]),
            )
        cost, mem = per_strategy[id(node.strategies)]
        costs[gi] += cost[member_map[n]] if weights is None or weights[n] == 1.0 else cost[member_map[n]] * weights[n]
        memory[gi] += mem[member_map[n]]
    tables = _cache(_RESHARDING_TABLES, mesh)
    # kept per mesh across builds (a stage after its layers, a re-tie, the next candidate's stages):
    # keyed by the strategy tuples' ids, each entry holding the tuples so an id is never reused
    edge_tables: dict[tuple, tuple] = _cache(_EDGE_TABLES, mesh)
    group_edges: dict[tuple[int, int], np.ndarray] = {}
    identity: dict[int, bool] = {}  # node -> whether its member map is the identity (asked lazily)

    def is_identity(n: int) -> bool:
        if n not in identity:
            m = member_map[n]
            identity[n] = len(m) == len(nodes[n].strategies) and bool((m == np.arange(len(m))).all())
        return identity[n]

    for e in edges:
        shape, itemsize = var_info[e.var]
        alias = e.consumer < 0  # an output that must come back in its argument's layout
        consumer = e.operand if alias else e.consumer
        producer_strategies, consumer_strategies = nodes[e.producer].strategies, nodes[consumer].strategies
        # repeated layers share strategy tuples (see _op_key), so most edges hit this cache
        key = (id(producer_strategies), e.output, id(consumer_strategies), alias, e.operand, shape, itemsize)
        hit = edge_tables.get(key)
        if hit is None or hit[0] is not producer_strategies or hit[1] is not consumer_strategies:
            src = [s.output_specs[e.output] for s in producer_strategies]
            if alias:
                dst = [s.output_specs[0] for s in consumer_strategies]
            else:
                dst = [s.input_specs[e.operand] for s in consumer_strategies]
            hit = edge_tables[key] = (producer_strategies, consumer_strategies,
                                      _resharding_table(src, dst, shape, itemsize, mesh, tables))
        table = hit[2]
        weight = resharding_weight(weights, e)
        if weight != 1.0:
            table = table * weight
        gu, gv = gindex[int(group_of_node[e.producer])], gindex[int(group_of_node[consumer])]
        rows, cols = member_map[e.producer], member_map[consumer]
        if gu == gv:  # both ends in one group: its r-th strategy pays R[rows[r], cols[r]]
            costs[gu] += table[rows, cols]
            continue
        # most nodes are alone in their group (identity member maps): the table is the edge as it is
        lifted = table if is_identity(e.producer) and is_identity(consumer) else table[np.ix_(rows, cols)]
        if (gv, gu) in group_edges:
            group_edges[(gv, gu)] = group_edges[(gv, gu)] + lifted.T
        else:
            group_edges[(gu, gv)] = group_edges.get((gu, gv), 0) + lifted
    return CostGraph(
        node_costs=tuple(costs),
        node_memory=tuple(memory),
        edges=tuple((u, v, m) for (u, v), m in group_edges.items()),
        names=tuple(nodes[g].name for g in groups),
    )


def _resharding_table(
    src: list[ShardingSpec], dst: list[ShardingSpec], shape: tuple[int, ...], itemsize: int, mesh: LogicalMesh, cache: dict
) -> np.ndarray:
    """Seconds to reshard a tensor of ``shape`` from each src spec to each dst spec (cached by shape)."""
    usrc = sorted(set(src), key=str)
    udst = sorted(set(dst), key=str)
    key = (shape, itemsize, tuple(usrc), tuple(udst))
    if key not in cache:
        cache[key] = np.array(
            [[resharding(a, b, shape, itemsize, mesh).cost for b in udst] for a in usrc]
        )
    table = cache[key]
    at_src = {s: i for i, s in enumerate(usrc)}
    at_dst = {s: i for i, s in enumerate(udst)}
    return table[np.ix_([at_src[s] for s in src], [at_dst[s] for s in dst])]


def solve_strategy_graph(
    sg: StrategyGraph,
    pins: Mapping[str, str] | None = None,
    *,
    restrictions: Mapping[str, Collection[str]] | None = None,
    memory_budget: float | None = None,
    time_limit: float = ILP_TIME_LIMIT,
) -> IntraOpSolution:
    """Choose a strategy for every node.

    ``pins`` fix a node (op or argument name) to one strategy; ``restrictions`` limit a
    node to a set of strategies (how the comparison methods, e.g. data parallel, are
    expressed). Infeasible pins raise a ``PinError`` naming a minimal conflicting set.
    """
    pins = dict(pins or {})
    restrictions = dict(restrictions or {})
    allowed = allowed_strategies(sg, pins, restrictions)
    given = pins
    pins, layouts = split_output_pins(sg, pins)
    try:
        cost_graph = _with_output_layouts(sg, layouts, sg.cost_graph, sg.node_weights) if layouts else sg.cost_graph
        sol = solve(cost_graph, allowed=allowed, memory_budget=memory_budget, time_limit=time_limit)
    except InfeasibleError as exc:
        if pins or layouts:
            conflict = _conflicting_pins(sg, given, restrictions, memory_budget, time_limit)
            if conflict:
                where = " within the memory budget" if memory_budget else ""
                if sg.mesh.forbidden:  # the pair may be fine but for the resharding between them
                    where += (f" without {' or '.join(sg.mesh.forbidden)} (the plan's AutoShardingOption forbids it, or its "
                              "method: data parallelism on a line of devices issues neither)")
                raise PinError(
                    f"these pins cannot hold together{where}: "
                    + ", ".join(f"{k}={v!r}" for k, v in conflict.items())
                    + "; unpin one of them",
                    tuple(conflict),
                ) from exc
        raise
    gindex = group_index(sg.group_of_node)
    choice = tuple(
        int(sg.member_map[n][sol.choice[gindex[int(sg.group_of_node[n])]]]) for n in range(len(sg.nodes))
    )
    objective = sol.objective
    if sg.plain_cost_graph is not None:  # weighted: the plan reports every cost once
        plain = _with_output_layouts(sg, layouts, sg.plain_cost_graph, None) if layouts else sg.plain_cost_graph
        objective = evaluate(plain, sol.choice)
    return IntraOpSolution(choice=choice, objective=objective, ilp=sol)


def group_index(group_of_node: np.ndarray) -> dict[int, int]:
    """Representative node -> index of its group in the cost graph (in node order)."""
    return {g: i for i, g in enumerate(sorted(set(int(g) for g in group_of_node)))}


def group_choices(sg: StrategyGraph, gindex: Mapping[int, int], n: int, strategies: Collection[int]) -> tuple[int, set[int]]:
    """(node n's group in the cost graph, the group's choices that give n one of ``strategies``): a merged or tied
    node's strategy follows its group's choice (``member_map``)."""
    return gindex[int(sg.group_of_node[n])], {r for r, m in enumerate(sg.member_map[n]) if int(m) in strategies}


OUTPUT_PIN = "output "
"""Prefix of a pin on a result of the step (``"output [1]": "S0R"``, Alpa's ``out_axis_resources``): the layout the
result is returned in. It fixes no op: the ILP pays the resharding from whatever the op making it gives."""


def split_output_pins(sg: StrategyGraph, pins: Mapping[str, str]) -> tuple[dict[str, str], dict[int, ShardingSpec]]:
    """``pins`` as the nodes' pins and the layouts of pinned results (output position -> spec), checked."""
    node_pins: dict[str, str] = {}
    layouts: dict[int, ShardingSpec] = {}
    for name, text in pins.items():
        if not name.startswith(OUTPUT_PIN):
            node_pins[name] = text
            continue
        path = name[len(OUTPUT_PIN):]
        if path not in sg.out_paths:
            raise PinError(f"the step has no result {path!r} to pin; its results are {', '.join(sg.out_paths) or 'none'}", (name,))
        pos = sg.out_paths.index(path)
        v = sg.outvars[pos]
        if v not in sg.node_of_var:  # a constant of the program: returned whole, so only "replicated" holds
            if set(text) <= {"R", "-"}:
                continue
            raise PinError(f"result {path} is a constant of the program, returned whole: it cannot be split as {text!r}", (name,))
        shape = sg.var_info[v][0]
        try:
            spec = ShardingSpec.parse(text)
            if spec.rank != len(shape) or not spec.is_valid_for(shape, sg.mesh.shape):
                raise ValueError(f"it does not fit a tensor of shape {tuple(shape)} on a {sg.mesh.shape[0]}x{sg.mesh.shape[1]} mesh")
        except ValueError as exc:
            raise PinError(f"result {path} cannot be returned as {text!r}: {exc}", (name,)) from exc
        layouts[pos] = spec
    return node_pins, layouts


def output_layout_edges(sg: StrategyGraph, layouts: Mapping[int, ShardingSpec]) -> list[OperandEdge]:
    """Per pinned result, an edge from the op making it to the program's output (``operand`` -1: no node) and, for
    a new state (an alias), one from that output into its argument's layout, which the next step reads (``producer``
    -1: the pinned layout)."""
    out = []
    for pos in sorted(layouts):
        v = sg.outvars[pos]
        out.append(OperandEdge(*sg.node_of_var[v], -1 - pos, -1, v))
        if _alias_edge(sg, pos) is not None:
            out.append(OperandEdge(-1, 0, -1 - pos, sg.node_of_var[sg.aliases[pos]][0], v))
    return out


def _alias_edge(sg: StrategyGraph, pos: int) -> OperandEdge | None:
    return next((e for e in sg.edges if e.consumer == -1 - pos), None)


def _with_output_layouts(
    sg: StrategyGraph, layouts: Mapping[int, ShardingSpec], base: CostGraph, weights: np.ndarray | None
) -> CostGraph:
    """``base`` (``sg``'s cost graph, weighted by ``weights`` as ``_cost_graph`` weighs) with, on the op making each
    pinned result, the resharding into its pinned layout. A new state pinned so no longer goes straight back into its
    argument's layout: its alias edge is taken out, and the argument pays the resharding from the pinned layout
    instead (once a step, as the alias edge did)."""
    costs = list(base.node_costs)
    edges = {(u, v): m for u, v, m in base.edges}
    gindex = group_index(sg.group_of_node)

    def unary(n: int, out: int, src_of: Any, dst_of: Any, shape: tuple[int, ...], itemsize: int, weight: float) -> None:
        price: dict[tuple, float] = {}
        for s in sg.nodes[n].strategies:
            key = (src_of(s), dst_of(s))
            if key not in price:
                price[key] = resharding(key[0], key[1], shape, itemsize, sg.mesh).cost
        vec = np.array([price[(src_of(s), dst_of(s))] for s in sg.nodes[n].strategies]) * weight
        g = gindex[int(sg.group_of_node[n])]
        costs[g] = costs[g] + vec[sg.member_map[n]]

    for pos, layout in layouts.items():
        v = sg.outvars[pos]
        n, out = sg.node_of_var[v]
        shape, itemsize = sg.var_info[v]
        unary(n, out, lambda s: s.output_specs[out], lambda s: layout, shape, itemsize,
              1.0 if weights is None else float(weights[n]))
        e = _alias_edge(sg, pos)
        if e is None:
            continue
        arg = e.operand
        weight = resharding_weight(weights, e)
        table = weight * np.array([[resharding(a.output_specs[e.output], b.output_specs[0], shape, itemsize, sg.mesh).cost
                                    for b in sg.nodes[arg].strategies] for a in sg.nodes[e.producer].strategies])
        rows, cols = sg.member_map[e.producer], sg.member_map[arg]
        gu, gv = gindex[int(sg.group_of_node[e.producer])], gindex[int(sg.group_of_node[arg])]
        if gu == gv:
            costs[gu] = costs[gu] - table[rows, cols]
        elif (gu, gv) in edges:
            edges[(gu, gv)] = edges[(gu, gv)] - table[np.ix_(rows, cols)]
        else:
            edges[(gv, gu)] = edges[(gv, gu)] - table[np.ix_(rows, cols)].T
        unary(arg, 0, lambda s: layout, lambda s: s.output_specs[0], shape, itemsize, weight)
    return dataclasses.replace(base, node_costs=tuple(costs), edges=tuple((u, v, m) for (u, v), m in edges.items()))


def allowed_strategies(
    sg: StrategyGraph, pins: Mapping[str, str], restrictions: Mapping[str, Collection[str]] | None = None
) -> dict[int, set[int]]:
    """Pins and restrictions on nodes become allowed strategy sets of their groups."""
    gindex = group_index(sg.group_of_node)
    wanted: dict[str, tuple[set[int], str]] = {}
    for name, names in (restrictions or {}).items():
        node = sg.nodes[sg.node_index(name)]
        wanted[name] = ({node.strategy_index(x) for x in names}, "restriction")
    # a result's layout is priced on the op making it (``_with_output_layouts``); a new state's pins its argument
    pins = split_output_pins(sg, pins)[0]
    for name, strategy in pins.items():
        node = sg.nodes[sg.node_index(name)]
        j = {node.strategy_index(strategy)}
        prev = wanted.get(name, (j, ""))[0]
        wanted[name] = (prev & j, "pin")
        if not wanted[name][0]:
            raise PinError(f"pin {name}={strategy!r} is not allowed by the planning method's restrictions", (name,))
    allowed: dict[int, set[int]] = {}
    owner: dict[int, list[str]] = {}
    for name, (js, why) in wanted.items():
        gi, reps = group_choices(sg, gindex, sg.node_index(name), js)
        if not reps:
            leader = sg.cost_graph.names[gi]
            raise PinError(
                f"op {name!r} is merged into {leader!r} (it follows that op's layout), and no choice there "
                f"gives it the {why}ned strategy; pin {leader!r} instead (see plan.explain({leader!r}))",
                (name,),
            )
        allowed[gi] = allowed.get(gi, reps) & reps
        if why == "pin":
            owner.setdefault(gi, []).append(name)
        if not allowed[gi]:
            names = owner.get(gi, [name])
            raise PinError(
                "these pins cannot hold together (they fix one group of merged ops in two ways): "
                + ", ".join(f"{k}={pins.get(k, '?')!r}" for k in names)
                + "; unpin one of them",
                tuple(names),
            )
    return allowed


def _conflicting_pins(
    sg: StrategyGraph,
    pins: dict[str, str],
    restrictions: Mapping[str, Collection[str]],
    memory_budget: float | None,
    time_limit: float,
) -> dict[str, str]:
    """A minimal set of pins that is infeasible on its own (deletion filter)."""

    def feasible(subset: dict[str, str]) -> bool:
        try:
            allowed = allowed_strategies(sg, subset, restrictions)
            layouts = split_output_pins(sg, subset)[1]  # results' pins are members too (a forbidden resharding)
            solve(_with_output_layouts(sg, layouts, sg.cost_graph, sg.node_weights) if layouts else sg.cost_graph, allowed=allowed,
                  memory_budget=memory_budget, time_limit=time_limit)
            return True
        except (InfeasibleError, PinError):
            return False

    if feasible({}) is False or feasible(pins):  # infeasible without pins, or not for their sake
        return {}
    core = dict(pins)
    for name in list(pins):
        trial = {k: v for k, v in core.items() if k != name}
        if not feasible(trial):
            core = trial
    return core
