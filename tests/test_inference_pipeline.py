"""Inference pipelines: a step without gradients pipelined over stages on sub-meshes (Alpa's
``pipeline_schedule="inference"``, its ``tests/pipeline_parallel/test_inference_only.py``), and ``FollowParallel``
of a pipelined train step (the pipeshard case of Alpa's ``tests/runtime/test_follow_parallel.py``).

Oracles: the unparallelized function and ``jax.jit`` of it (per-example results put back together in order:
equal to the full batch's to float tolerance; a mean over the batch equal to the mean of the micro-batches' means),
the train step's own plan (the stages and layouts an evaluation follows) and its placement specs.
Tolerance: rtol 1e-5 / atol 1e-6 (float32, the same ops on other shards; Alpa's test uses 1e-3).
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.training import train_state

import alpa_lab as al
from alpa_lab.models import tiny_example
from alpa_lab.passes.inter_op import InterOpError
from alpa_lab.passes.stages import SlicingError

RTOL, ATOL = 1e-5, 1e-6


class MLP(nn.Module):
    """Alpa's test MLP: a boundary after half the layers (``how``: "alpa" argument-less, "tensor" on the
    activation, "none": cut by ``AutoLayerOption``)."""

    how: str = "alpa"
    hidden: int = 16
    layers: int = 4

    @nn.compact
    def __call__(self, x):
        for i in range(self.layers):
            x = nn.relu(nn.Dense(self.hidden)(x))
            if i == self.layers // 2 - 1:
                if self.how == "alpa":
                    al.mark_pipeline_boundary()
                elif self.how == "tensor":
                    x = al.mark_stage_boundary(x)
        return x


def data(batch=64, hidden=16):
    rng = np.random.default_rng(0)
    return {"x": jnp.asarray(rng.standard_normal((batch, hidden)), jnp.float32),
            "y": jnp.asarray(rng.standard_normal((batch, hidden)), jnp.float32)}


def close(a, b):
    for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("how", ["alpa", "tensor", "none"])
def test_an_inference_pipeline_returns_what_the_function_returns(how):
    """Alpa's test_inference_only flow: ``PipeshardParallel(pipeline_schedule="inference")`` with manual boundaries
    or automatic layers; per-example outputs come back whole and in order, a loss as the batch's mean."""
    model, batch = MLP(how), data()
    params = model.init(jax.random.PRNGKey(0), batch["x"])

    def infer_step(params, batch):
        out = model.apply(params, batch["x"])
        return out, jnp.mean((out - batch["y"]) ** 2)

    layer_option = "manual" if how != "none" else al.AutoLayerOption(layer_num=2)
    method = al.PipeshardParallel(num_micro_batches=4, pipeline_schedule="inference", layer_option=layer_option)
    p_infer = al.parallelize(infer_step, method=method, donate_argnums=())
    executable = p_infer.get_executable(params, batch)
    out, loss = p_infer(params, batch)
    assert out.shape == batch["x"].shape  # the 4 micro-batches' rows, put back together
    close((out, loss), infer_step(params, batch))
    close((out, loss), jax.jit(infer_step)(params, batch))
    plan = p_infer.current_plan
    assert plan.schedule == "inference" and plan.num_layers == 2 and plan.num_stages == 2
    for st in plan.stages:  # a forward only: no backward, no update, its weights held (eq. 5)
        assert st.backward_time == 0 and st.apply_time == 0 and st.activation_memory == 0 and st.weight_memory > 0
    assert [st.device_ids for st in plan.stages] == [(0, 1, 2, 3), (4, 5, 6, 7)]  # uniform stages, as Alpa's default
    # the first stage holds the first two layers' weights, the second the rest
    specs = executable.get_input_placement_specs()[0]["params"]
    assert {specs[f"Dense_{i}"]["kernel"].mesh_ids for i in range(4)} == {(0,), (1,)}
    assert specs["Dense_0"]["kernel"].mesh_ids == (0,) and specs["Dense_3"]["kernel"].mesh_ids == (1,)
    with pytest.raises(ValueError, match="inference pipeline .* no state to train"):
        p_infer.train(params, batch, steps=1)


@pytest.mark.parametrize("name", ["gpt", "bert"])
def test_an_inference_pipeline_of_a_transformer_matches_jax(name):
    """The tiny GPT / BERT's loss without gradients, cut into 4 automatic layers (embeddings, blocks, head) and
    planned by the stage DP on 2 x 4 devices; the tokens (integers) enter at the first stage."""
    ex = tiny_example(name)

    def evaluate(params, batch):
        return ex.loss_fn(params, {}, batch)[0]

    step = al.parallelize(evaluate, cluster=al.ClusterSpec.local(2, 4), microbatches=4, layers=4, schedule="inference",
                          batch_argnums=(1,))
    close(step(ex.state.params, ex.batch), jax.jit(evaluate)(ex.state.params, ex.batch))
    plan = step.current_plan
    assert plan.num_layers == 4 and all(st.backward_time == 0 for st in plan.stages)
    # pinned to two stages, each on a host: the same numbers, its stages on those devices
    step.use(plan.pin_stages([[0, 1], [2, 3]], submeshes=[(1, 4), (1, 4)]))
    close(step(ex.state.params, ex.batch), jax.jit(evaluate)(ex.state.params, ex.batch))
    assert [st.device_ids for st in step.current_plan.stages] == [(0, 1, 2, 3), (4, 5, 6, 7)]


def test_an_inference_plan_saved_as_json_runs_as_planned(tmp_path):
    model, batch = MLP("tensor"), data()
    params = model.init(jax.random.PRNGKey(0), batch["x"])

    def infer(params, x):
        return model.apply(params, x)

    step = al.parallelize(infer, cluster=al.ClusterSpec.local(1, 4), microbatches=2, schedule="inference")
    plan = step.plan(params, batch["x"]).pin_stages([[0, 0], [1, 1]], submeshes=[(1, 2), (1, 2)])
    plan.save(tmp_path / "plan.json")
    fresh = al.parallelize(infer, cluster=al.ClusterSpec.local(1, 4), microbatches=2, schedule="inference")
    loaded = fresh.use(al.PipelinePlan.load(tmp_path / "plan.json"), params, batch["x"])
    assert loaded.schedule == "inference" and [st.device_ids for st in loaded.stages] == [(0, 1), (2, 3)]
    close(fresh(params, batch["x"]), jax.jit(infer)(params, batch["x"]))
    with pytest.raises(InterOpError, match="runs the inference schedule only"):
        loaded.with_schedule("1f1b")


def test_a_step_and_a_schedule_that_do_not_match_are_refused_by_name():
    model, batch = MLP("alpa"), data()
    params = model.init(jax.random.PRNGKey(0), batch["x"])

    def infer(params, batch):
        return jnp.mean((model.apply(params, batch["x"]) - batch["y"]) ** 2)

    def train(params, batch):
        loss, grads = al.value_and_grad(infer)(params, batch)
        return jax.tree_util.tree_map(lambda p, g: p - 0.1 * g, params, grads), loss

    with pytest.raises(SlicingError, match="takes gradients .* the inference schedule runs a forward only"):
        al.parallelize(train, cluster=al.ClusterSpec.local(1, 4), microbatches=2, schedule="inference").plan(params, batch)
    with pytest.raises(SlicingError, match="without gradients .* schedule='inference'"):
        al.parallelize(infer, cluster=al.ClusterSpec.local(1, 4), microbatches=2, schedule="1f1b").plan(params, batch)
    trained = al.parallelize(train, cluster=al.ClusterSpec.local(1, 4), microbatches=2).plan(params, batch)
    with pytest.raises(InterOpError, match="runs a step without gradients; this step takes them"):
        trained.with_schedule("inference")


class Model(nn.Module):
    @nn.compact
    def __call__(self, x):
        for i in range(4):
            if i:
                al.mark_pipeline_boundary()
            x = nn.relu(nn.Dense(32)(x))
        return nn.Dense(8)(x)


def test_follow_parallel_of_a_pipelined_step_evaluates_on_its_stages():
    """Alpa's test_follow_parallel, pipeshard case: the evaluation is an inference pipeline over the train step's
    stages (same layers, sub-meshes, logical meshes and devices), its weights where the train step keeps them (its
    input placement specs equal the train step's of ``state.params``), numerically the evaluation of the same
    states by ``jax.jit``; a re-pinned train step makes the evaluation plan again on the new stages."""
    model, batch = Model(), {"x": data(32)["x"], "y": data(32, 8)["y"]}
    state = train_state.TrainState.create(apply_fn=model.apply, params=model.init(jax.random.PRNGKey(0), batch["x"]),
                                          tx=optax.adam(1e-2))

    def train_step(state, batch):
        def loss_fn(p):
            return jnp.mean((state.apply_fn(p, batch["x"]) - batch["y"]) ** 2)

        loss, grads = al.value_and_grad(loss_fn)(state.params)
        return state.apply_gradients(grads=grads), loss

    def eval_step(params, batch):
        return jnp.mean((model.apply(params, batch["x"]) - batch["y"]) ** 2)

    p_train = al.parallelize(train_step, method=al.PipeshardParallel(num_micro_batches=2, layer_option="manual"))
    p_eval = al.parallelize(eval_step, method=al.FollowParallel(p_train, num_micro_batches=2))
    reference = state
    for _ in range(3):
        state, _ = p_train(state, batch)
        reference, _ = jax.jit(train_step)(reference, batch)
        close(p_eval(state.params, batch), jax.jit(eval_step)(reference.params, batch))
    train_plan, eval_plan = p_train.current_plan, p_eval.current_plan
    assert eval_plan.schedule == "inference"
    where = lambda plan: [(st.layers, st.submesh_shape, st.logical_shape, st.device_ids) for st in plan.stages]  # noqa: E731
    assert where(eval_plan) == where(train_plan)
    train_specs = p_train.get_last_executable().get_input_placement_specs()[0].params
    eval_specs = p_eval.get_last_executable().get_input_placement_specs()[0]
    assert jax.tree_util.tree_leaves(jax.tree_util.tree_map(
        lambda a, b: a.mesh_ids == b.mesh_ids and a.sharding_specs == b.sharding_specs, train_specs, eval_specs,
        is_leaf=lambda x: hasattr(x, "mesh_ids"))) == [True] * len(jax.tree_util.tree_leaves(state.params))

    p_train.use(train_plan.pin_stages([[0, 1], [2, 3]], submeshes=[(1, 4), (1, 4)]))
    state, _ = p_train(state, batch)
    reference, _ = jax.jit(train_step)(reference, batch)
    close(p_eval(state.params, batch), jax.jit(eval_step)(reference.params, batch))
    assert where(p_eval.current_plan) == where(p_train.current_plan) != where(train_plan)


def test_follow_parallel_of_a_pipelined_step_refuses_another_model():
    model, batch = Model(), {"x": data(32)["x"], "y": data(32, 8)["y"]}
    state = train_state.TrainState.create(apply_fn=model.apply, params=model.init(jax.random.PRNGKey(0), batch["x"]),
                                          tx=optax.sgd(1e-2))

    def train_step(state, batch):
        grads = al.grad(lambda p: jnp.mean((state.apply_fn(p, batch["x"]) - batch["y"]) ** 2))(state.params)
        return state.apply_gradients(grads=grads)

    p_train = al.parallelize(train_step, method=al.PipeshardParallel(num_micro_batches=2, layer_option="manual"))
    with pytest.raises(al.MethodOptionError, match="never run or planned"):
        al.parallelize(lambda p, b: jnp.sum(p["params"]["Dense_0"]["kernel"] * 0) + jnp.mean(b["x"]),
                       method=al.FollowParallel(p_train))(state.params, batch)
    p_train(state, batch)
    unmarked = MLP("none", hidden=32, layers=4)  # no boundaries: one layer, where the train step has four

    def other(params, batch):
        return jnp.mean(unmarked.apply({"params": {f"Dense_{i}": params["params"][f"Dense_{i}"] for i in range(4)}}, batch["x"]))

    with pytest.raises(al.MethodOptionError, match="this step has 1 layers but the pipelined step it follows has 4"):
        al.parallelize(other, method=al.FollowParallel(p_train))(state.params, batch)


def test_alpas_manual_submesh_space_and_model_parallel_logical_meshes():
    """Alpa's test_inference_auto: ``AutoStageOption(submesh_physical_shape_space="manual",
    manually_specified_submeshes=((1, 2),), submesh_logical_shape_space="model_parallel_only")`` on 4 devices: the
    stage DP may use only (1, 2) sub-meshes, each viewed as (1, 2). The same option on a training step over this
    process's 8 devices with (1, 4): every stage on a (1, 4) sub-mesh, a (1, 4) logical mesh."""
    model, batch = MLP("alpa"), data()
    params = model.init(jax.random.PRNGKey(0), batch["x"])

    def infer_step(params, batch):
        out = model.apply(params, batch["x"])
        return out, jnp.mean((out - batch["y"]) ** 2)

    option = al.AutoStageOption(submesh_physical_shape_space="manual", manually_specified_submeshes=((1, 2),),
                                submesh_logical_shape_space="model_parallel_only")
    method = al.PipeshardParallel(devices=al.LocalPhysicalDeviceMesh(jax.devices()[:4]), num_micro_batches=1,
                                  pipeline_schedule="inference", layer_option="manual", stage_option=option)
    p_infer = al.parallelize(infer_step, method=method)
    close(p_infer(params, batch), infer_step(params, batch))
    plan = p_infer.current_plan
    assert [(st.submesh_shape, st.logical_shape) for st in plan.stages] == [((1, 2), (1, 2))] * 2
    assert plan.submesh_space == "manual:1x2" and al.PipelinePlan.from_json(plan.to_json()).submesh_space == "manual:1x2"

    def train_step(params, batch):
        grads = al.grad(lambda p: jnp.mean((model.apply(p, batch["x"]) - batch["y"]) ** 2))(params)
        return jax.tree_util.tree_map(lambda p, g: p - 0.1 * g, params, grads)

    wide = al.AutoStageOption(submesh_physical_shape_space="manual", manually_specified_submeshes=[[1, 4]],
                              submesh_logical_shape_space="model_parallel_only")
    step = al.parallelize(train_step, method=al.PipeshardParallel(num_micro_batches=2, layer_option="manual", stage_option=wide))
    close(step(params, batch), jax.jit(train_step)(params, batch))
    assert {(st.submesh_shape, st.logical_shape) for st in step.current_plan.stages} == {((1, 4), (1, 4))}
    with pytest.raises(al.MethodOptionError, match="'manual' and manually_specified_submeshes=.* go together"):
        al.AutoStageOption(submesh_physical_shape_space="manual")
    with pytest.raises(al.MethodOptionError, match="go together"):
        al.AutoStageOption(manually_specified_submeshes=((1, 2),))
    odd = al.AutoStageOption(submesh_physical_shape_space="manual", manually_specified_submeshes=((1, 3),))
    with pytest.raises(ValueError, match=r"sub-mesh shapes \[\(1, 3\)\] are not ones Alpa places on 1x8: choose from"):
        al.parallelize(train_step, method=al.PipeshardParallel(num_micro_batches=2, layer_option="manual",
                                                               stage_option=odd)).plan(params, batch)


def test_stage_input_shardings_plan_another_batch_size_with_the_same_input_layouts():
    """Alpa's test_set_input_shard: an inference pipeline compiled for batch 1 gives each stage's input specs
    (``stage_input_shard_specs``); ``PipeshardParallel(stage_input_shardings=...)`` plans batch 8 with them, where
    batch 8 planned freely lays its inputs out otherwise (the batch split); oracle for the numerics: the function."""
    model = MLP(hidden=64)
    params = jax.eval_shape(model.init, jax.random.PRNGKey(0), jax.ShapeDtypeStruct((1, 64), jnp.float32))

    def infer_fn(params, batch):
        return model.apply(params, batch["x"])

    option = al.AutoShardingOption(force_batch_dim_to_mesh_dim=None, allow_all_to_all=False, allow_all_gather=False)

    def executable(batch_size, **extra):
        method = al.PipeshardParallel(num_micro_batches=1, pipeline_schedule="inference", layer_option="manual",
                                      default_auto_sharding_option=option, **extra)
        x = jax.ShapeDtypeStruct((batch_size, 64), jnp.float32)
        return al.parallelize(infer_fn, batch_argnums=(1,), method=method).get_executable(params, {"x": x})

    first = executable(1)
    specs = first.stage_input_shard_specs
    assert len(specs) == 2 and [len(s) for s in specs] == [len(st.plan.inputs) for st in first.plan.stages]
    free, held = executable(8), executable(8, stage_input_shardings=specs)
    assert free.stage_input_shard_specs != held.stage_input_shard_specs
    assert held.stage_input_shard_specs == specs
    weights = jax.tree_util.tree_map(lambda s: jnp.full(s.shape, 0.01, s.dtype), params)
    x = jnp.arange(8 * 64, dtype=jnp.float32).reshape(8, 64) / 100
    np.testing.assert_allclose(np.asarray(held(weights, {"x": x})), np.asarray(infer_fn(weights, {"x": x})), rtol=RTOL, atol=ATOL)

    with pytest.raises(al.MethodOptionError, match="gives 1 stages' input specs but the plan has 2 stages"):
        executable(8, stage_input_shardings=specs[:1])
    with pytest.raises(al.MethodOptionError, match=r"stage_input_shardings\[1\] gives 2 specs but stage 1 has 5 inputs"):
        executable(8, stage_input_shardings=[specs[0], specs[1][:2]])
    for bad in (3, ["RR", "RR"]):  # not a list per stage
        with pytest.raises(al.MethodOptionError, match="one list of sharding specs per stage"):
            al.PipeshardParallel(stage_input_shardings=bad).options()
    with pytest.raises(ValueError, match="a single-mesh plan has no stages"):
        al.parallelize(infer_fn, method=al.ShardParallel()).get_executable(weights, {"x": x}).stage_input_shard_specs
