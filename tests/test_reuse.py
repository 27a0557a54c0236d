"""Repeated-block reuse (TAP): identical blocks share one strategy choice per op."""

import re
from collections import defaultdict

import pytest

import alpa_lab as al
from alpa_lab.models import GPTConfig, make_gpt
from alpa_lab.passes.intra_op import build_strategy_graph, solve_strategy_graph

CLUSTER = al.ClusterSpec.local(1, 4)


def gpt_graph(layers):
    ex = make_gpt(GPTConfig(layers=layers), abstract=True)
    return al.trace(ex.train_step, *ex.args)


def test_ilp_size_does_not_grow_with_depth():
    mesh = CLUSTER.logical_mesh((2, 2))
    sizes = {n: len(build_strategy_graph(gpt_graph(n), mesh).cost_graph.node_costs) for n in (2, 4, 8)}
    untied = len(build_strategy_graph(gpt_graph(8), mesh, reuse_repeated_blocks=False).cost_graph.node_costs)
    assert sizes[2] == sizes[4] == sizes[8], sizes  # one layer's variables, however deep
    assert sizes[8] * 4 < untied


def test_repeats_share_strategies_and_lose_little():
    graph = gpt_graph(4)
    mesh = CLUSTER.logical_mesh((1, 4))
    tied = build_strategy_graph(graph, mesh)
    free = build_strategy_graph(graph, mesh, reuse_repeated_blocks=False)
    t, f = solve_strategy_graph(tied), solve_strategy_graph(free)
    # a restriction of the same problem: never better, and here no worse than 1%
    assert t.objective >= f.objective - 1e-12
    assert t.objective <= f.objective * 1.01
    chosen = defaultdict(set)
    rank = defaultdict(int)
    for n, node in enumerate(tied.nodes):
        if node.op_index is not None and "Block_" in node.label:
            op_key = id(node.strategies)  # equal ops share one strategy tuple
            k = rank[(node.label, op_key)]
            rank[(node.label, op_key)] += 1
            role = (re.sub(r"\d+", "#", node.label), op_key, k)
            chosen[role].add(node.strategies[t.choice[n]].name)
    assert chosen and all(len(v) == 1 for v in chosen.values() if v), {k: v for k, v in chosen.items() if len(v) > 1}


def test_pin_in_a_block_applies_to_every_repeat():
    ex = make_gpt(GPTConfig(layers=3), abstract=True)
    step = al.parallelize(ex.train_step, cluster=CLUSTER, mesh_shape=(1, 4))
    plan = step.plan(*ex.args)
    dots = [o for o in plan.ops if o.primitive == "dot_general" and "Block_0/MLPBlock_0" in o.label and o.label.startswith("jvp(")]
    target = dots[0]
    alt = next(a.strategy for a in plan.explain(target.name).alternatives if not a.chosen)
    pinned = plan.pin(target.name, alt)
    twins = [o for o in pinned.ops if o.primitive == "dot_general" and o.label == target.label.replace("/Block_0/", "/Block_2/")]
    assert pinned.op(target.name).strategy == alt
    assert twins and twins[0].strategy == alt
    with pytest.raises(al.PinError, match="cannot hold together"):
        pinned.pin(twins[0].name, plan.op(target.name).strategy)
