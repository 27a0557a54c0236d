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


def _linear_stack(layers: int = 6, width: int = 1024, batch: int = 32):
    """The issue's case: a stack of identical ``nnx.Linear`` layers (one width), trained by plain SGD."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    class Stack(nnx.Module):
        def __init__(self, rngs: nnx.Rngs):
            self.layers = nnx.List([nnx.Linear(width, width, rngs=rngs) for _ in range(layers)])

        def __call__(self, x):
            for layer in self.layers:
                x = jax.nn.relu(layer(x))
            return x

    graphdef, params = nnx.split(Stack(nnx.Rngs(0)), nnx.Param)

    def train_step(params, x):
        def loss(p):
            return jnp.mean(nnx.merge(graphdef, p)(x) ** 2)

        value, grads = jax.value_and_grad(loss)(params)
        return jax.tree_util.tree_map(lambda a, b: a - 0.1 * b, params, grads), value

    x = jax.ShapeDtypeStruct((batch, width), jnp.float32)
    return train_step, (jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), params), x)


def test_tying_keeps_the_megatron_alternation_of_a_stack_of_identical_layers():
    """Tied every repeat alike, six equal linears must all split one way; the untied optimum alternates column/row splits.

    ``solve_tied`` also tries tying alternate repeats and keeps the cheaper: the untied optimum (0.1%).
    """
    from alpa_lab.passes.methods import solve_tied

    fn, args = _linear_stack()
    graph = al.trace(fn, *args)
    mesh = CLUSTER.logical_mesh((1, 4))
    every = solve_strategy_graph(build_strategy_graph(graph, mesh)).objective
    free = solve_strategy_graph(build_strategy_graph(graph, mesh, reuse_repeated_blocks=False)).objective
    sg, solved = solve_tied(lambda p: build_strategy_graph(graph, mesh, tie_period=p), "alpa")
    assert every > free * 1.05  # the restriction the issue found
    assert solved.solution.objective <= free * 1.001 and sg.tie_period == 2
    # through the public API: the plan alternates the kernels' splits, and says which tying it used
    plan = al.parallelize(fn, cluster=CLUSTER, mesh_shape=(1, 4)).plan(*args)
    assert plan.solver["tie_period"] == 2 and plan.objective <= free * 1.001
    kernels = [o.output_specs[0] for o in plan.ops if o.kind == "input" and "['kernel']" in o.name]
    assert len(kernels) == 6 and len(set(kernels)) == 2
    assert all(a != b for a, b in zip(kernels, kernels[1:])), kernels  # column, row, column, ... (in layer order)


@pytest.mark.parametrize("name", ["mlp", "gpt", "moe", "wide_resnet"])
def test_tied_equals_untied_on_the_example_models(name):
    """Stacks of identical MLPs, attention blocks, expert layers and conv blocks: tying loses nothing (0.1%)."""
    from alpa_lab.models import tiny_example
    from alpa_lab.passes.methods import solve_tied

    ex = tiny_example(name)
    graph = al.trace(ex.train_step, *ex.args)
    for shape in ((1, 4), (2, 2)):
        mesh = CLUSTER.logical_mesh(shape)
        free = solve_strategy_graph(build_strategy_graph(graph, mesh, reuse_repeated_blocks=False)).objective
        _, solved = solve_tied(lambda p: build_strategy_graph(graph, mesh, tie_period=p), "alpa")
        tied = solved.solution.objective
        assert tied >= free * (1 - 1e-9) - 1e-15 and tied <= free * 1.001, (name, shape, tied, free)


def test_the_check_of_alternate_tying_costs_at_most_the_solve_it_checks_and_never_loses(monkeypatch):
    """``solve_tied``'s second period is a check on the first: its ILPs are given as long as the first period took
    (floor ``TIE_CHECK_MIN_SECONDS``), and what it finds is kept only where it does better. Oracles: the time limits
    CBC is given (the first period's measured seconds, with the floor at 0); the tied ILP's own optimum, which the
    result never exceeds; with no time at all for either, the tied plan CBC stops with."""
    import time

    from alpa_lab.passes import methods

    fn, args = _linear_stack()
    graph = al.trace(fn, *args)
    mesh = CLUSTER.logical_mesh((1, 4))
    real = methods.solve_strategy_graph
    calls = []

    def timed(sg, pins=None, **kw):
        t0 = time.perf_counter()
        try:
            return real(sg, pins, **kw)
        finally:
            calls.append((sg.tie_period, kw["time_limit"], time.perf_counter() - t0))

    monkeypatch.setattr(methods, "solve_strategy_graph", timed)
    monkeypatch.setattr(methods, "TIE_CHECK_MIN_SECONDS", 0.0)
    sg, solved = methods.solve_tied(lambda p: build_strategy_graph(graph, mesh, tie_period=p), "alpa")
    first = [c for c in calls if c[0] == 1]
    second = [c for c in calls if c[0] == 2]
    assert all(limit == methods.ILP_TIME_LIMIT for _, limit, _ in first)
    assert second and all(sum(s for *_, s in first) <= limit <= sum(s for *_, s in first) + 0.5 for _, limit, _ in second)
    tied = solve_strategy_graph(build_strategy_graph(graph, mesh, tie_period=1)).objective
    assert solved.solution.objective <= tied * (1 + 1e-9)  # kept only where better (with the floor, it finds `free`:
    # test_tying_keeps_the_megatron_alternation_of_a_stack_of_identical_layers)
    # a check with no time (CBC stops at once, with a heuristic's plan at best): the tied plan stands, never a worse one
    # (what CBC finds in 1 ms depends on this machine's load: the oracle is the tied period's own result in this call)
    calls.clear()
    periods = []
    real_method = methods.solve_method

    def recorded(sg, *a, **kw):
        out = real_method(sg, *a, **kw)
        periods.append((sg.tie_period, out.solution.objective))
        return out

    monkeypatch.setattr(methods, "solve_method", recorded)
    monkeypatch.setattr(methods, "ILP_TIME_LIMIT", 1e-3)
    sg, solved = methods.solve_tied(lambda p: build_strategy_graph(graph, mesh, tie_period=p), "alpa")
    assert [limit for _, limit, _ in calls] and all(limit <= 1e-3 for _, limit, _ in calls)
    assert [p for p, _ in periods] == [1, 2]
    assert solved.solution.objective in [o for _, o in periods] and solved.solution.objective <= periods[0][1]


def test_blocks_crossed_by_earlier_statistics_are_one_kind_of_layer_and_cost_what_each_costs_alone():
    """Each layer of a Wide-ResNet is crossed by the batch-norm statistics of every block before it (made there,
    returned at the end), so block k's layer has markers for k blocks' statistics. Markers compile to nothing: the
    blocks of a stage are one kind of layer, priced once. Oracle: every layer priced from its own program (each
    its own kind), on 2x2 and 1x4 views of four devices, equal to its kind's cost to the last bit."""
    from alpa_lab.api import trace_microbatched
    from alpa_lab.models import make_wide_resnet, wide_resnet_config
    from alpa_lab.passes.pipeline import PipelineProblem

    ex = make_wide_resnet(wide_resnet_config(batch=16, image_size=32, blocks=3, stages=2, base_width=8), abstract=True)
    graph, _ = trace_microbatched(ex.train_step, ex.args, 2, 6)
    shared = PipelineProblem.build(graph, CLUSTER)
    own = PipelineProblem.build(graph, CLUSTER)
    own.layer_keys = tuple(range(own.slicing.num_layers))  # every layer priced from its own program
    kinds = defaultdict(list)
    for lay, key in enumerate(shared.layer_keys):
        kinds[key].append(lay)
    assert sorted(kinds.values()) == [[0], [1, 2], [3], [4], [5]], kinds  # the first block of a stage differs
    crossed = [sum(op.primitive == "pipeline_marker" for op in own.piece((lay, lay + 1)).graph.ops) for lay in (1, 2)]
    assert crossed[0] < crossed[1], crossed  # the two do differ: more statistics cross the later one
    for submesh, logical in (((1, 4), (2, 2)), ((1, 4), (1, 4))):
        for lay in range(own.slicing.num_layers):
            assert shared.layer_cost(lay, submesh, logical) == own.layer_cost(lay, submesh, logical), (lay, logical)
