"""Alpa's method objects (``ShardParallel``, ``PipeshardParallel``, ...) as ``parallelize(method=...)`` takes them.

Oracles: each method's numbers equal plain ``jax.jit``'s (rtol 1e-4 / atol 1e-5, as ``test_pipeline``);
each means exactly the ``parallelize`` options it says (the same plan as those options spelled out);
the uniform stage option's layer grouping equals brute force over every grouping; Alpa's own
defaults (uniform stages for ``PipeshardParallel``, one layer per boundary with ``layer_option="manual"``)
hold; what this planner cannot do is refused by name.
"""

from __future__ import annotations

import itertools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.training import train_state

import alpa_lab as al
from alpa_lab.models import tiny_example
from alpa_lab.parallel_method import balanced_ranges

RTOL, ATOL = 1e-4, 1e-5


@pytest.fixture(scope="module")
def mlp():
    return tiny_example("mlp")


@pytest.fixture(scope="module")
def cluster():
    return al.ClusterSpec.local(2, 4, calibrated=False)


def close_to_jit(step, ex) -> None:
    want = jax.jit(ex.train_step)(ex.state, ex.batch)
    got = step(ex.state, ex.batch)
    for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("method, name", [
    (al.ShardParallel(), "alpa"),
    (al.DataParallel(), "data_parallel"),
    (al.Zero2Parallel(), "zero2"),
    (al.Zero3Parallel(), "zero3"),
    (al.ShardParallel(auto_sharding_option=al.AutoShardingOption(force_data_parallel=True)), "data_parallel"),
    (al.ShardParallel(auto_sharding_option=al.AutoShardingOption(force_data_parallel=True, prefer_reduce_scatter=True)), "zero2"),
])
def test_shard_methods_are_this_planners_methods(mlp, cluster, method, name):
    step = al.parallelize(mlp.train_step, cluster=cluster, method=method)
    plan = step.plan(*mlp.args)
    spelled = al.parallelize(mlp.train_step, cluster=cluster, method=name).plan(*mlp.args)
    assert step.method == plan.method == name and not step.pipelined
    assert plan.objective == pytest.approx(spelled.objective, rel=1e-12)
    close_to_jit(step, mlp)


def test_shard_parallel_with_micro_batches_accumulates_on_one_mesh(mlp, cluster):
    """Alpa's ``ShardParallel(num_micro_batches=k)``: gradient accumulation, no pipeline: one stage of every layer
    on every device."""
    step = al.parallelize(mlp.train_step, cluster=cluster, method=al.ShardParallel(num_micro_batches=2))
    plan = step.plan(*mlp.args)
    assert plan.num_microbatches == 2 and plan.stage_pins
    assert [(st.layers, st.submesh_shape) for st in plan.stages] == [((0, plan.num_layers), (2, 4))]
    close_to_jit(step, mlp)


def test_auto_stages_are_the_dp_over_alpas_spaces(mlp, cluster):
    method = al.PipeshardParallel(num_micro_batches=4, layer_option=al.AutoLayerOption(layer_num=4), stage_option="auto")
    step = al.parallelize(mlp.train_step, cluster=cluster, method=method)
    plan = step.plan(*mlp.args)
    spelled = al.parallelize(mlp.train_step, cluster=cluster, microbatches=4, layers=4, submesh_space="power_of_two",
                             logical_meshes="single_node_model_parallel").plan(*mlp.args)
    assert (step.microbatches, step.layers, step.schedule, step.submesh_space, step.logical_meshes) == (
        4, 4, "1f1b", "power_of_two", "single_node_model_parallel")
    assert [(st.layers, st.submesh_shape, st.logical_shape) for st in plan.stages] == [
        (st.layers, st.submesh_shape, st.logical_shape) for st in spelled.stages]
    assert not plan.stage_pins
    close_to_jit(step, mlp)


def test_pipeshard_defaults_to_uniform_stages_one_per_layer(mlp, cluster):
    """Alpa's default stage option: one stage per layer, each on devices / layers devices."""
    step = al.parallelize(mlp.train_step, cluster=cluster,
                          method=al.PipeshardParallel(num_micro_batches=4, layer_option=al.AutoLayerOption(layer_num=4)))
    plan = step.plan(*mlp.args)
    assert [(st.layers, st.submesh_shape) for st in plan.stages] == [((i, i + 1), (1, 2)) for i in range(4)]
    assert plan.stage_pins
    close_to_jit(step, mlp)
    # unpinned, the DP chooses again (the plan is an ordinary pinned plan)
    assert not plan.unpin_stages().stage_pins


def test_manual_stages_are_placed_as_given(mlp, cluster):
    method = al.ManualPipeshardParallel(
        forward_stage_layer_ids=[[0, 1, 2], [3]], submesh_physical_shapes=[(1, 4), (1, 4)],
        submesh_logical_shapes=[(2, 2), (4, 1)], submesh_autosharding_option_dicts=[{}, {"force_batch_dim_to_mesh_dim": 0}],
        num_micro_batches=4, pipeline_schedule="gpipe")
    step = al.parallelize(mlp.train_step, cluster=cluster, method=method, layers=4)
    plan = step.plan(*mlp.args)
    assert plan.schedule == "gpipe" and plan.stage_pins
    assert [(st.layers, st.submesh_shape, st.logical_shape) for st in plan.stages] == [
        ((0, 3), (1, 4), (2, 2)), ((3, 4), (1, 4), (4, 1))]
    close_to_jit(step, mlp)


class Boundaried(nn.Module):
    @nn.compact
    def __call__(self, x):
        for i in range(4):
            if i:
                al.mark_pipeline_boundary()
            x = nn.relu(nn.Dense(16)(x))
        return nn.Dense(4)(x)


def test_alpas_manual_layering_test_pattern():
    """As Alpa's own pipeline tests write it: boundaries in the model, ``alpa.grad``, ``layer_option="manual"``,
    default (uniform) stages: 4 layers on 8 devices are 4 stages of 2."""
    model = Boundaried()
    x = jnp.asarray(np.random.default_rng(0).standard_normal((32, 8)), jnp.float32)
    y = jnp.asarray(np.random.default_rng(1).standard_normal((32, 4)), jnp.float32)
    state = train_state.TrainState.create(apply_fn=model.apply, params=model.init(jax.random.key(0), x)["params"],
                                          tx=optax.sgd(0.1))
    batch = {"x": x, "y": y}

    def train_step(state, batch):
        def loss_func(params):
            out = state.apply_fn({"params": params}, batch["x"])
            return jnp.mean((out - batch["y"]) ** 2)

        grads = al.grad(loss_func)(state.params)
        return state.apply_gradients(grads=grads)

    p_train_step = al.parallelize(train_step, cluster=al.ClusterSpec.local(2, 4, calibrated=False),
                                  method=al.PipeshardParallel(num_micro_batches=4, layer_option="manual"))
    got = p_train_step(state, batch)
    plan = p_train_step.current_plan
    assert [(st.layers, st.submesh_shape) for st in plan.stages] == [((i, i + 1), (1, 2)) for i in range(4)]

    def plain(state, batch):
        grads = jax.grad(lambda p: jnp.mean((state.apply_fn({"params": p}, batch["x"]) - batch["y"]) ** 2))(state.params)
        return state.apply_gradients(grads=grads)

    want = jax.jit(plain)(state, batch)
    for a, b in zip(jax.tree_util.tree_leaves(got.params), jax.tree_util.tree_leaves(want.params)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=RTOL, atol=ATOL)


def test_uniform_grouping_is_the_brute_force_optimum():
    """``balanced_ranges``: the least largest group sum over every contiguous grouping (brute force, exact)."""
    rng = np.random.default_rng(0)
    for _ in range(60):
        n = int(rng.integers(1, 8))
        parts = int(rng.integers(1, n + 1))
        costs = list(rng.integers(1, 20, n).astype(float))
        ranges = balanced_ranges(costs, parts)
        assert len(ranges) == parts and ranges[0][0] == 0 and ranges[-1][1] == n - 1
        assert all(b[0] == a[1] + 1 and a[0] <= a[1] for a, b in zip(ranges, ranges[1:]))
        got = max(sum(costs[a:b + 1]) for a, b in ranges)
        best = min(
            max(sum(costs[a:b]) for a, b in zip((0, *cuts), (*cuts, n)))
            for cuts in itertools.combinations(range(1, n), parts - 1)
        )
        assert got == best


def test_uniform_stages_balance_flops(mlp, cluster):
    step = al.parallelize(mlp.train_step, cluster=cluster, method=al.PipeshardParallel(
        num_micro_batches=4, layer_option=al.AutoLayerOption(layer_num=4), stage_option=al.UniformStageOption(num_stages=2)))
    plan = step.plan(*mlp.args)
    assert [st.submesh_shape for st in plan.stages] == [(1, 4), (1, 4)] and plan.num_stages == 2
    close_to_jit(step, mlp)


@pytest.mark.parametrize("space", ["same_as_physical", "data_parallel_only"])
def test_alpas_logical_mesh_spaces(mlp, cluster, space):
    step = al.parallelize(mlp.train_step, cluster=cluster, method=al.PipeshardParallel(
        num_micro_batches=4, layer_option=al.AutoLayerOption(layer_num=4),
        stage_option=al.AutoStageOption(submesh_logical_shape_space=space)))
    plan = step.plan(*mlp.args)
    for st in plan.stages:
        n = st.submesh_shape[0] * st.submesh_shape[1]
        assert st.logical_shape == (st.submesh_shape if space == "same_as_physical" else (n, 1))


@pytest.mark.parametrize("make, match", [
    (lambda: al.PipeshardParallel(num_micro_batches=4, pipeline_schedule="inference"), "plans training steps"),
    (lambda: al.PipeshardParallel(num_micro_batches=4, layer_option=al.AutoLayerOption(layer_num=2, remat_mode="fine_grained_remat")),
     "fine-grained remat is not supported"),
    (lambda: al.ShardParallel(devices=jax.devices()[:4]), r"devices=\.\.\.\) is not supported.*ClusterSpec.local"),
    (lambda: al.PipeshardParallel(stage_option=al.AutoStageOption(stage_imbalance_tolerance=0.25)), "stage_imbalance_tolerance"),
    (lambda: al.PipeshardParallel(stage_option=al.AutoStageOption(profiling_database_filename="prof.pkl")), "profiling files"),
    (lambda: al.ShardParallel(auto_sharding_option=al.AutoShardingOption(enable_auto_sharding=False)), "enable_auto_sharding"),
    (lambda: al.PipeshardParallel(stage_option="dp"), "stage_option must be"),
    (lambda: al.PipeshardParallel(layer_option="auto"), "layer_option must be"),
])
def test_what_the_planner_cannot_do_is_refused_by_name(mlp, cluster, make, match):
    with pytest.raises(ValueError, match=match):
        al.parallelize(mlp.train_step, cluster=cluster, method=make())


def test_bad_stage_options_say_what_is_wrong(mlp, cluster):
    with pytest.raises(ValueError, match=r"already says microbatches=4; you also passed microbatches=8"):
        al.parallelize(mlp.train_step, cluster=cluster, method=al.PipeshardParallel(num_micro_batches=4), microbatches=8)
    with pytest.raises(ValueError, match="in order, each once"):
        al.parallelize(mlp.train_step, cluster=cluster, layers=4, method=al.ManualPipeshardParallel(
            [[0, 2], [1, 3]], [(1, 4), (1, 4)], num_micro_batches=4)).plan(*mlp.args)
    with pytest.raises(ValueError, match="names 3 layers but the step has 4"):
        al.parallelize(mlp.train_step, cluster=cluster, layers=4, method=al.ManualPipeshardParallel(
            [[0, 1], [2]], [(1, 4), (1, 4)], num_micro_batches=4)).plan(*mlp.args)
    with pytest.raises(ValueError, match="2 stages but 1 sub-mesh shapes"):
        al.ManualStageOption([[0], [1]], [(1, 4)])
    with pytest.raises(ValueError, match=r"unknown per-stage auto-sharding option\(s\) \['force_everything'\]"):
        al.ManualStageOption([[0]], [(1, 4)], None, [{"force_everything": 1}])
    with pytest.raises(ValueError, match="8 devices do not split evenly over 3 stages"):
        al.parallelize(mlp.train_step, cluster=cluster, method=al.PipeshardParallel(
            num_micro_batches=4, layer_option=al.AutoLayerOption(layer_num=3))).plan(*mlp.args)
    with pytest.raises(ValueError, match="stage_option= fixes a pipeline's stages: give microbatches="):
        al.parallelize(mlp.train_step, cluster=cluster, stage_option=al.UniformStageOption())
    with pytest.raises(ValueError, match="unknown logical mesh space 'some'"):
        al.parallelize(mlp.train_step, cluster=cluster, microbatches=4, logical_meshes="some")
