"""The collectives XLA compiles agree with the ones the plan predicts.

Counting rule (``plan.count_hlo_collectives``): XLA's all-reduce combiner merges the
independent gradient all-reduces into one tuple-shaped all-reduce, so collectives are
counted per operand; a tensor resharded for several consumers is resharded once (CSE), so
the plan counts one resharding per (tensor, target spec).
"""

import pytest

import alpa_lab as al
from alpa_lab.models import MLPConfig, make_mlp
from alpa_lab.plan import count_hlo_collectives

CLUSTER = al.ClusterSpec.local(1, 4)


def predicted_and_compiled(ex, mesh_shape, method="alpa"):
    step = al.parallelize(ex.train_step, cluster=CLUSTER, mesh_shape=mesh_shape, method=method)
    plan = step.plan(*ex.args)
    return plan.compare_collectives(step.compiled_hlo(*ex.args))


def test_count_hlo_collectives_counts_combined_operands():
    hlo = """
  %all-reduce.7 = (f32[128]{0}, f32[64]{0}) all-reduce(%a.1, %dot.5), channel_id=1, replica_groups={{0,1}}, to_apply=%add
  %all-gather = f32[8,64]{1,0} all-gather(%b), channel_id=2, dimensions={0}
  %ag-start = (f32[4]{0}, f32[8]{0}) all-gather-start(%c), dimensions={0}
  %ag-done = f32[8]{0} all-gather-done(%ag-start)
"""
    assert count_hlo_collectives(hlo) == {"all-reduce": 2, "all-gather": 2}


@pytest.mark.parametrize(
    "config, expected",
    [
        # data parallel: gradient all-reduces only (and the loss's), combined by XLA into one
        (MLPConfig(batch=2048, in_dim=64, hidden=128, layers=2, out_dim=64), None),
        # Megatron: the row-parallel layer's all-reduce, plus the backward's gathers
        (MLPConfig(batch=8, in_dim=64, hidden=4096, layers=1, out_dim=64), None),
    ],
    ids=["data-parallel", "megatron"],
)
def test_mlp_collectives_match_exactly(config, expected):
    cmp = predicted_and_compiled(make_mlp(config), (1, 4))
    assert dict(cmp.predicted) == dict(cmp.compiled), str(cmp)
    assert sum(cmp.predicted.values()) > 0


@pytest.mark.parametrize("method", ["data_parallel", "megatron", "zero3"])
def test_methods_collective_kinds_match(method):
    ex = make_mlp(MLPConfig(batch=64, in_dim=64, hidden=256, layers=2, out_dim=64))
    cmp = predicted_and_compiled(ex, (1, 4), method=method)
    # XLA's CPU backend has no reduce-scatter: it lowers one as all-reduce + dynamic-slice.
    # XLA reshards some tensors with all-to-all or collective-permute where we price an
    # all-gather then a slice (see tests/test_resharding.py), so those counts may differ;
    # a reduction (all-reduce) XLA compiled must be one the plan predicted.
    reductions = cmp.predicted.get("all-reduce", 0) + cmp.predicted.get("reduce-scatter", 0)
    assert 0 < cmp.compiled.get("all-reduce", 0) <= reductions, str(cmp)
    assert "reduce-scatter" not in cmp.compiled


@pytest.mark.parametrize("shape,split,mesh_shape", [((16, 8), "S1R", (1, 4)), ((8, 16), "RS1", (1, 4)), ((16, 6), "S01R", (2, 2))])
def test_update_gathers_are_one_all_gather_with_the_same_values(shape, split, mesh_shape):
    """Three tensors made split along one dimension (either one, over one or both mesh axes), each read whole by an
    op that makes a result (a new weight): one all-gather in XLA's HLO for all three (one each before), and the
    results equal the program run unsharded."""
    import jax.numpy as jnp
    import numpy as np

    from alpa_lab.graph.trace import trace
    from alpa_lab.sharding.constraints import compile_graph, device_mesh
    from alpa_lab.sharding.spec import ShardingSpec

    def update(w1, w2, w3, g1, g2, g3):
        return w1 + 0.1 * g1 * g1, w2 - 0.5 * jnp.tanh(g2), w3 + jnp.sqrt(g3 * g3 + 1.0)

    rng = np.random.default_rng(0)
    args = [jnp.asarray(rng.standard_normal(shape), dtype=jnp.float32) for _ in range(6)]
    graph = trace(update, *args)
    whole = "R" * len(shape)
    spec = ShardingSpec.parse(split)
    plans = {}
    for op in graph.ops:  # the delta computed split (as a sharded update does), the new weight whole
        makes_result = all(v in graph.outvars for v in op.outputs)
        ins = tuple(whole if makes_result else str(spec) if len(graph.vars[v].shape) else "-" for v in op.inputs)
        outs = tuple(whole if makes_result else str(spec) for _ in op.outputs)
        plans[op.name] = type("P", (), {"input_specs": ins, "output_specs": outs})()
    mesh = device_mesh(mesh_shape, list(range(mesh_shape[0] * mesh_shape[1])))
    fn, _, _ = compile_graph(graph, plans, [whole] * 6, [whole] * 3, mesh)
    hlo = fn.lower(*args).compile().as_text()
    assert al.count_communication_primitives(hlo)[2] == 1, hlo
    for got, want in zip(fn(*args), update(*args)):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-6)


def test_gathers_of_tensors_that_are_not_new_state_are_left_alone():
    """The same program returning its results under other paths than its arguments' (not an updated train state:
    a pipeline task's tensors for other tasks): one all-gather each, as XLA makes them."""
    import jax.numpy as jnp
    import numpy as np

    from alpa_lab.graph.trace import trace
    from alpa_lab.sharding.constraints import compile_graph, device_mesh

    def not_an_update(w1, w2, w3, g1, g2, g3):
        return {"a": w1 + 0.1 * g1 * g1, "b": w2 - 0.5 * jnp.tanh(g2), "c": w3 + jnp.sqrt(g3 * g3 + 1.0)}

    args = [jnp.asarray(np.random.default_rng(1).standard_normal((16, 8)), dtype=jnp.float32) for _ in range(6)]
    graph = trace(not_an_update, *args)
    plans = {}
    for op in graph.ops:  # as in the update above: the deltas split, the results whole
        makes_result = all(v in graph.outvars for v in op.outputs)
        ins = tuple("RR" if makes_result else "S1R" if len(graph.vars[v].shape) else "-" for v in op.inputs)
        plans[op.name] = type("P", (), {"input_specs": ins, "output_specs": tuple("RR" if makes_result else "S1R" for _ in op.outputs)})()
    fn, _, _ = compile_graph(graph, plans, ["RR"] * 6, ["RR"] * 3, device_mesh((1, 4), [0, 1, 2, 3]))
    assert al.count_communication_primitives(fn.lower(*args).compile().as_text())[2] == 3


def test_a_pipelined_zero3_forward_keeps_its_weight_gathers_apart(monkeypatch):
    """ZeRO-3 in a pipeline: each forward task gathers its weights one by one for the layers that use them (the
    point of ZeRO-3); the update's combiner does not touch them. Oracle: the unit tasks compiled without it."""
    import alpa_lab.sharding.constraints as constraints
    from alpa_lab.models import tiny_example

    ex = tiny_example("gpt")

    def counts():
        step = al.parallelize(ex.train_step, cluster=al.ClusterSpec.local(2, 2), microbatches=2, layers=2, method="zero3")
        return [al.count_communication_primitives(t) for t in step.get_executable(*ex.args).get_hlo_text()]

    combined = counts()
    monkeypatch.setattr(constraints, "_combined_gathers", lambda graph, *a: (graph, constraints._Gathers({}, (), -1)))
    apart = counts()
    assert combined[:4] == apart[:4], (combined, apart)  # forward and backward tasks
    assert sum(c[2] for c in apart[:2]) >= 4, apart  # the forwards gather weights
