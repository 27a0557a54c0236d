"""Classic parallelization strategies emerge from the ILP without being written in.

Nothing in the planner knows the words "data parallel" or "Megatron": these are the optima
of the cost model for the shapes that make them optimal in practice (Alpa paper, sec. 4).
"""

import pytest

import alpa_lab as al
from alpa_lab.models import MLPConfig, make_mlp

CLUSTER = al.ClusterSpec.local(1, 4)


def plan_for(ex, mesh_shape=(1, 4)):
    return al.parallelize(ex.train_step, cluster=CLUSTER, mesh_shape=mesh_shape).plan(*ex.args)


def forward_dots(plan):
    return [o for o in plan.ops if o.primitive == "dot_general" and o.label.startswith("jvp(")]


def test_wide_batch_mlp_becomes_data_parallel():
    ex = make_mlp(MLPConfig(batch=2048, in_dim=64, hidden=128, layers=2, out_dim=64))
    plan = plan_for(ex)
    inputs = {t.path: t.spec for t in plan.inputs}
    # the batch is split along its first axis over the 4 devices
    assert inputs["[1]['x']"] == "S1R" and inputs["[1]['y']"] == "S1R"
    # every forward matmul splits the batch and keeps the weight whole: no forward collective
    for dot in forward_dots(plan):
        assert dot.strategy == "S1R = S1R x RR", (dot.name, dot.strategy)
        assert not dot.collectives
    # each weight gradient is summed over the data-parallel devices
    weight_grads = [o for o in plan.ops if o.primitive == "dot_general" and o.collectives]
    assert len(weight_grads) == 3
    assert all(c.kind in ("all-reduce", "reduce-scatter") for o in weight_grads for c in o.collectives)


def test_narrow_batch_wide_hidden_mlp_becomes_megatron():
    ex = make_mlp(MLPConfig(batch=8, in_dim=64, hidden=4096, layers=1, out_dim=64))
    plan = plan_for(ex)
    first, second = forward_dots(plan)
    # column-parallel first layer, row-parallel second: one all-reduce per layer pair
    assert first.strategy == "RS1 = RR x RS1" and not first.collectives
    assert second.strategy == "RR = RS1 x S1R"
    assert [c.kind for c in second.collectives] == ["all-reduce"]
    inputs = {t.path: t.spec for t in plan.inputs}
    assert inputs["[0].params['Dense_0']['kernel']"] == "RS1"
    assert inputs["[0].params['Dense_1']['kernel']"] == "S1R"


@pytest.mark.parametrize("mesh_shape", [(1, 4), (2, 2)])
def test_moe_layer_shards_experts_with_all_to_all(mesh_shape):
    from alpa_lab.models import MoEConfig, make_moe

    # experts large enough that syncing their gradients (data parallel) costs more than
    # moving tokens to them (the regime MoE layers are built for); shapes only, no arrays
    config = MoEConfig(batch=32, seq_len=64, hidden=128, experts=8, expert_hidden=2048, layers=1, vocab=128)
    ex = make_moe(config, abstract=True)
    plan = plan_for(ex, mesh_shape)
    experts = ex.config.experts
    # the expert FFN weights [E, M, H] are split along the expert axis
    expert_weights = [t for t in plan.inputs if t.path.startswith("[0].params") and t.shape and t.shape[0] == experts and len(t.shape) == 3]
    assert expert_weights
    for t in expert_weights:
        assert al.ShardingSpec.parse(t.spec).dims[0], (t.path, t.spec)
    # and tokens reach their experts through all-to-all
    assert plan.predicted_collectives()["all-to-all"] >= 2
