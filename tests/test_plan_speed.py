"""The planning-time shortcuts (issue 11 part 1) give what the slow paths give, on the cases where they could differ."""

from __future__ import annotations

import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import alpa_lab as al
from alpa_lab.api import microbatch_args, trace_microbatched
from alpa_lab.graph.markers import auto_layers
from alpa_lab.graph.subgraph import subgraph
from alpa_lab.graph.trace import param_signature, trace
from alpa_lab.models import tiny_example
from alpa_lab.passes.inter_op import stage_dp
from alpa_lab.passes.intra_op import build_strategy_graph, retie, solve_strategy_graph
from alpa_lab.passes.pipeline import PipelineProblem, plan_pipeline


def slow_trace(fn, args, M, layers):
    micro, split = microbatch_args(fn, args, M)
    with auto_layers(layers):
        return trace(fn, *micro), split


def _sgd(params, x, y):
    def loss(p):
        h = jnp.tanh(x @ p["w1"])
        return jnp.mean((h @ p["w2"] - y) ** 2)

    g = jax.grad(loss)(params)
    return jax.tree_util.tree_map(lambda p, d: p - 0.1 * d, params, g)


@pytest.mark.parametrize("case", ["state_batch", "two_batch_args", "state_shaped_like_the_batch", "returns_the_batch"])
def test_tracing_once_finds_the_same_batch_and_program_as_tracing_twice(case):
    """The guessed split is checked against the trace: right guesses and wrong ones end where microbatch_args ends."""
    B = 16
    params = {"w1": jnp.ones((8, 8)), "w2": jnp.ones((8, 4))}
    x, y = jnp.ones((B, 8)), jnp.ones((B, 4))
    if case == "state_batch":
        fn, args = (lambda p, batch: _sgd(p, batch["x"], batch["y"])), (params, {"x": x, "y": y})
    elif case == "two_batch_args":
        fn, args = (lambda p, a, b, lr: jax.tree_util.tree_map(lambda t: t * lr, _sgd(p, a, b))), (params, x, y, jnp.float32(0.5))
    elif case == "state_shaped_like_the_batch":
        # one state array whose leading dimension is the batch size: the shape guess takes it for batch
        def fn(w, x):
            return w - 0.1 * jax.grad(lambda w: jnp.sum(jnp.tanh(x @ w.T)))(w)

        fn, args = fn, (jnp.ones((B, 8)), x)
    else:  # the step hands its batch back: microbatch_args calls that state
        fn, args = (lambda p, batch: (_sgd(p, batch["x"], batch["y"]), batch)), (params, {"x": x, "y": y})
    if case == "returns_the_batch":  # every argument comes back: no batch, the same error either way
        with pytest.raises(ValueError, match="no batch to split") as slow:
            slow_trace(fn, args, 4, 1)
        with pytest.raises(ValueError) as fast:
            trace_microbatched(fn, args, 4, 1)
        assert str(fast.value) == str(slow.value)
        return
    graph, split = trace_microbatched(fn, args, 4, 1)
    ref_graph, ref_split = slow_trace(fn, args, 4, 1)
    assert split == ref_split and graph.fingerprint == ref_graph.fingerprint


def test_stage_costs_from_cumulative_sums_equal_the_sums_of_layer_costs():
    ex = tiny_example("gpt")
    step = al.parallelize(ex.train_step, cluster=al.ClusterSpec.local(2, 2), microbatches=2, layers=4)
    problem = PipelineProblem.build(step.trace(*ex.args), step.cluster)
    L = problem.slicing.num_layers
    for submesh, logical in (((1, 2), (1, 2)), ((2, 2), (2, 2)), ((2, 2), (4, 1))):
        for method in ("alpa", "megatron"):
            for start in range(L):
                for end in range(start + 1, L + 1):
                    got = problem.stage_cost(start, end, submesh, logical, method)
                    parts = [problem.layer_cost(k, submesh, logical, method) for k in range(start, end)]
                    if any(p is None for p in parts):
                        assert got is None
                        continue
                    for f in ("forward", "backward", "weight_memory", "activation_memory"):
                        want = sum(getattr(p, f) for p in parts)
                        assert getattr(got, f) == pytest.approx(want, rel=1e-12, abs=1e-18), (start, end, f)


def test_a_layer_graph_shared_by_the_methods_prices_them_as_a_fresh_build():
    ex = tiny_example("mlp")
    step = al.parallelize(ex.train_step, cluster=al.ClusterSpec.local(1, 4), microbatches=2, layers=2)
    graph = step.trace(*ex.args)
    shared = PipelineProblem.build(graph, step.cluster)
    for method in ("alpa", "megatron", "zero3"):  # the first builds, the others reuse its graph
        fresh = PipelineProblem.build(graph, step.cluster)  # (2, 2): not a line, so no view borrows another's costs
        assert shared.layer_cost(0, (1, 4), (2, 2), method) == fresh.layer_cost(0, (1, 4), (2, 2), method)
    assert len(shared.layer_graphs) == 1


def test_the_profiled_table_kept_between_dp_runs_gives_the_same_optima():
    ex = tiny_example("mlp")
    step = al.parallelize(ex.train_step, cluster=al.ClusterSpec.local(2, 2), microbatches=4, layers=4)
    problem = PipelineProblem.build(step.trace(*ex.args), step.cluster)
    calls = []

    def cost(start, end, submesh, logical):
        calls.append(1)
        c = problem.stage_cost(start, end, submesh, logical)
        return None if c is None else al_stage_cost(c)

    cache: dict = {}
    for k in (None, 1, 2, 3):
        kept = stage_dp(problem.slicing.num_layers, 2, 2, 4, cost, max_stages=k, cache=cache)
        before = len(calls)
        fresh = stage_dp(problem.slicing.num_layers, 2, 2, 4, cost, max_stages=k)
        assert len(calls) > before  # the fresh run asked again; the cached one did not (below)
        assert kept.stages == fresh.stages and kept.total_time == fresh.total_time
    profiled = len(calls)
    stage_dp(problem.slicing.num_layers, 2, 2, 4, cost, cache=cache)
    assert len(calls) == profiled


def al_stage_cost(c):
    from alpa_lab.passes.inter_op import StageCost

    return StageCost(c.time, c.weight_memory + c.activation_memory)


def test_retied_graph_equals_a_graph_built_at_that_period():
    from tests.test_reuse import _linear_stack  # six identical layers: period 2 unties the alternation

    fn, args = _linear_stack()
    graph = trace(fn, *args)
    mesh = al.ClusterSpec.local(1, 4).logical_mesh((1, 4))
    base = build_strategy_graph(graph, mesh)
    built = build_strategy_graph(graph, mesh, tie_period=2)
    re = retie(base, graph, 2)
    assert re.ties == built.ties and (re.group_of_node == built.group_of_node).all()
    assert solve_strategy_graph(re).objective == pytest.approx(solve_strategy_graph(built).objective, rel=1e-12)
    assert solve_strategy_graph(re).objective < solve_strategy_graph(base).objective


def test_a_stage_placed_on_other_devices_shares_its_problem_but_keeps_its_devices():
    ex = tiny_example("gpt")
    step = al.parallelize(ex.train_step, cluster=al.ClusterSpec.local(2, 2), microbatches=2, layers=4)
    graph = step.trace(*ex.args)
    problem = PipelineProblem.build(graph, step.cluster)
    a = problem.stage_graph((0, 2), (1, 2), (1, 2), (0, 1))
    b = problem.stage_graph((0, 2), (1, 2), (1, 2), (2, 3))
    assert a.mesh.device_ids == (0, 1) and b.mesh.device_ids == (2, 3) and a.cost_graph is b.cost_graph
    fresh = build_strategy_graph(problem.piece((0, 2)).graph, problem.mesh((1, 2), (1, 2), (2, 3)),
                                 argument_kinds=problem.piece_kinds(problem.piece((0, 2))))
    assert solve_strategy_graph(b).objective == pytest.approx(solve_strategy_graph(fresh).objective, rel=1e-12)
    # a whole plan: stage plans on their own devices, the same step time as a problem planned without sharing
    _, stages, timeline = plan_pipeline(graph, step.cluster, num_microbatches=2, problem=problem)
    assert sorted(d for st in stages for d in st.device_ids) == [0, 1, 2, 3]
    for st in stages:
        assert st.plan.device_ids == st.device_ids  # each stage's plan runs on its own devices
    # the same stage placed on devices (2, 3) instead of (0, 1): one solve, each plan on its devices
    x = problem.stage_plans
    from alpa_lab.passes.pipeline import _plan_stage

    p0 = _plan_stage(problem, (0, 2), (1, 2), (1, 2), (0, 1), "alpa", {})
    solutions = len(problem.stage_solutions)
    p1 = _plan_stage(problem, (0, 2), (1, 2), (1, 2), (2, 3), "alpa", {})
    assert len(problem.stage_solutions) == solutions and x is problem.stage_plans
    assert (p0.device_ids, p1.device_ids) == ((0, 1), (2, 3)) and p0.objective == p1.objective
    assert [o.strategy for o in p0.ops] == [o.strategy for o in p1.ops]


def _stack_problem(reuse: bool = True) -> PipelineProblem:
    """An 8-layer GPT whose layers 1-6 are equal (layer keys 0, 1, 1, 1, 1, 1, 1, 2)."""
    from alpa_lab.models import gpt_config, make_gpt

    ex = make_gpt(gpt_config(layers=8, hidden=256, heads=8, batch=16, seq_len=128, vocab=1024), abstract=True)
    graph, _ = trace_microbatched(ex.train_step, ex.args, 4, 8)
    return PipelineProblem.build(graph, al.ClusterSpec.local(2, 4), reuse=reuse)


TWIN_STAGES = [((0, 1), (1, 1), (1, 1), (0,)), ((1, 3), (1, 2), (1, 2), (1, 2)), ((3, 5), (1, 2), (1, 2), (4, 5)),
               ((5, 7), (1, 2), (1, 2), (6, 7)), ((7, 8), (1, 1), (1, 1), (3,))]


def node_fields(sg):
    return [(n.name, n.kind, n.strategies, n.op_index, n.var, n.label, n.primitive) for n in sg.nodes]


def test_a_stage_of_equal_layers_is_its_twin_renamed():
    """Blocks 3-4 on a mesh are blocks 1-2's problem with their own names: field for field a fresh build."""
    problem = _stack_problem()
    assert problem.layer_keys[1:7] == (problem.layer_keys[1],) * 6
    first = problem.stage_graph((1, 3), (1, 2), (1, 2), (1, 2))
    twin = problem.stage_graph((3, 5), (1, 2), (1, 2), (4, 5))
    assert twin.cost_graph is first.cost_graph  # renamed, not built
    piece = problem.piece((3, 5))
    fresh = build_strategy_graph(piece.graph, twin.mesh, argument_kinds=problem.piece_kinds(piece))
    assert node_fields(twin) == node_fields(fresh) and node_fields(twin) != node_fields(first)
    assert twin.edges == fresh.edges and dict(twin.node_of_var) == dict(fresh.node_of_var)
    assert (twin.group_of_node == fresh.group_of_node).all() and twin.ties == fresh.ties
    assert (twin.fingerprint, twin.in_paths, twin.out_paths) == (fresh.fingerprint, fresh.in_paths, fresh.out_paths)
    assert dict(twin.aliases) == dict(fresh.aliases) and dict(twin.argument_kinds) == dict(fresh.argument_kinds)
    for a, b in zip(twin.cost_graph.node_costs, fresh.cost_graph.node_costs):
        np.testing.assert_array_equal(a, b)
    for (u, v, r), (x, y, q) in zip(twin.cost_graph.edges, fresh.cost_graph.edges):
        assert (u, v) == (x, y)
        np.testing.assert_array_equal(r, q)
    # programs that differ in more than names are not renamed into each other
    from alpa_lab.passes.intra_op import relabel

    assert relabel(first, problem.piece((1, 3)).graph, problem.piece((0, 2)).graph) is None
    assert relabel(first, problem.piece((1, 3)).graph, problem.piece((6, 8)).graph) is None


def test_stage_plans_from_twins_equal_plans_solved_afresh():
    """The solution of equal layers is shared; plans, figures and the simulated step equal a problem without twins."""
    from alpa_lab.passes.pipeline import plan_stages

    out = {}
    for reuse in (True, False):
        problem = _stack_problem(reuse)
        results, timeline = plan_stages(problem, TWIN_STAGES, num_microbatches=4, schedule="1f1b")
        out[reuse] = (problem, results, timeline)
    (twins, with_twins, t1), (_, fresh, t2) = out[True], out[False]
    assert t1.makespan == t2.makespan
    for a, b in zip(with_twins, fresh):
        assert [(o.name, o.strategy, o.merged_into) for o in a.plan.ops] == [(o.name, o.strategy, o.merged_into) for o in b.plan.ops]
        assert a.plan.reshardings == b.plan.reshardings and a.plan.inputs == b.plan.inputs and a.plan.outputs == b.plan.outputs
        assert (a.forward_time, a.backward_time, a.apply_time, a.weight_memory, a.activation_memory) == (
            b.forward_time, b.backward_time, b.apply_time, b.weight_memory, b.activation_memory)
        assert a.plan.device_ids == a.device_ids
    # three stages of equal layers: one ILP solve (the others are the twin's solution)
    signature = next(k[1] for k in twins.stage_graphs if k[0] == (1, 3))
    cost_graphs = {id(twins.stage_graphs[(layers, signature, 1)].cost_graph) for layers in ((1, 3), (3, 5), (5, 7))}
    assert len(cost_graphs) == 1
    # a pinned stage is solved on its own, with its pin
    pinned = out[True][0]
    op = next(o for o in with_twins[2].plan.ops if o.kind == "op" and o.num_strategies > 1 and o.primitive == "dot_general")
    sg = pinned.stage_graphs[((3, 5), signature, 1)]
    other = next(s.name for s in sg.nodes[sg.node_index(op.name)].strategies if s.name != op.strategy)
    plan = plan_stages(pinned, TWIN_STAGES, num_microbatches=4, schedule="1f1b", pins={op.name: other})[0][2].plan
    assert plan.op(op.name).strategy == other and dict(plan.pins) == {op.name: other}


def test_pieces_cut_with_the_consumer_index_equal_pieces_cut_by_scanning():
    ex = tiny_example("gpt")
    step = al.parallelize(ex.train_step, cluster=al.ClusterSpec.local(1, 2), microbatches=2, layers=4)
    graph = step.trace(*ex.args)
    consumers = graph.consumers()
    rng = np.random.default_rng(0)
    for _ in range(5):
        ops = sorted(rng.choice(len(graph.ops), size=len(graph.ops) // 3, replace=False).tolist())
        a, b = subgraph(graph, ops), subgraph(graph, ops, consumers=consumers)
        assert a.graph.fingerprint == b.graph.fingerprint and a.outvars == b.outvars and a.invars == b.invars
    for lay in range(4):
        ops = PipelineProblem.build(graph, step.cluster).slicing.ops_of([lay])
        a, b = subgraph(graph, ops), subgraph(graph, ops, consumers=consumers)
        assert (a.graph.fingerprint, a.invars, a.outvars, a.var_map) == (b.graph.fingerprint, b.invars, b.outvars, b.var_map)


def test_a_piece_copies_every_field_of_its_ops_and_tensors():
    """``subgraph`` copies ops and tensors field by field (faster than ``dataclasses.replace``): each is the whole
    program's, renumbered; and a piece's fingerprint (hashed from its contents) tells pieces apart."""
    ex = tiny_example("gpt")
    step = al.parallelize(ex.train_step, cluster=al.ClusterSpec.local(1, 2), microbatches=2, layers=4)
    graph = step.trace(*ex.args)
    problem = PipelineProblem.build(graph, step.cluster)
    ops = problem.slicing.ops_of([1, 2])
    piece = subgraph(graph, ops)
    back = {new: old for old, new in piece.var_map.items()}
    for new_op, i in zip(piece.graph.ops, ops):
        old = graph.ops[i]
        want = dataclasses.replace(old, index=new_op.index, inputs=tuple(piece.var_map[v] for v in old.inputs),
                                   outputs=tuple(piece.var_map[v] for v in old.outputs))
        assert [getattr(new_op, f.name) for f in dataclasses.fields(new_op)] == [getattr(want, f.name) for f in dataclasses.fields(want)]
        assert new_op.signature == param_signature(old.params)  # worked out when traced
    crossing = set(piece.invars) - set(graph.invars)
    for var in piece.graph.vars:
        old = graph.vars[back[var.id]]
        if old.id in crossing:  # computed by another piece: an argument here, named by its producer
            assert (var.kind, var.producer, var.name) == ("input", None, f"<{graph.ops[old.producer].name}:"
                                                          f"{graph.ops[old.producer].outputs.index(old.id)}>")
        else:
            producer = None if old.producer is None else ops.index(old.producer)
            assert var == dataclasses.replace(old, id=var.id, producer=producer)
    again, fewer = subgraph(graph, ops), subgraph(graph, ops, outputs=piece.outvars[:1])
    other = subgraph(graph, problem.slicing.ops_of([2, 3]))
    assert again.graph.fingerprint == piece.graph.fingerprint
    assert len({piece.graph.fingerprint, fewer.graph.fingerprint, other.graph.fingerprint}) == 3


def _boundary_bytes_by_scanning(problem, stages):
    """The per-op scan ``boundary_parts`` replaced: per boundary, bytes sent forward and back (the reference)."""
    from alpa_lab.passes.stages import APPLY

    graph, sl = problem.graph, problem.slicing
    stage_of_op = sl.stage_of_ops([st.layers for st in stages])
    forward, backward, seen = [0] * len(stages), [0] * len(stages), set()
    for op in graph.ops:
        if sl.phase[op.index] == APPLY:
            continue
        dst = stage_of_op[op.index]
        for v in op.inputs:
            p = graph.vars[v].producer
            if p is None or sl.phase[p] == APPLY or (v, dst) in seen:
                continue
            seen.add((v, dst))
            src = stage_of_op[p]
            if src < dst:
                forward[src] += graph.vars[v].nbytes
            elif src > dst:
                backward[dst] += graph.vars[v].nbytes
    return [max(f, b) for f, b in zip(forward, backward)]


@pytest.mark.parametrize("name", ["mlp", "gpt"])
def test_boundary_transfers_equal_a_scan_of_every_read(name):
    """``boundary_parts`` (numpy over the reads, made once per problem) against the per-op scan, on every slicing of
    4 layers into 1-4 stages: the same bytes, exactly."""
    import itertools

    from alpa_lab.passes.pipeline import StageResult, boundary_parts

    ex = tiny_example(name)
    step = al.parallelize(ex.train_step, cluster=al.ClusterSpec.local(4, 1), microbatches=2, layers=4)
    problem = PipelineProblem.build(step.trace(*ex.args), step.cluster)
    bandwidth = problem.cluster.inter_host_bandwidth
    crossed = 0
    for k in (0, 1, 2, 3):
        for cuts in itertools.combinations(range(1, 4), k):
            bounds = (0, *cuts, 4)
            stages = [StageResult(i, r, (1, 1), (1, 1), (i,), None, 0, 0, 0, 0, 0, 1, 0)
                      for i, r in enumerate(zip(bounds[:-1], bounds[1:]))]
            want = _boundary_bytes_by_scanning(problem, stages)
            got = [round(p.communication * bandwidth) for p in boundary_parts(problem, stages)]
            assert got == want[: len(got)]
            assert [p.transfers for p in boundary_parts(problem, stages)] == [1.0 if w else 0.0 for w in want[: len(got)]]
            crossed += sum(w > 0 for w in want)
    assert crossed >= 10


def test_send_bytes_are_what_the_placed_stages_send():
    """``PipelineProblem.send_seconds`` (priced in the DP) against ``boundary_parts`` (priced on placed stages), on
    every slicing of 4 layers into 2-4 stages: each stage's heavier direction to and from later stages."""
    import itertools

    from alpa_lab.passes.pipeline import StageResult, boundary_parts

    ex = tiny_example("gpt")
    step = al.parallelize(ex.train_step, cluster=al.ClusterSpec.local(4, 1), microbatches=2, layers=4)
    problem = PipelineProblem.build(step.trace(*ex.args), step.cluster)
    c = problem.cluster
    checked = 0
    for k in (1, 2, 3):
        for cuts in itertools.combinations(range(1, 4), k):
            bounds = (0, *cuts, 4)
            ranges = list(zip(bounds[:-1], bounds[1:]))
            stages = [StageResult(i, r, (1, 1), (1, 1), (i,), None, 0, 0, 0, 0, 0, 1, 0) for i, r in enumerate(ranges)]
            parts = boundary_parts(problem, stages)  # stages on four hosts: bytes = seconds x the inter-host link
            for (start, end), part in zip(ranges, parts):
                want = part.communication * c.inter_host_bandwidth
                assert problem.send_seconds(start, end, (1, 1)) * c.inter_host_bandwidth == pytest.approx(want, rel=1e-12)
                checked += want > 0
            assert problem.send_seconds(*ranges[-1], (1, 1)) == 0.0  # the last stage sends nothing on
    assert checked >= 6
    # the link: a stage on whole hosts sends to another host, one on part of a host likely within it
    two = PipelineProblem.build(step.trace(*ex.args), al.ClusterSpec.local(2, 2))
    assert two.send_seconds(0, 2, (1, 2)) * two.cluster.inter_host_bandwidth == pytest.approx(
        two.send_seconds(0, 2, (1, 1)) * two.cluster.intra_host_bandwidth, rel=1e-12)


def test_the_dp_with_transfers_is_optimal_by_brute_force():
    """The DP's stage times with each stage's outgoing transfer added: still the optimum of eq. 2 over every slicing."""
    from alpa_lab.passes.inter_op import StageCost, brute_force_stages

    ex = tiny_example("gpt")
    cluster = dataclasses.replace(al.ClusterSpec.local(2, 2), inter_host_bandwidth=2e6)  # slow links: transfers matter
    step = al.parallelize(ex.train_step, cluster=cluster, microbatches=4, layers=4)
    problem = PipelineProblem.build(step.trace(*ex.args), cluster)

    def cost(start, end, submesh, logical):
        c = problem.stage_cost(start, end, submesh, logical)
        return None if c is None else StageCost(c.time + problem.send_seconds(start, end, submesh))

    for B in (1, 4, 16):
        plan = stage_dp(4, 2, 2, B, cost)
        assert plan.total_time == pytest.approx(brute_force_stages(4, 2, 2, B, cost), rel=1e-12)
    # the paper's DP (no transfers) chooses stages that, once their transfers are priced, are no better
    from alpa_lab.passes.inter_op import pipeline_latency

    plain = stage_dp(4, 2, 2, 4, lambda *a: StageCost(problem.stage_cost(*a).time) if problem.stage_cost(*a) else None)
    priced = stage_dp(4, 2, 2, 4, cost)
    plain_priced = pipeline_latency([cost(*st.layers, st.submesh_shape, st.logical_shape).time for st in plain.stages], 4)
    assert priced.total_time <= plain_priced * (1 + 1e-12)


@pytest.mark.parametrize("name", ["mlp", "gpt"])
def test_pricing_transfers_in_the_dp_never_loses_to_eq2_alone(name):
    """Eq. 2's candidates stay candidates, so the simulated step with the transfer term is never slower than without."""
    ex = tiny_example(name)
    for bandwidth in (2e6, None):  # slow links (transfers dominate) and the preset's
        cluster = al.ClusterSpec.local(2, 2)
        if bandwidth:
            cluster = dataclasses.replace(cluster, inter_host_bandwidth=bandwidth)
        step = al.parallelize(ex.train_step, cluster=cluster, microbatches=4, layers=4)
        graph = step.trace(*ex.args)

        def simulated(transfers):
            _, stages, timeline = plan_pipeline(graph, cluster, num_microbatches=4, transfers=transfers)
            return timeline.makespan + max(st.apply_time for st in stages)

        assert simulated(True) <= simulated(False) * (1 + 1e-9)


def test_resharding_into_a_returned_weights_layout_is_charged_to_the_update():
    """The updated weights and optimizer state go back in their arguments' layouts after the update: once per
    step, not in every micro-batch's forward (it was charged to the forward, 19 ms per micro-batch on GPT-39B)."""
    from alpa_lab.passes.pipeline import accumulation_seconds, plan_stages, stage_parts
    from alpa_lab.passes.stages import APPLY, BACKWARD, FORWARD

    problem = _stack_problem()
    stages = [((0, 4), (1, 4), (4, 1), (0, 1, 2, 3)), ((4, 8), (1, 4), (4, 1), (4, 5, 6, 7))]
    results, _ = plan_stages(problem, stages, num_microbatches=4, schedule="1f1b", method="megatron")
    returned = 0.0
    for st in results:
        parts = stage_parts(problem, st.plan, st.layers)
        outputs = sum(r.cost for r in st.plan.reshardings if r.consumer.startswith("output "))
        phase = {problem.graph.ops[i].name: problem.slicing.phase[i] for i in problem.slicing.ops_of(range(*st.layers))}
        by_ops = {p: sum(r.cost for r in st.plan.reshardings if phase.get(r.consumer) == p) for p in (BACKWARD, APPLY)}
        update_ops = sum(o.communication_cost for o in st.plan.ops if o.kind == "op" and phase[o.name] == APPLY)
        assert parts[APPLY].communication == pytest.approx(update_ops + by_ops[APPLY] + outputs, rel=1e-9, abs=1e-15)
        total = sum(parts[p].compute + parts[p].communication for p in (FORWARD, BACKWARD, APPLY))
        sums = sum(accumulation_seconds(problem, st.plan, st.layers).values())  # the gradient sums
        assert sums > 0 and total == pytest.approx(st.plan.objective + sums, rel=1e-9)  # every second charged once
        returned += outputs
    assert returned > 0  # the case is exercised: megatron on a 4x1 mesh returns weights resharded


def _candidates(graph, cluster, M, schedule, screen):
    problem, stages, timeline = plan_pipeline(graph, cluster, num_microbatches=M, schedule=schedule, screen_candidates=screen)
    chosen = [(st.layers, st.submesh_shape, st.logical_shape, st.device_ids, st.plan.method) for st in stages]
    return problem.candidates, chosen, timeline.makespan + max(st.apply_time for st in stages)


@pytest.mark.parametrize("name", ["mlp", "gpt", pytest.param("wide_resnet", marks=pytest.mark.slow)])
def test_a_candidates_floor_is_below_its_planned_step_and_screening_keeps_the_choice(name):
    """``estimated_step`` (the DP's layer costs simulated with the placed transfers) is a floor of the planned
    candidate's step, so skipping candidates whose floor is above a planned step never changes the plan:
    on slow and preset links, three schedules (the split-backward one is never screened), the screened
    choice equals planning every candidate."""
    ex = tiny_example(name)
    planned = screened = several = 0
    for cluster in (al.ClusterSpec.local(2, 2), dataclasses.replace(al.ClusterSpec.local(2, 4), inter_host_bandwidth=2e6)):
        step = al.parallelize(ex.train_step, cluster=cluster, microbatches=4, layers=4)
        graph = step.trace(*ex.args)
        for schedule in ("1f1b", "gpipe", "zb_h1"):
            every, chosen, best = _candidates(graph, cluster, 4, schedule, screen=False)
            assert all(s is not None for _, _, s in every)
            for _, floor, s in every:
                assert floor <= s * (1 + 1e-9)
            several += len(every) > 1
            kept, chosen_screened, best_screened = _candidates(graph, cluster, 4, schedule, screen=True)
            assert (chosen_screened, best_screened) == (chosen, best)
            assert [c for c, _, _ in kept] == [c for c, _, _ in every]
            planned += sum(s is not None for _, _, s in kept)
            screened += sum(s is None for _, _, s in kept)
            if schedule == "zb_h1":
                assert all(s is not None for _, _, s in kept)
    assert several and screened > 0  # cases with candidates to skip, skipped, and no choice changed


def test_a_power_of_two_space_plans_on_power_of_two_sub_meshes_and_re_plans_keep_it():
    """``parallelize(submesh_space="power_of_two")`` on 3 hosts: the DP's stages, and the DP's stages after
    pin_stages + unpin_stages, use 1- or 2-host sub-meshes only (the space is remembered by the plan's problem)."""
    ex = tiny_example("mlp")
    cluster = al.ClusterSpec.local(3, 1)
    step = al.parallelize(ex.train_step, cluster=cluster, microbatches=4, layers=3, submesh_space="power_of_two")
    plan = step.plan(*ex.args)
    allowed = {(1, 1), (2, 1)}
    assert {st.submesh_shape for st in plan.stages} <= allowed
    again = plan.pin_stages([[0, 2]], submeshes=[(3, 1)]).unpin_stages()
    assert {st.submesh_shape for st in again.stages} <= allowed
    # the plan carries its space: loaded into a step made with the default space ("all"), it re-plans in its own
    loaded = al.PipelinePlan.from_json(plan.pin_stages([[0, 2]], submeshes=[(3, 1)]).to_json())
    assert loaded.submesh_space == "power_of_two"
    other = al.parallelize(ex.train_step, cluster=cluster, microbatches=4, layers=3)
    unpinned = other.use(loaded, *ex.args).unpin_stages()
    assert unpinned.submesh_space == "power_of_two" and {st.submesh_shape for st in unpinned.stages} <= allowed
    assert {st.submesh_shape for st in other.plan(*ex.args).stages} == {(3, 1)}  # that step's own space is "all"
    with pytest.raises(ValueError, match="unknown sub-mesh space 'pow2'; choose one of all, power_of_two"):
        al.parallelize(ex.train_step, cluster=cluster, microbatches=4, submesh_space="pow2")


def test_rebalancing_finds_the_lowest_1f1b_period_of_the_placed_stages_by_brute_force():
    """``_rebalanced`` moves a candidate's boundaries (its sub-meshes, devices, logical meshes and layouts
    kept) to the slicing whose 1F1B period (``one_f_one_b_windows``, each boundary on its placed link) is
    lowest: the same minimum as trying every slicing that fits memory, within the bisection's 1e-6."""
    import itertools

    from alpa_lab.passes.pipeline import _fits, _rebalanced, in_flight_rule
    from alpa_lab.passes.schedule import one_f_one_b_windows

    ex = tiny_example("gpt")
    cluster = dataclasses.replace(al.ClusterSpec.local(2, 4), inter_host_bandwidth=2e6)  # a slow hop between hosts
    step = al.parallelize(ex.train_step, cluster=cluster, microbatches=8, layers=6)
    problem, _, _ = plan_pipeline(step.trace(*ex.args), cluster, num_microbatches=8, screen_candidates=False)
    L, rule, c = problem.slicing.num_layers, in_flight_rule("1f1b", 8), problem.cluster
    checked = moved = 0
    for cand, _, _ in problem.candidates:
        S = cand.num_stages
        if S < 2:
            continue
        hosts = [{d // c.devices_per_host for d in st.device_ids} for st in cand.stages]

        def period(cuts):
            t, x = [], []
            for i, st in enumerate(cand.stages):
                cost = problem.stage_cost(cuts[i], cuts[i + 1], st.submesh_shape, st.logical_shape, st.variant or "alpa")
                fits = None if cost is None else _fits(cost, c.device_memory)
                if cost is None or fits == 0 or (fits is not None and fits < rule(S - i)):
                    return np.inf
                t.append(cost.time)
                if i < S - 1:
                    nbytes = problem.exchanged_bytes(cuts[i], cuts[i + 1])
                    bw = c.intra_host_bandwidth if hosts[i] == hosts[i + 1] else c.inter_host_bandwidth
                    x.append(nbytes / bw + (c.transfer_overhead if nbytes else 0.0))
            return float(one_f_one_b_windows(t, x).max())

        best = min(period((0, *cuts, L)) for cuts in itertools.combinations(range(1, L), S - 1))
        before = period([st.layers[0] for st in cand.stages] + [L])
        found = _rebalanced(problem, cand, rule, "alpa")
        checked += 1
        if found is None:  # nothing lower to move to
            assert before <= best * (1 + 1e-5), (cand, before, best)
            continue
        moved += 1
        assert [st.submesh_shape for st in found.stages] == [st.submesh_shape for st in cand.stages]
        assert [st.device_ids for st in found.stages] == [st.device_ids for st in cand.stages]
        assert period([st.layers[0] for st in found.stages] + [L]) == pytest.approx(best, rel=1e-5)
        assert best < before
    assert checked >= 3 and moved >= 1, (checked, moved)


def test_relocating_the_odd_sub_mesh_finds_its_best_position_by_brute_force():
    """Eq. 2 cannot tell where among equal stages an odd sub-mesh sits; with fewer micro-batches than stages
    1F1B's fill can (GPT-3 175B: 96.6 s with its one 2x8 stage at layer 68, 100.3 s at 94). ``_relocated``,
    started from the worst position of a (1, 2) stage among (1, 1) stages of equal layers, finds the position
    whose simulated step is lowest: the minimum of ``estimated_step`` over every position (the stages placed
    again each time), with every other stage's layers, mesh and layout kept."""
    from alpa_lab.passes.inter_op import InterOpPlan, StagePlan
    from alpa_lab.passes.pipeline import _relocated, estimated_step, in_flight_rule
    from alpa_lab.passes.submesh import place_submeshes

    problem = _stack_problem()  # layer keys 0, 1, 1, 1, 1, 1, 1, 2 on 2 hosts of 4 devices
    B, ranges = 2, [(0, 1), (1, 2), (2, 3), (3, 4), (4, 5), (5, 6), (6, 8)]

    def candidate(wide: int) -> InterOpPlan:
        shapes = [(1, 2) if k == wide else (1, 1) for k in range(len(ranges))]
        placed = place_submeshes(shapes, 2, 4)
        stages = tuple(StagePlan(r, sh, sh, p.device_ids, problem.stage_cost(*r, sh, sh).time, "alpa")
                       for r, sh, p in zip(ranges, shapes, placed))
        return InterOpPlan(stages, 0.0, max(st.time for st in stages), B)

    steps = {k: estimated_step(problem, candidate(k), "1f1b") for k in range(1, 6)}  # the equal stages' positions
    worst, best = max(steps, key=steps.get), min(steps.values())
    assert best < steps[worst] * (1 - 1e-6), steps  # the position matters in this case
    found = _relocated(problem, candidate(worst), in_flight_rule("1f1b", B), "alpa")
    assert found is not None
    assert estimated_step(problem, found, "1f1b") == pytest.approx(best, rel=1e-12)
    wide = [k for k, st in enumerate(found.stages) if st.submesh_shape == (1, 2)]
    assert len(wide) == 1 and steps[wide[0]] == pytest.approx(best, rel=1e-12)
    assert [st.layers for st in found.stages] == ranges
    assert all(st.logical_shape == st.submesh_shape and st.variant == "alpa" for st in found.stages)
    assert sorted(d for st in found.stages for d in st.device_ids) == list(range(8))
    # from the best position nothing is lower: no candidate
    assert _relocated(problem, candidate(wide[0]), in_flight_rule("1f1b", B), "alpa") is None
    # with 8 micro-batches stage k holds 7 - k of them (1F1B): on devices that hold 4 of the (1, 2) stage's, the
    # positions before 3 are refused (eq. 5), and the best of the rest is taken (the unbounded best is 2)
    B = 8
    steps = {k: estimated_step(problem, candidate(k), "1f1b") for k in range(1, 6)}
    assert min(steps, key=steps.get) == 2, steps
    wide_cost = problem.stage_cost(1, 2, (1, 2), (1, 2))
    problem.cluster = dataclasses.replace(problem.cluster, device_memory=wide_cost.weight_memory + 4.5 * wide_cost.activation_memory)
    found = _relocated(problem, candidate(5), in_flight_rule("1f1b", B), "alpa")
    wide = [k for k, st in enumerate(found.stages) if st.submesh_shape == (1, 2)]
    assert wide == [min((3, 4), key=steps.get)], (wide, steps)


@pytest.mark.parametrize("pool", ["threads", "forked"])
def test_layer_costs_solved_two_meshes_at_a_time_equal_those_solved_one_by_one(monkeypatch, pool):
    """``prefetch_layer_costs`` runs the layer ILPs of two meshes at once (threads, CBC in subprocesses; or forked
    worker processes, as a large model's are): every cost equals ``layer_cost``'s own solve on a fresh problem, and
    the plan equals the plan made without it."""
    import alpa_lab.passes.pipeline as pipeline_pass
    from alpa_lab.passes.inter_op import logical_shapes
    from alpa_lab.passes.submesh import submesh_shapes

    monkeypatch.setenv("ALPA_LAB_PLAN_WORKERS", "2")
    monkeypatch.setattr(pipeline_pass, "FORK_MIN_WORK", 0 if pool == "forked" else 10**12)
    forks = []
    real_pool = pipeline_pass.ProcessPoolExecutor
    monkeypatch.setattr(pipeline_pass, "ProcessPoolExecutor", lambda *a, **k: forks.append(1) or real_pool(*a, **k))
    ex = tiny_example("gpt")
    cluster = al.ClusterSpec.local(2, 4)
    step = al.parallelize(ex.train_step, cluster=cluster, microbatches=4, layers=4)
    graph = step.trace(*ex.args)
    meshes = [(s, lg) for s in submesh_shapes(2, 4) for lg in logical_shapes(s)]
    threaded = PipelineProblem.build(graph, cluster)
    threaded.prefetch_layer_costs(meshes, "alpa", lambda submesh, logical: ("megatron", "zero3") if submesh[0] == 1 else ())
    one_by_one = PipelineProblem.build(graph, cluster)
    assert len(threaded.layer_costs) == len(meshes) * len(set(threaded.layer_keys)) + sum(
        2 * len(set(threaded.layer_keys)) for s, _ in meshes if s[0] == 1)
    for (key, submesh, logical, method, axis), cost in threaded.layer_costs.items():
        assert axis is None  # no forced batch axis
        layer = threaded.layer_keys.index(key)
        assert one_by_one.layer_cost(layer, submesh, logical, method) == cost, (layer, submesh, logical, method)
    _, with_prefetch, timeline = plan_pipeline(graph, cluster, num_microbatches=4)
    monkeypatch.setattr(PipelineProblem, "prefetch_layer_costs", lambda *a, **k: None)
    _, without, timeline_without = plan_pipeline(graph, cluster, num_microbatches=4)
    assert [(st.layers, st.device_ids, st.logical_shape, st.plan.method) for st in with_prefetch] == [
        (st.layers, st.device_ids, st.logical_shape, st.plan.method) for st in without]
    assert timeline.makespan == timeline_without.makespan
    assert bool(forks) == (pool == "forked")


def _die(*args):
    os._exit(3)  # a worker process killed mid-solve (out of memory, say)


def test_a_dead_layer_cost_worker_loses_nothing(monkeypatch):
    """A forked worker that dies leaves its meshes to be solved on demand: the plan is the one made without workers."""
    import alpa_lab.passes.pipeline as pipeline_pass

    ex = tiny_example("mlp")
    cluster = al.ClusterSpec.local(2, 4)
    graph = al.parallelize(ex.train_step, cluster=cluster, microbatches=4, layers=4).trace(*ex.args)
    monkeypatch.setattr(pipeline_pass, "FORK_MIN_WORK", 0)
    monkeypatch.setattr(pipeline_pass, "_price_mesh_forked", _die)
    problem = PipelineProblem.build(graph, cluster)
    problem.prefetch_layer_costs([((1, 4), (1, 4)), ((1, 4), (2, 2)), ((2, 4), (2, 4))], "alpa", lambda *mesh: ())
    assert problem.layer_costs == {}  # the workers died: nothing came back, and no error
    _, survived, timeline = plan_pipeline(graph, cluster, num_microbatches=4, problem=problem)
    monkeypatch.setattr(PipelineProblem, "prefetch_layer_costs", lambda *a, **k: None)
    _, serial, timeline_serial = plan_pipeline(graph, cluster, num_microbatches=4)
    assert [(st.layers, st.device_ids, st.logical_shape) for st in survived] == [
        (st.layers, st.device_ids, st.logical_shape) for st in serial]
    assert timeline.makespan == timeline_serial.makespan


def test_two_planners_forking_at_once_take_turns_and_each_gets_its_own_costs(monkeypatch):
    """The fork pool's job is one module global: two problems priced from two threads at once (a notebook planning
    while another cell re-plans) take turns, and each gets the costs of its own model on its own cluster."""
    import threading

    import alpa_lab.passes.pipeline as pipeline_pass

    monkeypatch.setattr(pipeline_pass, "FORK_MIN_WORK", 0)
    monkeypatch.setenv("ALPA_LAB_PLAN_WORKERS", "2")
    meshes = [((1, 4), (1, 4)), ((1, 4), (2, 2)), ((2, 4), (2, 4))]
    problems, errors = [], []
    for name in ("mlp", "gpt"):
        ex = tiny_example(name)
        cluster = al.ClusterSpec.local(2, 4)
        problems.append(PipelineProblem.build(al.parallelize(ex.train_step, cluster=cluster, microbatches=4, layers=4)
                                              .trace(*ex.args), cluster))

    def price(problem):
        try:
            problem.prefetch_layer_costs(meshes, "alpa", lambda *mesh: ())
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=price, args=(p,)) for p in problems]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    for problem in problems:
        fresh = PipelineProblem.build(problem.graph, problem.cluster)
        assert len(problem.layer_costs) == len(meshes) * len(set(problem.layer_keys))
        for (key, submesh, logical, method, _), cost in problem.layer_costs.items():
            assert fresh.layer_cost(problem.layer_keys.index(key), submesh, logical, method) == cost


def test_plan_workers_reads_its_variable(monkeypatch):
    from alpa_lab.passes.pipeline import plan_workers

    monkeypatch.setenv("ALPA_LAB_PLAN_WORKERS", "3")
    assert plan_workers() == 3
    monkeypatch.setenv("ALPA_LAB_PLAN_WORKERS", "many")
    with pytest.raises(ValueError, match="ALPA_LAB_PLAN_WORKERS must be a whole number"):
        plan_workers()
    monkeypatch.delenv("ALPA_LAB_PLAN_WORKERS")
    assert 2 <= plan_workers() <= 8


@pytest.mark.parametrize("model", ["mlp", "gpt", "moe", "wide_resnet"])
def test_a_line_of_devices_viewed_as_1xn_or_nx1_has_one_set_of_layer_costs(model):
    """The (1, n) view of a sub-mesh takes its layer costs from the (n, 1) view (one ILP for both): each
    equals the ILP solved on that view itself, for every method that treats the axes alike; Megatron's
    restriction is axis-specific (batch on axis 0) and 2-D views are not lines, so those are solved apart."""
    from alpa_lab.passes.methods import AXIS_SYMMETRIC_METHODS

    ex = tiny_example(model)
    cluster = al.ClusterSpec.local(2, 4)
    graph = al.parallelize(ex.train_step, cluster=cluster, microbatches=2, layers=2).trace(*ex.args)
    problem = PipelineProblem.build(graph, cluster)
    reps = sorted({problem.layer_keys.index(k) for k in problem.layer_keys})
    checked = 0
    for submesh in [(1, 2), (1, 4), (2, 4)]:
        n = submesh[0] * submesh[1]
        assert problem.transposed_twin(submesh, (1, n), "megatron") is None
        assert problem.transposed_twin(submesh, (n, 1), "alpa") is None
        if n == 4:
            assert problem.transposed_twin(submesh, (2, 2), "alpa") is None
        for method in AXIS_SYMMETRIC_METHODS:
            assert problem.transposed_twin(submesh, (1, n), method) == (n, 1)
            for layer in reps:
                own = problem._solve_layer(layer, submesh, (1, n), method)  # no twin: its own ILP
                twin = problem._solve_layer(layer, submesh, (n, 1), method)
                shared = problem.layer_cost(layer, submesh, (1, n), method)
                assert (own is None) == (twin is None) == (shared is None), (submesh, method, layer)
                if own is None:
                    continue
                for got in (twin, shared):
                    assert got.time == pytest.approx(own.time, rel=1e-9), (submesh, method, layer)
                    assert got.weight_memory + got.activation_memory == pytest.approx(
                        own.weight_memory + own.activation_memory, rel=1e-9), (submesh, method, layer)
                checked += 1
    assert checked >= 3 * 2 * len(reps)  # some methods cannot apply to every layer (None on both views)


@pytest.mark.parametrize("name", ["mlp", "gpt"])
def test_the_kept_plans_timeline_is_its_stages_simulated_with_records(name):
    """The first candidate planned keeps its records (not simulated again at the end): whichever candidate is
    kept, its timeline is the simulation of its stages, record for record."""
    from alpa_lab.passes.pipeline import simulated_timeline

    ex = tiny_example(name)
    step = al.parallelize(ex.train_step, cluster=al.ClusterSpec.local(2, 2), microbatches=4, layers=4)
    graph = step.trace(*ex.args)
    for schedule in ("1f1b", "gpipe"):
        problem, results, timeline = plan_pipeline(graph, step.cluster, num_microbatches=4, schedule=schedule)
        assert timeline.records and timeline == simulated_timeline(problem, results, schedule, 4)


@pytest.mark.parametrize("schedule, logical_meshes, memory", [
    ("gpipe", "all", 1.2e6),  # the memory-saving layouts are offered on some ranges, some options hold no micro-batch
    ("1f1b", "single_node_model_parallel", 1.2e6),  # logical meshes outside the space answer nothing
    ("1f1b", "all", None),  # no memory pressure: every option unlimited by micro-batches but the activations'
])
def test_the_stage_options_profiled_over_whole_ranges_equal_those_asked_one_range_at_a_time(monkeypatch, schedule, logical_meshes, memory):
    """plan_pipeline's range_costs (every layer range of a mesh at once, on arrays) against its per-range stage_cost
    (the unoptimised path): the same options, times to the bit, limits, layouts, order and stats, for both DP tables."""
    from alpa_lab.passes import inter_op, pipeline

    compared = []

    def both(L, N, M, stage_cost, cache, space, range_costs):
        shapes = inter_op._shapes(N, M, space)
        slow_stats, fast_stats = {}, {}
        slow = inter_op._profile(stage_cost, L, shapes, slow_stats)
        fast = inter_op._profile(stage_cost, L, shapes, fast_stats, range_costs)
        assert list(fast) == list(slow) and slow_stats == fast_stats
        for key, options in slow.items():
            assert fast[key].options == options.options, key
        compared.append((slow, slow_stats))
        return inter_op.profile_stage_options(L, N, M, stage_cost, cache, space, range_costs)

    monkeypatch.setattr(pipeline, "profile_stage_options", both)
    ex = tiny_example("gpt")
    cluster = al.ClusterSpec.local(2, 4) if memory is None else dataclasses.replace(al.ClusterSpec.local(2, 4), device_memory=memory)
    graph = al.parallelize(ex.train_step, cluster=cluster, microbatches=8, layers=4).trace(*ex.args)
    plan_pipeline(graph, cluster, num_microbatches=8, schedule=schedule, logical_meshes=logical_meshes)
    assert len(compared) == 2  # with transfers, and eq. 2's table without
    (with_sends, stats), (plain, _) = compared
    options = [o for table in (with_sends, plain) for opts in table.values() for o in opts.options]
    assert any(a.time != b.time for k in plain for a, b in zip(with_sends[k].options, plain[k].options))
    if memory is not None:
        assert any(o.max_in_flight is not None for o in options)
    if schedule == "gpipe":
        assert {"megatron", "zero3"} & {o.variant for o in options} and stats["no_memory"] > 0


def test_stages_whose_update_runs_in_name_order_are_twins():
    """An optimizer updates the parameters in their pytree order, which sorts names as strings (Block_10 before
    Block_9), and the gradient markers come in that order too: a stage of blocks 8-10 then wrote its update
    10, 8, 9 where blocks 2-4 wrote 2, 3, 4, and its plan was solved again (GPT-39B: stage 9-11, 0.27 s). The
    stage's program takes those ops layer by layer; oracle: its problem built and solved afresh."""
    from alpa_lab.models import gpt_config, make_gpt
    from alpa_lab.passes.stages import APPLY

    ex = make_gpt(gpt_config(layers=12, hidden=64, heads=4, batch=8, seq_len=16, vocab=128), abstract=True)
    graph, _ = trace_microbatched(ex.train_step, ex.args, 2, 12)
    problem = PipelineProblem.build(graph, al.ClusterSpec.local(1, 4))
    assert len(set(problem.layer_keys[2:11])) == 1
    slicing = problem.slicing
    update = [i for i in slicing.ops_of(range(8, 11)) if slicing.phase[i] == APPLY]
    assert [slicing.layer[i] for i in update] != sorted(slicing.layer[i] for i in update)  # the case: name order
    piece = problem.piece((8, 11)).graph
    made = set()
    for op in piece.ops:  # an order the ops can run in
        assert all(piece.vars[v].producer is None or v in made for v in op.inputs), op.name
        made.update(op.outputs)
    assert sorted(op.name for op in piece.ops) == sorted(graph.ops[i].name for i in slicing.ops_of(range(8, 11)))
    with pytest.raises(ValueError, match="reads a tensor this piece computes after it"):  # an order that cannot run
        subgraph(graph, list(reversed(slicing.ops_of(range(8, 11)))), ordered=True)
    first = problem.stage_graph((2, 5), (1, 2), (1, 2), (0, 1))
    twin = problem.stage_graph((8, 11), (1, 2), (1, 2), (2, 3))
    assert twin.cost_graph is first.cost_graph  # renamed, not built
    fresh = build_strategy_graph(piece, twin.mesh, argument_kinds=problem.piece_kinds(problem.piece((8, 11))))
    assert node_fields(twin) == node_fields(fresh)
    assert solve_strategy_graph(twin).objective == pytest.approx(solve_strategy_graph(fresh).objective, rel=1e-12)


def test_stage_specs_are_the_same_from_the_planned_pieces_and_from_pieces_cut_again():
    """A stage's program takes its update layer by layer (``_by_layer``), so its arguments come in another order
    than in a piece cut again in program order (Adam's moments: mu of every layer then nu, against mu and nu layer
    by layer), as the Ray runtime's transfers cut them (``runtime.program``: no pieces given). Each argument's spec
    is matched by its path, not its position: the same specs either way."""
    from alpa_lab.passes.pipeline import stage_tensor_specs
    from alpa_lab.passes.transfers import stage_transfers

    ex = tiny_example("gpt")
    step = al.parallelize(ex.train_step, cluster=al.ClusterSpec.local(1, 4), microbatches=2, layers=4)
    plan = step.plan(*ex.args).pin_stages([[0, 1], [2, 3]], submeshes=[(1, 2), (1, 2)])
    problem = plan.problem
    pieces = [problem.piece(st.layers) for st in plan.stages]
    again = [subgraph(problem.graph, problem.slicing.ops_of(range(*st.layers))) for st in plan.stages]
    assert any(a.invars != b.invars for a, b in zip(pieces, again))  # the case: another order of the same arguments
    assert all(sorted(a.invars) == sorted(b.invars) for a, b in zip(pieces, again))
    planned = stage_tensor_specs(problem.graph, problem.slicing, plan.stages, pieces)
    assert stage_tensor_specs(problem.graph, problem.slicing, plan.stages) == planned
    for st, piece, specs in zip(plan.stages, pieces, planned):  # oracle: the stage plan's own input, by position
        for v, t in zip(piece.invars, st.plan.inputs):
            assert specs[v] == t.spec
    a = stage_transfers(problem.graph, problem.slicing, plan.stages, pieces=pieces)
    b = stage_transfers(problem.graph, problem.slicing, plan.stages)
    assert a == b and a  # the cross-mesh moves (each tensor's source and destination specs) alike


def test_single_node_model_parallel_keeps_the_data_parallel_axes_that_split_the_microbatch():
    """Alpa's "single_node_model_parallel" space per sub-mesh: (n / k, k) with k inside a host and n / k dividing
    the micro-batch, and the sub-mesh's own shape. Oracle: that rule written out over every view; the DP then
    prices no other mesh (a transposed twin of one aside) and its stages stay in the space. With one sequence per
    micro-batch, GPT-39B on 64 devices prices 7 meshes per layer instead of 19."""
    from alpa_lab.passes.inter_op import logical_shapes
    from alpa_lab.passes.pipeline import in_logical_space
    from alpa_lab.passes.submesh import submesh_shapes

    space = "single_node_model_parallel"
    assert in_logical_space(space, (1, 8), (1, 8), 8, 1) and in_logical_space(space, (2, 8), (2, 8), 8, 1)
    assert not in_logical_space(space, (1, 8), (2, 4), 8, 1) and in_logical_space(space, (1, 8), (2, 4), 8, 2)
    assert not in_logical_space(space, (1, 8), (4, 2), 8, 2) and in_logical_space(space, (1, 8), (4, 2), 8, None)
    assert not in_logical_space(space, (2, 8), (1, 16), 8, None)  # the model-parallel axis spans hosts

    def rule(submesh, logical, batch, per_host):
        return logical == submesh or (per_host % logical[1] == 0 and batch % logical[0] == 0)

    views = [(s, lg) for s in submesh_shapes(2, 4, "all") for lg in logical_shapes(s)]
    for batch in (1, 2, 4):
        assert [in_logical_space(space, s, lg, 4, batch) for s, lg in views] == [rule(s, lg, batch, 4) for s, lg in views]
    ex = tiny_example("gpt")  # a batch of 8
    cluster = al.ClusterSpec.local(2, 4)
    graph, _ = trace_microbatched(ex.train_step, ex.args, 8, 4)  # micro-batches of one sequence
    problem, stages, _ = plan_pipeline(graph, cluster, num_microbatches=8, schedule="1f1b", logical_meshes=space)
    assert problem.microbatch_size() == 1
    allowed = {(s, lg) for s, lg in views if rule(s, lg, 1, 4)}
    twins = {(s, (lg[1], lg[0])) for s, lg in allowed if lg[0] == 1}  # a (1, n) view is priced as its (n, 1) twin
    priced = {(key[1], key[2]) for key in problem.layer_costs}
    assert priced <= allowed | twins and ((1, 4), (2, 2)) not in priced and ((2, 4), (2, 4)) in priced
    assert all((st.submesh_shape, st.logical_shape) in allowed for st in stages)


def test_the_microbatch_size_is_read_from_the_arguments_cut_into_microbatches():
    """A step returning reduced gradients, not a new state: every argument looks like data, and the weights (leading
    128) outnumber the batch (8 rows, 4 per micro-batch; named, as such a step needs), so a vote over the data leaves
    says 128. The size the logical mesh space reads is the cut arguments'. Oracle: the batch's own shape over the
    micro-batches."""
    keys = jax.random.split(jax.random.PRNGKey(0), 3)
    params = {f"w{i}": jax.random.normal(k, (128, 128)) / 12 for i, k in enumerate(keys)}
    batch = {"x": jnp.ones((8, 128)), "y": jnp.zeros((8, 128))}

    def grad_step(params, batch):
        def loss(p, x, y):
            for i in range(3):
                x = jnp.tanh(x @ p[f"w{i}"])
            return jnp.mean((x - y) ** 2)

        grads = al.grad(loss)(params, batch["x"], batch["y"])
        return [grads[f"w{i}"].sum(axis=0) for i in range(3)]  # not the shape of any argument: nothing is state

    step = al.parallelize(grad_step, cluster=al.ClusterSpec.local(1, 4), microbatches=2, layers=3, batch_argnums=(1,),
                          logical_meshes="single_node_model_parallel")
    plan = step.plan(params, batch)
    problem = plan.problem
    assert sorted(plan.split_inputs) == ["[1]['x']", "[1]['y']"]
    cut = {v for v, path in zip(problem.graph.invars, problem.graph.in_paths) if path.startswith("[1]")}
    assert problem.split_vars == cut and problem.microbatch_size() == 4
    assert dataclasses.replace(problem, batch_vars=None).microbatch_size() == 4  # the cut, named or not
    assert PipelineProblem.build(problem.graph, problem.cluster).microbatch_size() == 128  # the vote, not told the cut
