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
from alpa_lab.parallel_method import MethodOptionError, balanced_ranges

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
    assert (step.microbatches, step.layers, step.schedule, step.submesh_space, step.logical_meshes, step.remat) == (
        4, 4, "1f1b", "power_of_two", "single_node_model_parallel", False)
    assert [(st.layers, st.submesh_shape, st.logical_shape) for st in plan.stages] == [
        (st.layers, st.submesh_shape, st.logical_shape) for st in spelled.stages]
    assert not plan.stage_pins
    close_to_jit(step, mlp)


def stages_of(plan) -> list:
    return [(st.layers, st.submesh_shape, st.logical_shape) for st in plan.stages]


@pytest.mark.parametrize("stage_option", [None, "uniform", al.UniformStageOption()])
def test_pipeshard_defaults_to_uniform_stages_one_per_layer(mlp, cluster, stage_option):
    """Alpa's default stage option: one stage per layer, each on devices / layers devices viewed as its own shape."""
    step = al.parallelize(mlp.train_step, cluster=cluster, method=al.PipeshardParallel(
        num_micro_batches=4, layer_option=al.AutoLayerOption(layer_num=4), stage_option=stage_option))
    plan = step.plan(*mlp.args)
    assert stages_of(plan) == [((i, i + 1), (1, 2), (1, 2)) for i in range(4)]
    assert plan.stage_pins
    close_to_jit(step, mlp)
    # unpinned, the DP chooses again, as it does for the same options without a method object
    dp = al.parallelize(mlp.train_step, cluster=cluster, microbatches=4, layers=4).plan(*mlp.args)
    assert stages_of(plan.unpin_stages()) == stages_of(dp)


def test_pipeshard_defaults_are_alpas():
    """Alpa 0.2: 2 layers, uniform stages, the 1F1B schedule, one micro-batch; the auto-sharding default keeps the ILP."""
    options = al.PipeshardParallel().options()
    assert {k: options[k] for k in ("method", "microbatches", "schedule", "layers", "remat")} == {
        "method": "alpa", "microbatches": 1, "schedule": "1f1b", "layers": 2, "remat": False}
    assert options["stage_option"] == al.UniformStageOption()
    assert al.PipeshardParallel(layer_option="manual").options()["layers"] == 1  # boundaries only: none is one layer
    auto = al.PipeshardParallel(stage_option="auto").options()
    assert (auto["submesh_space"], auto["logical_meshes"]) == ("power_of_two", "single_node_model_parallel")
    # remat: Alpa 0.2's remat_mode, its older AutoLayerOption(layer_num, remat_layer), and ManualLayerOption's flag
    for layer in (al.AutoLayerOption(2, "coarse_grained_remat"), al.AutoLayerOption(2, True), al.ManualLayerOption(remat_layer=True)):
        assert al.PipeshardParallel(layer_option=layer).options()["remat"] is True
    assert al.AutoShardingOption().method_name() == "alpa"  # Alpa's own defaults, spelled out, are accepted


class Boundaried(nn.Module):
    layers: int = 4
    width: int = 16

    @nn.compact
    def __call__(self, x):
        for i in range(self.layers):
            if i:
                al.mark_pipeline_boundary()
            x = nn.relu(nn.Dense(self.width)(x))
        return nn.Dense(4)(x)


def boundaried(layers: int = 4, width: int = 16):
    """A model with ``mark_pipeline_boundary()`` between its layers and an Alpa-style step (``al.grad``)."""
    model = Boundaried(layers, width)
    x = jnp.asarray(np.random.default_rng(0).standard_normal((32, 8)), jnp.float32)
    y = jnp.asarray(np.random.default_rng(1).standard_normal((32, 4)), jnp.float32)
    state = train_state.TrainState.create(apply_fn=model.apply, params=model.init(jax.random.key(0), x)["params"],
                                          tx=optax.sgd(0.1))

    def train_step(state, batch):
        def loss_func(params):
            out = state.apply_fn({"params": params}, batch["x"])
            return jnp.mean((out - batch["y"]) ** 2)

        grads = al.grad(loss_func)(state.params)
        return state.apply_gradients(grads=grads)

    def plain(state, batch):
        grads = jax.grad(lambda p: jnp.mean((state.apply_fn({"params": p}, batch["x"]) - batch["y"]) ** 2))(state.params)
        return state.apply_gradients(grads=grads)

    return train_step, plain, state, {"x": x, "y": y}


def same_params(got, want) -> None:
    for a, b in zip(jax.tree_util.tree_leaves(got.params), jax.tree_util.tree_leaves(want.params)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=RTOL, atol=ATOL)


def test_alpas_manual_layering_test_pattern(cluster):
    """As Alpa's own pipeline tests write it: boundaries in the model, ``alpa.grad``, ``layer_option="manual"``,
    default (uniform) stages: 4 layers on 8 devices are 4 stages of 2, each its own shape."""
    train_step, plain, state, batch = boundaried()
    p_train_step = al.parallelize(train_step, cluster=cluster, donate_argnums=(),
                                  method=al.PipeshardParallel(num_micro_batches=4, layer_option="manual"))
    got = p_train_step(state, batch)
    assert stages_of(p_train_step.current_plan) == [((i, i + 1), (1, 2), (1, 2)) for i in range(4)]
    same_params(got, jax.jit(plain)(state, batch))


def test_local_pipeline_parallel_runs_each_piece_as_a_stage_on_one_micro_batch():
    """Alpa's debugging method (its pipeline tests' ``LocalPipelineParallel()``): the step cut at its boundaries,
    one stage per piece on an equal share of this process's devices, one micro-batch; the new state is the
    plain step's. Three pieces do not share 8 devices evenly: refused by name."""
    train_step, plain, state, batch = boundaried(layers=2)
    p_train_step = al.parallelize(train_step, donate_argnums=(), method=al.LocalPipelineParallel())
    got = p_train_step(state, batch)
    plan = p_train_step.current_plan
    assert plan.num_microbatches == 1 and stages_of(plan) == [((0, 1), (1, 4), (1, 4)), ((1, 2), (1, 4), (1, 4))]
    same_params(got, jax.jit(plain)(state, batch))
    train_step, _, state, batch = boundaried(layers=3)
    with pytest.raises(al.MethodOptionError, match="8 devices do not split evenly over 3 stages"):
        al.parallelize(train_step, donate_argnums=(), method=al.LocalPipelineParallel())(state, batch)


def test_manual_layers_without_boundaries_are_one_layer(mlp, cluster):
    """Alpa's manual layering without a boundary: the step is one layer (not 8 automatic ones)."""
    step = al.parallelize(mlp.train_step, cluster=cluster,
                          method=al.ManualPipeshardParallel([[0]], [(2, 4)], num_micro_batches=2))
    plan = step.plan(*mlp.args)
    assert plan.num_layers == 1 and stages_of(plan) == [((0, 1), (2, 4), (2, 4))]
    close_to_jit(step, mlp)


def test_manual_stages_are_placed_as_given(cluster, tmp_path):
    train_step, plain, state, batch = boundaried()
    method = al.ManualPipeshardParallel(
        forward_stage_layer_ids=[[0, 1, 2], [3]], submesh_physical_shapes=[(1, 4), (1, 4)],
        submesh_logical_shapes=[(2, 2), (4, 1)], submesh_autosharding_option_dicts=[{}, {"force_batch_dim_to_mesh_dim": 0}],
        num_micro_batches=4, pipeline_schedule="gpipe")
    step = al.parallelize(train_step, cluster=cluster, method=method)
    plan = step.plan(state, batch)
    assert plan.schedule == "gpipe" and plan.stage_pins
    assert stages_of(plan) == [((0, 3), (1, 4), (2, 2)), ((3, 4), (1, 4), (4, 1))]
    same_params(step(state, batch), jax.jit(plain)(state, batch))
    # without logical shapes, as Alpa: each stage viewed as its sub-mesh's own shape
    as_physical = al.parallelize(train_step, cluster=cluster, method=al.ManualPipeshardParallel(
        [[0, 1, 2], [3]], [(1, 4), (1, 4)], num_micro_batches=4)).plan(state, batch)
    assert [st.logical_shape for st in as_physical.stages] == [(1, 4), (1, 4)]
    # the plan is an ordinary one: saved as JSON, loaded, run by a fresh step made the same way
    plan.save(tmp_path / "manual.plan.json")
    fresh = al.parallelize(train_step, cluster=cluster, method=method)
    fresh.use(al.PipelinePlan.load(tmp_path / "manual.plan.json"), state, batch)
    assert stages_of(fresh.current_plan) == stages_of(plan)
    same_params(fresh(state, batch), jax.jit(plain)(state, batch))


def stage_batch_splits(stage, microbatch: int) -> dict[str, tuple]:
    """Per op of a stage's plan making a tensor with a batch dimension (``batch_dims`` from the stage's batch
    arguments: its data, or the activations it receives), the mesh axes its chosen strategy splits that dimension over."""
    from alpa_lab.passes.methods import batch_dims

    sg = stage.plan.problem
    known = {v: 0 for v, k in sg.argument_kinds.items() if k in ("data", "activation") and sg.var_info[v][0][:1] == (microbatch,)}
    chosen = {o.name: o.strategy for o in stage.plan.ops}
    out = {}
    for v, d in batch_dims(sg, known, (0,)).items():
        n, pos = sg.node_of_var[v]
        node = sg.nodes[n]
        if node.op_index is not None:
            out[node.name] = node.strategies[node.strategy_index(chosen[node.name])].output_specs[pos].dims[d]
    return out


def test_each_stage_keeps_its_batch_on_the_axis_its_option_forces(cluster, tmp_path):
    """Alpa's per-stage ``{"force_batch_dim_to_mesh_dim": axis}`` (``ManualStageOption``) and the method's
    ``default_auto_sharding_option``: each stage's plan splits the batch dimension of every tensor carrying it over
    that axis of its 2x2 logical mesh, and keeps doing so on a re-plan and through the plan's JSON. Oracles: the
    batch-dimension analysis on each stage's chosen strategies; the unforced plan (which chooses otherwise in at
    least one stage, so the check can fail); jax.jit's numerics."""
    train_step, plain, state, batch = boundaried()
    stages = dict(forward_stage_layer_ids=[[0, 1], [2, 3]], submesh_physical_shapes=[(1, 4), (1, 4)],
                  submesh_logical_shapes=[(2, 2), (2, 2)], num_micro_batches=4)
    free = al.parallelize(train_step, cluster=cluster, method=al.ManualPipeshardParallel(**stages)).plan(state, batch)
    method = al.ManualPipeshardParallel(
        **stages, submesh_autosharding_option_dicts=[{"force_batch_dim_to_mesh_dim": 0}, {"force_batch_dim_to_mesh_dim": 1}])
    step = al.parallelize(train_step, cluster=cluster, method=method)
    plan = step.plan(state, batch)

    def splits(p):
        return [set(stage_batch_splits(st, 8).values()) for st in p.stages]

    assert [st.plan.batch_mesh_axis for st in plan.stages] == [0, 1]
    assert splits(plan) == [{(0,)}, {(1,)}], splits(plan)
    assert [st.plan.batch_mesh_axis for st in free.stages] == [None, None] and splits(free) != splits(plan), splits(free)
    same_params(step(state, batch), jax.jit(plain)(state, batch))
    assert splits(plan.with_schedule("gpipe")) == [{(0,)}, {(1,)}]  # a re-plan keeps each stage's axis
    plan.save(tmp_path / "forced.plan.json")
    fresh = al.parallelize(train_step, cluster=cluster, method=al.ManualPipeshardParallel(**stages))
    fresh.use(al.PipelinePlan.load(tmp_path / "forced.plan.json"), state, batch)
    assert splits(fresh.current_plan) == [{(0,)}, {(1,)}]
    assert splits(fresh.current_plan.with_schedule("gpipe")) == [{(0,)}, {(1,)}]  # learnt from the loaded plan
    same_params(fresh(state, batch), jax.jit(plain)(state, batch))
    # the method's default for every stage; a stage's own dict over it (-1: not forced there)
    default = al.ManualPipeshardParallel(
        **stages, submesh_autosharding_option_dicts=[{}, {"force_batch_dim_to_mesh_dim": -1}],
        default_auto_sharding_option=al.AutoShardingOption(force_batch_dim_to_mesh_dim=1))
    mixed = al.parallelize(train_step, cluster=cluster, method=default).plan(state, batch)
    assert [st.plan.batch_mesh_axis for st in mixed.stages] == [1, None] and splits(mixed)[0] == {(1,)}
    searched = mixed.unpin_stages()  # the stage DP's stages: the method's default on each (the dicts were for those given)
    assert searched.stages and all(st.plan.batch_mesh_axis == 1 for st in searched.stages)
    # a micro-batch of 2 cannot split over 4 devices: the error names the stage and what to change
    tiny = al.ManualPipeshardParallel(**{**stages, "num_micro_batches": 16, "submesh_logical_shapes": [(2, 2), (4, 1)]},
                                      submesh_autosharding_option_dicts=[{}, {"force_batch_dim_to_mesh_dim": 0}])
    with pytest.raises(al.MethodError, match=r"stage 1 \(layers 2-3\) on a 4x1 logical mesh: .*must divide by it.*submesh_logical_shapes"):
        al.parallelize(train_step, cluster=cluster, method=tiny).plan(state, batch)
    with pytest.raises(MethodOptionError, match="2 stages but 1 submesh_autosharding_option_dicts"):
        al.ManualPipeshardParallel(**stages, submesh_autosharding_option_dicts=[{}])
    with pytest.raises(MethodOptionError, match="must be a mesh axis, 0 or 1"):
        al.ManualPipeshardParallel(**stages, submesh_autosharding_option_dicts=[{}, {"force_batch_dim_to_mesh_dim": 2}])


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
    """``UniformStageOption(num_stages=2)``: the layers grouped by ``balanced_ranges`` of their FLOPs (checked against
    brute force above), each stage on half the devices."""
    step = al.parallelize(mlp.train_step, cluster=cluster, method=al.PipeshardParallel(
        num_micro_batches=4, layer_option=al.AutoLayerOption(layer_num=4), stage_option=al.UniformStageOption(num_stages=2)))
    plan = step.plan(*mlp.args)
    problem = plan.problem
    flops = [sum(problem.graph.ops[i].flops for i in problem.slicing.ops_of([k])) for k in range(plan.num_layers)]
    want = [(a, b + 1) for a, b in balanced_ranges(flops, 2)]
    assert [st.layers for st in plan.stages] == want
    assert [(st.submesh_shape, st.logical_shape) for st in plan.stages] == [((1, 4), (1, 4))] * 2
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
    (lambda: al.PipeshardParallel(num_micro_batches=4, layer_option=al.AutoLayerOption(layer_num=2, remat_mode="fine_grained_remat")),
     "fine-grained remat is not supported"),
    (lambda: al.ShardParallel(devices=["gpu:0"]), r"devices=\.\.\.\) takes a list of JAX devices.*got list.*ClusterSpec.local"),
    (lambda: al.PipeshardParallel(stage_option=al.AutoStageOption(stage_imbalance_tolerance=0.25)), "stage_imbalance_tolerance"),
    (lambda: al.PipeshardParallel(stage_option=al.AutoStageOption(profiling_database_filename="prof.pkl")), "profiling files"),
    (lambda: al.PipeshardParallel(stage_option=al.AutoStageOption(manually_specified_submeshes=[(1, 4)])), "manually_specified"),
    (lambda: al.ShardParallel(auto_sharding_option=al.AutoShardingOption(enable_auto_sharding=False)), "enable_auto_sharding"),
    (lambda: al.ShardParallel(auto_sharding_option=al.AutoShardingOption(allow_replicated_parameters=False)),
     "allow_replicated_parameters=False"),
    (lambda: al.ShardParallel(auto_sharding_option=al.AutoShardingOption(force_simple_heuristic="shard-largest")),
     "force_simple_heuristic"),
    (lambda: al.ShardParallel(manual_sharding_option=object()), "manual_sharding_option"),
    (lambda: al.PipeshardParallel(stage_input_shardings=[None]), "one list of sharding specs per stage"),
    (lambda: al.PipeshardParallel(stage_option="dp"), "stage_option must be"),
    (lambda: al.PipeshardParallel(layer_option="auto"), "layer_option must be"),
    (lambda: al.PipeshardParallel(layer_option=al.AutoLayerOption(2, static_argnums=(1,))), "static_argnums"),
])
def test_what_the_planner_cannot_do_is_refused_by_name(mlp, cluster, make, match):
    with pytest.raises(ValueError, match=match):
        al.parallelize(mlp.train_step, cluster=cluster, method=make())


def test_bad_stage_options_say_what_is_wrong(mlp, cluster):
    # a method object says how to pipeline: parallelize's own pipeline options beside it are refused, not merged
    for extra in ({"microbatches": 8}, {"layers": 4}, {"stage_option": al.UniformStageOption()}, {"schedule": "gpipe"}):
        with pytest.raises(ValueError, match=r"says how the step is pipelined; drop " + next(iter(extra))):
            al.parallelize(mlp.train_step, cluster=cluster, method=al.PipeshardParallel(num_micro_batches=4), **extra)
    with pytest.raises(ValueError, match=r"ShardParallel\(\.\.\.\) says how the step is pipelined; drop microbatches=4"):
        al.parallelize(mlp.train_step, cluster=cluster, method=al.ShardParallel(), microbatches=4)
    with pytest.raises(ValueError, match="static_argnums must be 'auto' or argument positions"):
        al.parallelize(mlp.train_step, cluster=cluster, static_argnums="yes")
    train_step, _, state, batch = boundaried()
    with pytest.raises(ValueError, match="in order, each once"):
        al.parallelize(train_step, cluster=cluster, method=al.ManualPipeshardParallel(
            [[0, 2], [1, 3]], [(1, 4), (1, 4)], num_micro_batches=4)).plan(state, batch)
    with pytest.raises(ValueError, match="names 3 layers but the step has 4"):
        al.parallelize(train_step, cluster=cluster, method=al.ManualPipeshardParallel(
            [[0, 1], [2]], [(1, 4), (1, 4)], num_micro_batches=4)).plan(state, batch)
    with pytest.raises(ValueError, match="2 stages but 1 sub-mesh shapes"):
        al.ManualStageOption([[0], [1]], [(1, 4)])
    with pytest.raises(ValueError, match=r"per-stage auto-sharding option\(s\) \['force_zero_stage_3'\] are not supported"):
        al.ManualStageOption([[0]], [(1, 4)], None, [{"force_zero_stage_3": True}])
    with pytest.raises(ValueError, match="8 devices do not split evenly over 3 stages"):
        al.parallelize(mlp.train_step, cluster=cluster, method=al.PipeshardParallel(
            num_micro_batches=4, layer_option=al.AutoLayerOption(layer_num=3))).plan(*mlp.args)
    with pytest.raises(ValueError, match="stage_option= fixes a pipeline's stages: give microbatches="):
        al.parallelize(mlp.train_step, cluster=cluster, stage_option=al.UniformStageOption())
    with pytest.raises(ValueError, match="unknown logical mesh space 'some'"):
        al.parallelize(mlp.train_step, cluster=cluster, microbatches=4, logical_meshes="some")
    assert al.parallelize(mlp.train_step, cluster=cluster, method=None).method == "alpa"  # Alpa's default method


def test_executables_show_xlas_hlo_as_alpas_tests_read_it(mlp):
    """``get_executable(...).get_hlo_text()`` / ``get_last_executable()`` (Alpa's names): XLA's optimised HLO. Oracle:
    a data-parallel step's gradients are all-reduced in it, and the plan's own predicted collectives say so too;
    a pipeline gives one text per unit task, the same as ``compiled_hlo`` joins."""
    from alpa_lab.plan.single import count_hlo_collectives

    cluster = al.ClusterSpec.local(1, 4, calibrated=False)
    step = al.parallelize(mlp.train_step, cluster=cluster, method=al.DataParallel())
    with pytest.raises(ValueError, match="nothing was planned or run yet"):
        step.get_last_executable()
    step(mlp.state, mlp.batch)
    text = step.get_last_executable().get_hlo_text()
    assert text == step.get_executable(*mlp.args).get_hlo_text()
    assert count_hlo_collectives(text).get("all-reduce", 0) > 0
    assert dict(step.current_plan.predicted_collectives()).get("all-reduce", 0) > 0
    pipelined = al.parallelize(mlp.train_step, cluster=al.ClusterSpec.local(2, 4, calibrated=False), method=al.PipeshardParallel(
        num_micro_batches=2, layer_option=al.AutoLayerOption(layer_num=2), default_auto_sharding_option=al.AutoShardingOption(
            force_data_parallel=True)))
    executable = pipelined.get_executable(*mlp.args)
    texts = executable.get_hlo_text()
    plan = pipelined.current_plan
    assert isinstance(texts, list) and len(texts) == 3 * plan.num_stages  # forward, backward, update per stage
    # Alpa's order, as its tests index them: forward stages, backward stages as they run (last first), updates
    S, by_task = plan.num_stages, executable.compiled.task_hlo()
    assert texts == ([by_task[(s, "forward")] for s in range(S)] + [by_task[(s, "backward")] for s in reversed(range(S))]
                     + [by_task[(s, "apply")] for s in range(S)])
    assert all(t.startswith("HloModule") for t in texts)
    joined = pipelined.compiled_hlo(*mlp.args)
    assert all(t in joined for t in texts) and joined.count("// stage ") == len(texts)
    assert sum(count_hlo_collectives(t).get("all-reduce", 0) for t in texts) > 0  # each stage's gradients, data parallel


def test_op_pins_keep_the_fixed_stages(mlp, cluster):
    """``step.plan(..., pins=...)`` on a step whose stages a stage option fixes: the pins re-plan those stages,
    which stay fixed (and pinned) rather than handed back to the DP."""
    step = al.parallelize(mlp.train_step, cluster=cluster, method=al.PipeshardParallel(
        num_micro_batches=4, layer_option=al.AutoLayerOption(layer_num=4)))
    plan = step.plan(*mlp.args)
    op = next(o for o in plan.stages[0].plan.ops if o.kind == "op" and o.name.startswith("dot_general"))
    pinned = step.plan(*mlp.args, pins={op.name: op.strategy})
    assert pinned.stage_pins and stages_of(pinned) == stages_of(plan) and dict(pinned.pins) == {op.name: op.strategy}


def test_the_stage_dp_prices_each_layer_with_the_default_forced_batch_axis(monkeypatch, cluster):
    """Alpa profiles the stages its DP weighs with ``default_auto_sharding_option``: every layer ILP the DP solves in
    the planner's own method is restricted as ``force_batch_dim_to_mesh_dim`` restricts a stage (the memory-saving
    layouts keep their own rule). Oracles: the restrictions each solve gets, re-derived by the forcing rule on that
    solve's graph; the two views of a line of devices, one ILP when unforced, priced apart when forced (axis 0 is
    the line in one and a single device in the other); the unforced costs, which differ; jax.jit's numerics."""
    from alpa_lab.passes import pipeline
    from alpa_lab.passes.methods import method_restrictions

    train_step, plain, state, batch = boundaried(width=512)  # wide: the weights, not the micro-batch of 8, are worth splitting
    seen = []
    real = pipeline.solve_strategy_graph

    def spy(sg, pins=None, **kw):
        seen.append((sg.batch_mesh_axis, kw["restrictions"], method_restrictions("alpa", sg)))
        return real(sg, pins, **kw)

    monkeypatch.setattr(pipeline, "solve_strategy_graph", spy)  # the layer ILPs (solved in this process: a small problem)

    def planned(option):
        method = al.PipeshardParallel(num_micro_batches=4, layer_option="manual", stage_option="auto",
                                      default_auto_sharding_option=option)
        step = al.parallelize(train_step, cluster=cluster, method=method)
        return step, step.plan(state, batch)

    step, plan = planned(al.AutoShardingOption(force_batch_dim_to_mesh_dim=0))
    forced_solves = [(axis, restrictions, rule) for axis, restrictions, rule in seen if axis is not None]
    assert forced_solves and all(axis == 0 and restrictions == rule for axis, restrictions, rule in forced_solves)
    assert any(restrictions for _, restrictions, _ in forced_solves)  # forcing restricted something
    problem = plan.problem
    assert all(st.plan.batch_mesh_axis == 0 for st in plan.stages)
    line, across = problem.layer_cost(1, (1, 4), (1, 4)), problem.layer_cost(1, (1, 4), (4, 1))
    seen.clear()
    _, free = planned(None)
    assert not any(axis is not None for axis, _, _ in seen)
    unforced = free.problem
    assert unforced.layer_cost(1, (1, 4), (1, 4)) == unforced.layer_cost(1, (1, 4), (4, 1))  # one ILP for both views
    # unforced, this wide layer splits its weights over the line; forced to axis 0, it must split its micro-batch over
    # the line where axis 0 is the line (dearer), and keep it whole where axis 0 is one device: two problems
    assert across.time > 1.5 * unforced.layer_cost(1, (1, 4), (4, 1)).time and line != across
    same_params(step(state, batch), jax.jit(plain)(state, batch))


def test_a_stage_reading_only_activations_keeps_its_batch_on_the_forced_axis(cluster):
    """Alpa names the batch (``batch_argnums=(1,)``), which only the first and last stages read: the middle stages take
    the batch from the activations they receive, and every op of theirs carrying it is split over the forced axis
    too (they were held partly whole). Oracle: the batch-dimension analysis on each stage's chosen strategies."""
    train_step, plain, state, batch = boundaried()
    method = al.ManualPipeshardParallel(
        forward_stage_layer_ids=[[0], [1], [2], [3]], submesh_physical_shapes=[(1, 2)] * 4,
        submesh_logical_shapes=[(2, 1)] * 4, num_micro_batches=4,
        default_auto_sharding_option=al.AutoShardingOption(force_batch_dim_to_mesh_dim=0))
    step = al.parallelize(train_step, cluster=cluster, method=method)
    plan = step.plan(state, batch)
    assert [bool(st.plan.problem.batch_vars) for st in plan.stages] == [True, False, False, True]
    assert [set(stage_batch_splits(st, 8).values()) for st in plan.stages] == [{(0,)}] * 4
    same_params(step(state, batch), jax.jit(plain)(state, batch))


def test_alpas_3d_parallel_method_is_equal_stages_with_the_batch_on_axis_0(mlp):
    """Alpa's ``get_3d_parallel_method(num_micro_batches, data_parallel, operator_parallel, pipeline_parallel)`` on this
    process's 8 devices: ``pipeline_parallel`` stages on equal sub-meshes, each viewed as data x operator with the batch
    over axis 0; ``data_parallel=-1`` takes what the devices leave. Oracles: the stages the arguments spell out, the
    batch-dimension analysis on each stage's chosen strategies, jax.jit's numerics."""
    step = al.parallelize(mlp.train_step, method=al.get_3d_parallel_method(4, 2, 2, 2))
    plan = step.plan(*mlp.args)
    assert stages_of(plan) == [((0, 1), (1, 4), (2, 2)), ((1, 2), (1, 4), (2, 2))] and plan.num_microbatches == 4
    assert [st.plan.batch_mesh_axis for st in plan.stages] == [0, 0] and plan.stage_pins
    close_to_jit(step, mlp)
    one = al.parallelize(mlp.train_step, method=al.get_3d_parallel_method(2, -1, 4, 1)).plan(*mlp.args)
    assert stages_of(one) == [((0, 1), (1, 8), (2, 4))] and one.num_microbatches == 2
    # your boundaries (4 layers) grouped into 2 stages; every batch-carrying op of each splits the batch over axis 0
    train_step, plain, state, batch = boundaried()
    step = al.parallelize(train_step, method=al.get_3d_parallel_method(4, 2, 2, 2, manual_layer_num=4))
    plan = step.plan(state, batch)
    assert [st.layers for st in plan.stages] == [(0, 2), (2, 4)] and {st.logical_shape for st in plan.stages} == {(2, 2)}
    assert [set(stage_batch_splits(st, 8).values()) for st in plan.stages] == [{(0,)}, {(0,)}]
    same_params(step(state, batch), jax.jit(plain)(state, batch))


@pytest.mark.parametrize("args, kwargs, match", [
    ((4, 3, 2, 2), {}, r"3 x 2 x 2 = 12 devices, but there are 8 \(pass data_parallel=-1"),
    ((4, -1, 3, 2), {}, r"data_parallel=-1\): 8 devices do not split into 3 x 2"),
    ((4, 2, 0, 2), {}, r"operator_parallel=\.\.\.\) must be a positive integer, got 0"),
    ((4, 2, 2, 2.0), {}, r"pipeline_parallel=\.\.\.\) must be a positive integer, got 2.0"),
    ((4, 2, 2, 2), {"manual_layer_num": 3}, r"manual_layer_num=3\) must be a multiple of pipeline_parallel=2"),
])
def test_bad_3d_parallel_sizes_say_what_is_wrong(args, kwargs, match):
    with pytest.raises(MethodOptionError, match=match):
        al.get_3d_parallel_method(*args, **kwargs)


def test_method_objects_are_set_up_field_by_field_as_alpas_tests_do():
    """Alpa's tests make a method once and set ``method.devices`` / ``method.as_option`` per case before
    ``parallelize`` reads them; the plan is made on that grid with that option."""
    import jax

    method = al.ShardParallel()
    method.devices = al.LocalPhysicalDeviceMesh(jax.local_devices()[:4]).get_logical_mesh((2, 2), [1, 1], [1, 1])
    method.as_option = al.AutoShardingOption(force_data_parallel=True)
    step = al.parallelize(lambda w, x: (x @ w).sum(), method=method)
    plan = step.plan(jax.numpy.ones((8, 8)), jax.numpy.ones((16, 8)))
    assert tuple(plan.mesh_shape) == (2, 2) and plan.method == "data_parallel"
    pipe = al.PipeshardParallel(num_micro_batches=2)
    pipe.stage_option = al.UniformStageOption()
    pipe.as_option.prefer_reduce_scatter = False
    assert isinstance(pipe.options()["stage_option"], al.UniformStageOption)
