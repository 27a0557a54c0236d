"""Alpa's session and executable API as code written for Alpa uses it: ``init`` / ``shutdown`` (a real local
Ray), the batch argument Alpa assumes, ``get_last_executable()``'s objective, memory and debug dump, and
``count_communication_primitives`` on XLA's own HLO."""

from __future__ import annotations


import functools
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn
from flax.training.train_state import TrainState

import alpa_lab as al
from alpa_lab.api import _SESSION

from test_pipeline import assert_close


class MLPModel(nn.Module):
    """Alpa's test MLP: a pipeline boundary placed by hand in the model."""

    hidden: int = 128

    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Dense(self.hidden)(x))
        x = nn.Dense(self.hidden)(x)
        al.mark_pipeline_boundary()
        x = nn.relu(nn.Dense(self.hidden)(x))
        return nn.Dense(self.hidden)(x)


def mlp_state(hidden: int = 128, batch: int = 64):
    x = jnp.linspace(-1, 1, batch * hidden).reshape(batch, hidden)
    y = jnp.cos(x)
    model = MLPModel(hidden)
    state = TrainState.create(apply_fn=model.apply, params=model.init(jax.random.PRNGKey(0), x), tx=optax.sgd(1e-2))
    return state, {"x": x, "y": y}


def train_step(state, batch):
    """Alpa's pattern: ``alpa.grad`` in the step, the new state returned alone."""

    def loss_func(params, x, y):
        return jnp.mean((state.apply_fn(params, x) - y) ** 2)

    grads = al.grad(loss_func)(state.params, batch["x"], batch["y"])
    return state.apply_gradients(grads=grads)


def eval_loss(params, batch):
    return jnp.mean((MLPModel().apply(params, batch["x"]) - batch["y"]) ** 2)


class TiedModel(nn.Module):
    """Alpa's test_tied_embedding: the embedding used in the first stage and, transposed, in the last."""

    vocab: int = 64
    hidden: int = 32

    @nn.compact
    def __call__(self, ids):
        emb = nn.Embed(self.vocab, self.hidden)
        x = nn.relu(nn.Dense(self.hidden)(emb(ids)))
        al.mark_pipeline_boundary()
        x = nn.relu(nn.Dense(self.hidden)(x))
        return emb.attend(x)


def tied_state():
    """With Alpa's test_global_norm's update: clipping by the global norm reads every stage's gradients."""
    ids = jnp.arange(32 * 8).reshape(32, 8) % 64
    model = TiedModel()
    tx = optax.chain(optax.clip_by_global_norm(0.05), optax.adam(1e-2))
    state = TrainState.create(apply_fn=model.apply, params=model.init(jax.random.PRNGKey(0), ids), tx=tx)
    return state, {"ids": ids, "labels": (ids + 1) % 64}


def tied_loss(params, apply_fn, batch):
    logits = apply_fn(params, batch["ids"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["labels"]).mean()


def tied_step(state, batch):
    loss, grads = al.value_and_grad(tied_loss)(state.params, state.apply_fn, batch)
    return state.apply_gradients(grads=grads), loss


def tied_state_only(state, batch):
    return state.apply_gradients(grads=al.grad(tied_loss)(state.params, state.apply_fn, batch))


def grads_only(state, batch):
    """Alpa's test_mlp returns the gradients, not a state."""
    return al.grad(tied_loss)(state.params, state.apply_fn, batch)


def two_steps_match_jit(p, step, state, batch) -> None:
    ref, ref_loss = jax.jit(step)(*jax.jit(step)(state, batch)[:1], batch)
    out, loss = p(*p(state, batch)[:1], batch)
    assert [st.layers for st in p.current_plan.stages] == [(0, 1), (1, 2)]
    assert_close(loss, ref_loss, "loss")
    assert_close(out.params, ref.params, "params")


def test_tied_embedding_and_global_norm_clipping_pipelined():
    state, batch = tied_state()
    p = al.parallelize(tied_step, method=al.PipeshardParallel(num_micro_batches=2, layer_option="manual"))
    two_steps_match_jit(p, tied_step, state, batch)


@pytest.fixture
def no_session():
    yield
    if _SESSION.kind is not None:
        al.shutdown()


def test_init_local_and_its_errors(no_session):
    with pytest.raises(RuntimeError, match="without alpa_lab.init"):
        al.shutdown()
    assert al.get_global_physical_mesh() is None  # as Alpa's: made only when asked, or by init
    made = al.get_global_physical_mesh(create_if_not_exist=True)
    assert made.num_devices == jax.device_count() and al.get_global_physical_mesh() is made  # one, kept
    with pytest.raises(ValueError, match="choose 'ray'.*or 'local'"):
        al.init("slurm")
    with pytest.raises(ValueError, match="num_nodes must be a positive integer"):
        al.init("ray", num_nodes=0)
    assert al.init("local") is None
    assert al.init("local") is None  # again with the same arguments: nothing happens (as Alpa's)
    with pytest.warns(UserWarning, match=r"already called \('local'\) and stands.*shutdown\(\) before init\('ray'"):
        assert al.init("ray") is None  # as Alpa's: the first init stands (said, not silent)
    assert al.get_global_cluster() is None and al.get_global_num_devices() == jax.device_count()
    assert al.get_global_physical_mesh().get_logical_mesh((2, 4)).shape == (2, 4)  # this process's devices
    state, batch = mlp_state()
    step = al.parallelize(train_step, method=al.ShardParallel())
    out = step(state, batch)
    assert step.ray_cluster is None and step.cluster == al.ClusterSpec.default()  # "local": this process's devices
    assert_close(out.params, jax.jit(train_step)(state, batch).params, "params")
    al.shutdown()
    assert _SESSION.kind is None


def test_init_ray_runs_steps_on_its_mesh_workers(no_session):
    """Alpa's test_mlp: init(cluster="ray") in set-up, a pipeshard step with a hand-placed boundary, shutdown()
    in tear-down. Steps made before init() follow it too (Alpa compiles on the first call)."""
    ray = pytest.importorskip("ray")
    state, batch = mlp_state()
    early = al.parallelize(train_step, method=al.PipeshardParallel(num_micro_batches=2, layer_option="manual"))
    cluster = al.init(cluster="ray")
    try:
        assert al.init(cluster="ray") is cluster
        assert al.get_global_cluster() is cluster and al.get_global_num_devices() == 8
        step = al.parallelize(train_step, method=al.PipeshardParallel(num_micro_batches=2, layer_option="manual"))
        expected = jax.jit(train_step)(state, batch)
        out = step(state, batch)
        assert step.ray_cluster is cluster and step.cluster == cluster.spec
        assert len(step.current_plan.stages) == 2  # the boundary in the model
        assert_close(out.params, expected.params, "params")
        out2 = step(out, batch)  # the state it returned: the run goes on, nothing relaunched
        assert_close(out2.params, jax.jit(train_step)(expected, batch).params, "params")
        assert early.cluster == cluster.spec and early.ray_cluster is cluster
        # a weight in two meshes and an update that reads every mesh's gradients, on the mesh workers
        tied = al.parallelize(tied_step, method=al.PipeshardParallel(num_micro_batches=2, layer_option="manual"))
        two_steps_match_jit(tied, tied_step, *tied_state())
        assert tied.ray_cluster is cluster
        # returning the new state alone: the tied weight's new value still moves to the other mesh each step
        # (it was not sent, and the second step waited for it forever)
        alone = al.parallelize(tied_state_only, method=al.PipeshardParallel(num_micro_batches=2, layer_option="manual"))
        alone.on_ray(cluster, step_timeout=60)  # on_ray before planning: planned for that cluster
        tstate, tbatch = tied_state()
        got = alone(alone(tstate, tbatch), tbatch)
        assert alone.cluster == cluster.spec
        assert_close(got.params, jax.jit(tied_state_only)(jax.jit(tied_state_only)(tstate, tbatch), tbatch).params, "params")
        with pytest.raises(al.LaunchError, match=r"only gradients.*on_ray\(None\)"):
            al.parallelize(grads_only, method=al.PipeshardParallel(num_micro_batches=2, layer_option="manual"))(tstate, tbatch)
        # Alpa's test_create_state and test_follow_parallel, on the session's Ray: the state made where the step
        # reads it, trained on the mesh workers, evaluated on an evaluation step following it
        p_shard = al.parallelize(train_step, method=al.ShardParallel())
        made = al.parallelize(lambda: mlp_state()[0], method=al.CreateStateParallel(p_shard, batch))()
        assert_close(made.params, state.params, "params")
        trained = p_shard(made, batch)
        assert p_shard.ray_cluster is cluster
        assert_close(trained.params, expected.params, "params")
        # Alpa's flow calls the evaluation as it is: it follows the train step's plan and runs in this process
        # (the mesh workers run training steps; the state they return is fetched here)
        p_eval = al.parallelize(eval_loss, method=al.FollowParallel(p_shard))
        assert float(p_eval(trained.params, batch)) == pytest.approx(float(eval_loss(expected.params, batch)), rel=1e-4)
        assert p_eval.current_plan.mesh_shape == p_shard.current_plan.mesh_shape and p_eval.ray_cluster is None
        with pytest.raises(al.LaunchError, match=r"must return new_state.*on_ray\(None\)"):
            al.parallelize(eval_loss, method=al.ShardParallel())(trained.params, batch)  # not following: on the workers
        assert jax.tree_util.tree_leaves(p_eval.get_last_executable().get_input_placement_specs()[0]) == \
            jax.tree_util.tree_leaves(p_shard.get_last_executable().get_input_placement_specs()[0].params)
        # the pipelined step's evaluation: an inference pipeline over its stages, run in this process
        p_peval = al.parallelize(eval_loss, method=al.FollowParallel(step))
        two = jax.jit(train_step)(expected, batch)
        assert float(p_peval(out2.params, batch)) == pytest.approx(float(eval_loss(two.params, batch)), rel=1e-4)
        assert p_peval.ray_cluster is None and p_peval.current_plan.schedule == "inference"
        assert [st.device_ids for st in p_peval.current_plan.stages] == [st.device_ids for st in step.current_plan.stages]
        with pytest.raises(al.LaunchError, match="inference pipeline .* runs in this process"):
            p_peval.on_ray(cluster)(out2.params, batch)
    finally:
        al.shutdown()
    assert not ray.is_initialized() and al.get_global_cluster() is None
    # without a session the step runs in this process again, planned anew for its devices
    out3 = step(out2, batch)
    assert step.ray_cluster is None and step.cluster == al.ClusterSpec.default()
    assert_close(out3.params, jax.jit(train_step)(jax.jit(train_step)(expected, batch), batch).params, "params")
    # a step sent to a cluster by hand keeps it, and says when it is gone
    with pytest.raises(al.LaunchError, match="was shut down.*alpa_lab.init"):
        tied.on_ray(cluster)(*tied_state())


def test_follow_parallel_and_inference_as_alpas_tests_run_them(no_session):
    """Alpa's tests/runtime/test_follow_parallel.py, all three cases on one ``init(cluster="ray")``: a train step
    returning the new state alone (on the mesh workers), an evaluation following it called as it is, on a batch
    twice the training batch; ShardParallel, with gradient accumulation, and PipeshardParallel with
    ``AutoLayerOption(layer_num=2)`` (an inference pipeline over the train step's stages). Then, on the same
    session, tests/pipeline_parallel/test_inference_only.py's MLP (an inference step taking the whole train
    state) and its test_output (no arguments, constant results): inference pipelines plan for the session's
    cluster and run in this process. Oracle: ``jax.jit`` / the unparallelized function."""
    pytest.importorskip("ray")

    class Model(nn.Module):
        @nn.compact
        def __call__(self, x):
            for features in (8, 8, 8, 8):
                x = nn.Dense(features)(x)
            return x

    def create_state():
        model = Model()
        return TrainState.create(apply_fn=model.apply, params=model.init(jax.random.PRNGKey(0), jnp.ones((1, 8))),
                                 tx=optax.adam(1e-2))

    def step(state, batch):
        grads = al.grad(lambda p: jnp.mean((state.apply_fn(p, batch["x"]) - batch["y"]) ** 2))(state.params)
        return state.apply_gradients(grads=grads)

    def evaluate(params, batch):
        return jnp.mean((Model().apply(params, batch["x"]) - batch["y"]) ** 2)

    rng = np.random.default_rng(0)
    train_batch = {"x": jnp.asarray(rng.standard_normal((32, 8)), jnp.float32), "y": jnp.ones((32, 8))}
    eval_batch = {"x": jnp.asarray(rng.standard_normal((64, 8)), jnp.float32), "y": jnp.ones((64, 8))}
    expected = jax.jit(step)(create_state(), train_batch)
    al.init(cluster="ray")
    try:
        for method, micro in ((al.ShardParallel(num_micro_batches=None), None), (al.ShardParallel(num_micro_batches=2), 2),
                              (al.PipeshardParallel(num_micro_batches=2, layer_option=al.AutoLayerOption(layer_num=2)), 2)):
            train_step = al.parallelize(step, method=method)
            eval_step = al.parallelize(evaluate, method=al.FollowParallel(train_step, num_micro_batches=micro))
            state = train_step(create_state(), train_batch)
            out = eval_step(state.params, eval_batch)
            assert train_step.ray_cluster is not None and eval_step.ray_cluster is None, method
            assert float(out) == pytest.approx(float(evaluate(expected.params, eval_batch)), rel=1e-4), method
            actual = jax.tree_util.tree_leaves(eval_step.get_last_executable().get_input_placement_specs()[0])
            followed = jax.tree_util.tree_leaves(train_step.get_last_executable().get_input_placement_specs()[0].params)
            if micro is None or isinstance(method, al.ShardParallel):
                assert actual == followed, method
            else:  # the same meshes and layouts; the avals are the evaluation's
                assert [(a.mesh_ids, a.sharding_specs) for a in actual] == [(b.mesh_ids, b.sharding_specs) for b in followed]

        state, batch = mlp_state(hidden=16, batch=64)

        def inference_step(state, batch):
            out = state.apply_fn(state.params, batch["x"])
            return out, jnp.mean((out - batch["y"]) ** 2)

        method = al.PipeshardParallel(num_micro_batches=4, pipeline_schedule="inference", layer_option="manual")
        p_infer = al.parallelize(inference_step, method=method, donate_argnums=())
        executable = p_infer.get_executable(state, batch)
        assert_close(p_infer(state, batch), inference_step(state, batch), "inference")
        assert p_infer.ray_cluster is None and p_infer.cluster == al.get_global_cluster().spec
        assert len(executable.get_hlo_text()) == 2  # each stage's forward program (its backward runs nothing)

        @al.parallelize(method=al.PipeshardParallel(num_micro_batches=1, pipeline_schedule="inference", layer_option="manual"))
        def func():
            a = jnp.ones(32)
            al.mark_pipeline_boundary()
            b = jnp.ones(32) * 2
            return a, b, 3

        a, b, c = func()
        np.testing.assert_array_equal(np.asarray(a), np.ones(32))
        np.testing.assert_array_equal(np.asarray(b), np.ones(32) * 2)
        assert int(c) == 3
        with pytest.raises(ValueError, match="no batch argument to cut into 2 micro-batches"):
            al.parallelize(func.fn, method=al.PipeshardParallel(num_micro_batches=2, pipeline_schedule="inference",
                                                                layer_option="manual"))()
    finally:
        al.shutdown()


def test_a_virtual_mesh_plans_for_part_of_the_cluster_and_runs_there(no_session):
    """Alpa's benchmarks: ``get_global_cluster().get_virtual_physical_mesh(host_ids, num_devices_per_host)`` as a
    method's ``devices=`` or set globally: the step plans for that part of the Ray cluster (its hardware, fewer
    devices) and runs on the mesh workers there, with the same numerics as ``jax.jit``."""
    pytest.importorskip("ray")
    state, batch = mlp_state(hidden=64, batch=32)
    expected = jax.jit(train_step)(state, batch)
    cluster = al.init(cluster="ray")
    try:
        whole = al.get_global_virtual_physical_mesh()
        assert (whole.shape, whole.num_devices, whole.spec) == ((2, 4), 8, cluster.spec)
        half = cluster.get_virtual_physical_mesh(host_ids=[1], num_devices_per_host=4)
        assert half.shape == (1, 4) and half.host_ids == (1,)
        assert cluster.get_virtual_physical_mesh(host_ids=np.arange(2), num_devices_per_host=np.int64(2)).shape == (2, 2)
        step = al.parallelize(train_step, method=al.PipeshardParallel(devices=half, num_micro_batches=2, layer_option="manual"))
        out = step(state, batch)
        plan = step.current_plan
        assert (plan.cluster["hosts"], plan.cluster["devices_per_host"]) == (1, 4) and step.cluster == cluster.spec.part(1, 4)
        assert step.ray_cluster is cluster and [len(w.devices) for w in step.ray_run.workers] == [2, 2]
        assert_close(out.params, expected.params, "params on 1x4 of the 2x4 cluster")
        # set globally: steps without devices plan for it (and a step that already planned for all of it plans again)
        plain = al.parallelize(train_step, method=al.PipeshardParallel(num_micro_batches=2, layer_option="manual"))
        assert plain.cluster == cluster.spec and al.get_global_num_devices() == 8
        al.set_global_virtual_physical_mesh(cluster.get_virtual_physical_mesh(num_devices_per_host=2))
        assert al.get_global_num_devices() == 4 and al.get_global_virtual_physical_mesh().shape == (2, 2)
        assert al.get_global_physical_mesh() is None  # as Alpa's: made when asked for
        made = al.get_global_physical_mesh(create_if_not_exist=True)
        assert made == al.get_global_virtual_physical_mesh() and al.get_global_physical_mesh() is made  # where steps run
        out = plain(state, batch)
        assert plain.cluster == cluster.spec.part(2, 2) and plain.ray_cluster is cluster
        assert sorted(w.hosts for w in plain.ray_run.workers) == [(0,), (1,)]  # one stage per host, 2 devices each
        assert_close(out.params, expected.params, "params on 2x2 of the 2x4 cluster")
        al.set_global_virtual_physical_mesh(None)
        assert plain.cluster == cluster.spec and al.get_global_num_devices() == 8
        with pytest.raises(ValueError, match=r"host_ids must be distinct hosts of the cluster's 2 \(0\.\.1\), got \[2\]"):
            cluster.get_virtual_physical_mesh(host_ids=[2])
        with pytest.raises(ValueError, match=r"num_devices_per_host must be 1\.\.4 .* got 8"):
            cluster.get_virtual_physical_mesh(num_devices_per_host=8)
        for bad in ([0, 0], 1, [True], []):
            with pytest.raises(ValueError, match="host_ids must be distinct hosts"):
                cluster.get_virtual_physical_mesh(host_ids=bad)
        with pytest.raises(TypeError, match="takes get_global_cluster"):
            al.set_global_virtual_physical_mesh((1, 4))
        with pytest.raises(al.MethodOptionError, match=r"devices=\.\.\.\) takes a list of JAX devices, a LogicalDeviceMesh.*got tuple"):
            al.parallelize(train_step, method=al.PipeshardParallel(devices=(1, 4)))
    finally:
        al.shutdown()
    assert al.get_global_virtual_physical_mesh() is None
    with pytest.raises(RuntimeError, match="not of this session's Ray cluster"):
        al.set_global_virtual_physical_mesh(half)
    with pytest.raises(al.MethodOptionError, match="Ray cluster was shut down"):
        al.parallelize(train_step, method=al.PipeshardParallel(devices=half))


def test_pipeshard_plans_for_a_local_or_logical_mesh_as_devices():
    """``PipeshardParallel(devices=...)`` with this process's devices: a physical mesh is that many devices of this
    machine; a logical mesh is its grid (hosts x devices) with Alpa's alpha-beta costs, each stage viewing it its way."""
    state, batch = mlp_state(hidden=64, batch=32)
    physical = al.LocalPhysicalDeviceMesh(jax.devices()[:4])
    step = al.parallelize(train_step, method=al.PipeshardParallel(devices=physical, num_micro_batches=2, layer_option="manual"))
    out = step(state, batch)
    assert step.cluster == al.ClusterSpec.local(1, 4) and step.ray_cluster is None
    assert all(d < 4 for st in step.current_plan.stages for d in st.device_ids)
    assert_close(out.params, jax.jit(train_step)(state, batch).params, "params")
    logical = physical.get_logical_mesh((2, 2), mesh_alpha=(1.0, 1.0), mesh_beta=(1.0, 0.1))
    grid = al.parallelize(train_step, method=al.PipeshardParallel(devices=logical, num_micro_batches=2, layer_option="manual"))
    grid.plan(state, batch)
    assert grid.cluster == logical.cluster_spec() and (grid.cluster.hosts, grid.cluster.devices_per_host) == (2, 2)


def test_sessions_on_a_ray_the_user_runs(no_session):
    """Alpa's set-up / tear-down around a step made once (module level): init joins the Ray this process runs,
    the step runs there, shutdown stops what runs there (a training run keeps its state) and leaves the user's
    Ray running, and the next init's session gets the same step again."""
    ray = pytest.importorskip("ray")
    state, batch = mlp_state(hidden=64, batch=32)
    step = al.parallelize(train_step, method=al.PipeshardParallel(num_micro_batches=2, layer_option="manual"))
    mine = al.RayCluster.local(1, 4)
    try:
        first = al.init("ray")
        assert first is not mine and (first.num_hosts, first.num_devices_per_host, first.num_devices) == (1, 4, 4)
        out = step(state, batch)
        assert step.ray_cluster is first and step.cluster == first.spec
        assert [st.submesh_shape for st in step.current_plan.stages] == [(1, 2), (1, 2)]
        assert_close(out.params, jax.jit(train_step)(state, batch).params, "params")
        run = step.train(out, batch, steps=10_000)  # the new state alone is what the step returns
        deadline = time.time() + 120
        while run.monitor.steps_done < 2 and run.running and time.time() < deadline:
            time.sleep(0.2)
        assert run.running, run.error
        al.shutdown()
        assert not run.running and run.status == "stopped" and run.state_step >= 2
        assert ray.is_initialized() and not mine._closed  # the user's Ray runs on
        second = al.init("ray")
        again = step(out, batch)  # the same step, in the new session: nothing to re-plan (the same cluster)
        assert step.ray_cluster is second
        assert_close(again.params, jax.jit(train_step)(out, batch).params, "params")
        al.shutdown()
        assert ray.is_initialized()
    finally:
        if _SESSION.kind is not None:
            al.shutdown()
        mine.shutdown()
    assert not ray.is_initialized()


def test_method_objects_take_the_batch_from_argument_1():
    """Alpa's ``batch_argnums=(1,)``: a step returning gradients (so its state is not recognised as state) whose
    weights outnumber the batch's leaves with another leading size cuts the batch, not the weights."""

    def grad_step(state, batch):
        def loss_func(params, x, y):
            return jnp.mean((state.apply_fn(params, x) - y) ** 2)

        return al.grad(loss_func)(state.params, batch["x"], batch["y"])

    state, batch = mlp_state(hidden=128, batch=32)
    step = al.parallelize(grad_step, method=al.PipeshardParallel(num_micro_batches=2, layer_option="manual"))
    grads = step(state, batch)
    assert sorted(step.current_plan.split_inputs) == ["[1]['x']", "[1]['y']"]
    assert_close(grads, jax.jit(grad_step)(state, batch), "grads")
    alpa_default = al.parallelize(grad_step, method=None, microbatches=2, layers=2)  # Alpa's parallelize(fn): the same rule
    alpa_default(state, batch)
    assert sorted(alpa_default.current_plan.split_inputs) == ["[1]['x']", "[1]['y']"]
    with pytest.raises(ValueError, match=r"batch_argnums=\(0,\)"):  # named otherwise: as named (here: refused)
        al.parallelize(grad_step, batch_argnums=(0,), method=al.PipeshardParallel(num_micro_batches=2, layer_option="manual"))(state, batch)


def test_executable_as_alpa_tests_read_it(tmp_path):
    def step(w, x):
        loss = lambda w: jnp.mean((x @ w) ** 2)  # noqa: E731
        return w - 0.1 * jax.grad(loss)(w), loss(w)

    w, x = jnp.ones((64, 64)), jnp.ones((256, 64))
    p = al.parallelize(step, method=al.DataParallel())
    p(w, x)
    ex = p.get_last_executable()
    hlo = ex.get_hlo_text()
    total, all_reduce, all_gather, reduce_scatter, all_to_all = al.count_communication_primitives(hlo)
    # data parallel on 8 devices: the weight gradient (and the loss) summed over the devices, nothing else
    assert all_reduce >= 1 and (all_gather, reduce_scatter, all_to_all) == (0, 0, 0) and total == all_reduce
    assert ex.auto_sharding_objective == pytest.approx(p.current_plan.objective - p.current_plan.compute_cost)
    size = ex.get_total_allocation_size()
    # at least the replicated weight in and out and the device's batch tile; far less than the whole batch 8 times
    assert 2 * w.nbytes + x.nbytes // 8 <= size < 8 * x.nbytes
    files = ex.dump_debug_info(str(tmp_path / "dump"))
    assert [os.path.basename(f) for f in files] == ["plan.json", "program.hlo"]
    assert al.Plan.load(files[0]).to_json() == p.current_plan.to_json()
    assert "all-reduce" in open(files[1]).read()
    json.loads(open(files[0]).read())  # plans are JSON


def test_execution_time_costs_and_presharded_args():
    """Alpa's benchmark loop: preshard, call n times, sync, read the costs. Each call's seconds are disjoint
    (a call is timed from when the one before finished), so together they fit in the loop's wall time."""

    def step(w, x):
        loss = lambda w: jnp.mean(jnp.tanh(x @ w) ** 2)  # noqa: E731
        return w - 0.1 * jax.grad(loss)(w), loss(w)

    p = al.parallelize(step, method=al.DataParallel())
    w, x = p.preshard_dynamic_args(jnp.ones((128, 128)), jnp.ones((256, 128)))
    ex = p.get_executable(w, x)
    assert (w.sharding, x.sharding) == tuple(ex.compiled.in_shardings)
    t0 = time.perf_counter()
    for _ in range(5):
        w, loss = p(w, x)
    ex.sync()
    wall = time.perf_counter() - t0
    costs = ex.get_execution_time_costs()
    assert len(costs) == 5 and all(c > 0 for c in costs) and sum(costs) <= wall
    assert ex.get_execution_time_costs(warmup=2) == costs[2:]
    with pytest.raises(ValueError, match="only the whole call is timed"):
        ex.get_execution_time_costs(timer_name="compute")
    # Alpa's other timing: the program on zeros of its shapes, apart from the step's calls and its arguments
    w_before = np.asarray(w)
    dummy = ex.profile_with_dummy_inputs(warmup=1, repeat=3)
    assert len(dummy) == 3 and all(c > 0 for c in dummy)
    assert len(ex.get_execution_time_costs()) == 5
    np.testing.assert_array_equal(np.asarray(w), w_before)
    with pytest.raises(ValueError, match="repeat"):
        ex.profile_with_dummy_inputs(repeat=0)
    # another plan of the step (its own calls' costs): the plan read back from its JSON (a data-parallel plan takes
    # almost no pin on a line of devices: it forbids the all-gathers and all-to-alls other layouts would need)
    p.use(al.Plan.from_json(p.current_plan.to_json()), w, x)
    p(w, x)
    p.get_last_executable().sync()
    assert len(p.get_last_executable().get_execution_time_costs()) == 1  # per plan
    assert len(ex.get_execution_time_costs()) == 5


def test_pipeline_executable_dump_and_counts(tmp_path):
    state, batch = mlp_state(hidden=64, batch=32)
    p = al.parallelize(train_step, method=al.PipeshardParallel(num_micro_batches=2, layer_option="manual"))
    p(state, batch)
    ex = p.get_last_executable()
    texts = ex.get_hlo_text()
    assert isinstance(texts, list) and al.count_communication_primitives(texts)[0] == sum(
        al.count_communication_primitives(t)[0] for t in texts)
    assert ex.auto_sharding_objective is None
    with pytest.raises(ValueError, match="per mesh"):
        ex.get_total_allocation_size()
    files = ex.dump_debug_info(str(tmp_path))
    assert os.path.basename(files[0]) == "plan.json" and any("stage1_backward" in f for f in files)
    assert len(ex.profile_with_dummy_inputs(warmup=1, repeat=2)) == 2  # a whole step of micro-batches on zeros


HLO = """
  %all-reduce.1 = f32[] all-reduce(f32[] %loss), channel_id=1, replica_groups={{0,1}}, to_apply=%add
  %all-reduce-start.2 = (f32[64]{0}, f32[]) all-reduce-start(%g, %l), channel_id=2, to_apply=%add
  %all-reduce-done.2 = (f32[64]{0}, f32[]) all-reduce-done(%all-reduce-start.2)
  %all-gather.3 = f32[64,8]{1,0} all-gather(f32[8,8]{1,0} %all-reduce.1), channel_id=3, dimensions={0}
  %reduce-scatter = f32[8]{0} reduce-scatter(f32[64]{0} %p), channel_id=4, dimensions={0}, to_apply=%add
  %all-to-all = (f32[8]{0}, f32[8]{0}) all-to-all(%a, %b), channel_id=5
  %all-reduce.7 = (f32[], f32[], f32[], f32[], f32[], /*index=5*/f32[]) all-reduce(%a, %b, %c, %d, %e, %f), channel_id=7
  %collective-permute = f32[8]{0} collective-permute(%c), channel_id=6, source_target_pairs={{0,1}}
  %add.9 = f32[8]{0} add(%all-gather.3, %all-to-all)
"""


def test_count_communication_primitives_counts_instructions():
    assert al.count_communication_primitives(HLO) == (7, 3, 1, 1, 1)
    assert al.count_communication_primitives(HLO, ignore_scalar_all_reduce=True) == (5, 1, 1, 1, 1)
    assert al.count_communication_primitives([HLO, HLO]) == (14, 6, 2, 2, 2)


def test_clear_executable_cache_replans_own_plans_and_keeps_edited_ones():
    state, batch = mlp_state(hidden=64, batch=32)
    own = al.parallelize(train_step, method=al.ShardParallel())
    own(state, batch)
    first = own.current_plan
    edited = al.parallelize(train_step, method=al.ShardParallel())
    edited.plan(state, batch)
    plan = edited.current_plan
    dot = next(o for o in plan.ops if o.primitive == "dot_general")
    other = next(a.strategy for a in plan.explain(dot.name).alternatives if a.strategy != dot.strategy)
    pinned = edited.pin(dot.name, other)
    al.clear_executable_cache()
    assert own.current_plan is None and edited.current_plan is pinned
    assert not own._compiled and not edited._compiled
    out = own(state, batch)
    again = own.current_plan
    assert again is not first and [(o.name, o.strategy) for o in again.ops] == [(o.name, o.strategy) for o in first.ops]
    assert_close(out.params, jax.jit(train_step)(state, batch).params, "params")
    np.testing.assert_allclose(edited(state, batch).params["params"]["Dense_0"]["bias"],
                               out.params["params"]["Dense_0"]["bias"], rtol=1e-4, atol=1e-5)


def test_state_only_step_keeps_its_parameters_apart_from_optimizer_state():
    """ZeRO-2 splits the optimizer state, not the parameters, also when the step returns its new state alone
    (no loss reported: the gradients al.grad marks say which state the forward reads)."""
    model = nn.Dense(64)
    x, y = jnp.ones((32, 64)), jnp.ones((32, 64))
    state = TrainState.create(apply_fn=model.apply, params=model.init(jax.random.PRNGKey(0), x), tx=optax.adam(1e-2))

    def loss_fn(params, b):
        return jnp.mean((state.apply_fn(params, b["x"]) - b["y"]) ** 2)

    def step(state, b):
        return state.apply_gradients(grads=al.grad(loss_fn)(state.params, b))

    for method, split in ((al.Zero2Parallel(), False), (al.Zero3Parallel(), True)):
        p = al.parallelize(step, cluster=al.ClusterSpec.local(1, 4), mesh_shape=(1, 4), method=method)
        out = p(state, {"x": x, "y": y})
        kernel = out.params["params"]["kernel"]
        assert any(kernel.sharding.spec) == split, (type(method).__name__, kernel.sharding.spec)
        assert any(out.opt_state[0].mu["params"]["kernel"].sharding.spec)  # Adam's moments split in both
        assert_close(out.params, jax.jit(step)(state, {"x": x, "y": y}).params, "params")


def test_alpa_batch_passes_a_key_in_the_batch_whole():
    """Alpa's BERT tests carry the dropout key in the batch dict: with Alpa's default batch (argument 1) the
    leaves of another leading size are passed whole, as the shape rule does (a named batch still refuses)."""

    def step(w, batch):
        keep = jax.random.bernoulli(batch["rng"], 0.9, batch["x"].shape)
        loss = lambda w: jnp.mean((jnp.where(keep, batch["x"], 0.0) @ w) ** 2)  # noqa: E731
        return w - 0.1 * jax.grad(loss)(w), loss(w)

    w, batch = jnp.ones((16, 16)), {"x": jnp.ones((8, 16)), "rng": jax.random.PRNGKey(0)}
    for method in (al.ShardParallel(), None, al.DataParallel()):
        out, loss = al.parallelize(step, cluster=al.ClusterSpec.local(1, 4), method=method)(w, batch)
        ref, ref_loss = jax.jit(step)(w, batch)
        assert_close(loss, ref_loss, "loss")
        assert_close(out, ref, "w")
    with pytest.raises(ValueError, match="different leading sizes"):
        al.parallelize(step, cluster=al.ClusterSpec.local(1, 4), batch_argnums=(1,))(w, batch)


def test_python_value_argument_says_to_close_over_it():
    def step(x, times):  # a Python number the step branches on (a bool is static: Alpa's "auto" rule)
        return x * 2 if times > 1 else x

    with pytest.raises(al.TraceError, match=r"argument 1 \(2\) is a Python value.*functools.partial"):
        al.parallelize(step, method=al.ShardParallel())(jnp.ones((8, 8)), 2)
    with pytest.raises(al.TraceError, match=r"argument 1 \(2\) is a Python value"):  # pipelined: under its wrapper
        al.parallelize(step, microbatches=2)(jnp.ones((8, 8)), 2)


def test_jax_grad_around_a_boundary_says_to_use_alpa_grad():
    def loss(w, x):
        h = jnp.tanh(x @ w)
        al.mark_pipeline_boundary()
        return jnp.mean(h @ w)

    def step(w, x):
        return w - 0.1 * jax.grad(loss)(w, x)

    p = al.parallelize(step, method=al.PipeshardParallel(num_micro_batches=2, layer_option="manual"))
    with pytest.raises(al.TraceError, match="inside a gradient that jax.grad.*alpa_lab.grad.*manual_layer_construction"):
        p(jnp.ones((8, 8)), jnp.ones((16, 8)))


class LinearMLP(nn.Module):
    """Alpa's testing MLP: Dense layers without activations, the boundary after the first half."""

    hidden: int = 16

    @nn.compact
    def __call__(self, x):
        for i in range(4):
            x = nn.Dense(self.hidden)(x)
            if i == 1:
                al.mark_pipeline_boundary()
        return x


def reduce_scatter_pipeline(step, state, batch):
    """Alpa's test_reduce_scatter set-up: ``step`` pipelined at its boundaries over 4 micro-batches with
    ``force_data_parallel`` and ``prefer_reduce_scatter``; the parallel step and, per unit task in Alpa's order
    (forwards, backwards, updates), the collectives XLA compiled (scalar all-reduces left out, as Alpa's test)."""
    method = al.PipeshardParallel(
        num_micro_batches=4, layer_option="manual", stage_option=al.UniformStageOption(),
        default_auto_sharding_option=al.AutoShardingOption(force_data_parallel=True, prefer_reduce_scatter=True))
    p = al.parallelize(step, method=method)
    texts = p.get_executable(state, batch).get_hlo_text()
    return p, [al.count_communication_primitives(t, ignore_scalar_all_reduce=True) for t in texts]


def test_force_data_parallel_pipeline_communicates_only_for_gradients():
    """Alpa's test_reduce_scatter (MLP): with ``force_data_parallel`` and ``prefer_reduce_scatter`` every stage is
    data parallel end to end, the activations it receives split over the batch as its inputs are. Oracle: XLA's
    compiled HLO in Alpa's order: forward tasks without a collective (before, the second stage received its
    activation whole and split its layers by columns: an all-gather and an all-reduce in its forward), each
    backward one gradient all-reduce (CPU lowers the reduce-scatter so), each update one all-gather of its new
    weights (split with the momentum, ZeRO-2), as Alpa's: the weights are gathered together
    (``sharding.constraints._combined_gathers``; before, one all-gather each, 4 per update)."""
    x = jax.random.normal(jax.random.PRNGKey(0), (64, 16))
    model = LinearMLP()
    state = TrainState.create(apply_fn=model.apply, params=model.init(jax.random.PRNGKey(0), x),
                              tx=optax.sgd(1e-2, momentum=0.9))
    batch = {"x": x, "y": jnp.sin(x)}
    p, counts = reduce_scatter_pipeline(train_step, state, batch)
    assert len(counts) == 6
    assert counts[0][0] == 0 and counts[1][0] == 0, counts  # forward of stages 0 and 1
    assert counts[2][:2] == (1, 1) and counts[3][:2] == (1, 1), counts  # backward: one all-reduce each
    assert counts[4] == counts[5] == (1, 0, 1, 0, 0), counts  # updates: one all-gather each
    assert_close(jax.jit(train_step)(state, batch).params, p(state, batch).params, "params")


@pytest.mark.parametrize("micro_batches,remat,layer_option", [(1, False, None), (1, False, "manual"), (4, True, "manual")])
def test_jax_grad_of_a_manual_layer_construction_loss_pipelines(micro_batches, remat, layer_option):
    """Alpa's pipeline test_mlp as written for Alpa: ``jax.grad`` (not ``alpa.grad``) of a loss decorated with
    ``@manual_layer_construction``, a ``mark_pipeline_boundary()`` in the model, ``PipeshardParallel()`` as it
    comes (or its manual layer option): the step is cut there into two stages (with ``remat_layer``, each under
    ``jax.checkpoint``), and its gradients equal ``jax.jit``'s. (Before, jax.grad could not be cut there.)"""
    state, batch = mlp_state(hidden=64, batch=64)

    def train_step(state, batch):
        @al.manual_layer_construction
        def loss_func(params, x, y):
            return jnp.mean((state.apply_fn(params, x) - y) ** 2)

        return jax.grad(loss_func)(state.params, batch["x"], batch["y"])

    method = (al.PipeshardParallel() if layer_option is None else
              al.PipeshardParallel(num_micro_batches=micro_batches, layer_option=al.ManualLayerOption(remat_layer=remat)))
    p = al.parallelize(train_step, donate_argnums=(), method=method)
    assert_close(jax.jit(train_step)(state, batch), p(state, batch), "gradients")
    plan = p.current_plan
    assert plan.num_layers == 2 and plan.num_stages == 2
    if remat:  # only each layer's input is kept for the backward, as without the decorator under alpa.grad
        plain = al.parallelize(train_step, donate_argnums=(), method=al.PipeshardParallel(
            num_micro_batches=micro_batches, layer_option="manual")).plan(state, batch)
        assert plan.stages[0].activation_memory < 0.7 * plain.stages[0].activation_memory


def test_layer_construction_decorators_refuse_what_they_cannot_do():
    with pytest.raises(ValueError, match="static_argnums"):
        al.manual_layer_construction(static_argnums=(1,))
    with pytest.raises(ValueError, match="layer_num"):
        al.automatic_layer_construction(layer_num=0)
    loss = al.manual_layer_construction(lift_markers=True, remat_layer=True)(lambda w: jnp.sum(w**2))
    assert float(jax.grad(loss)(jnp.ones(3))[0]) == 2.0  # outside a plan's trace: the loss itself
    assert float(jax.grad(al.automatic_layer_construction(lambda w: jnp.sum(w**3), layer_num=2))(jnp.ones(3))[0]) == 3.0


def test_jax_grad_of_an_automatic_layer_construction_loss_pipelines():
    """Alpa's ``@automatic_layer_construction(layer_num=4)`` on a loss without boundaries, differentiated by
    ``jax.grad``: the decorator's layer count wins over the method's (2), and the gradients equal ``jax.jit``'s."""
    keys = jax.random.split(jax.random.PRNGKey(1), 7)
    params = [jax.random.normal(k, (32, 32)) * 0.2 for k in keys[:6]]
    x = jax.random.normal(keys[6], (16, 32))

    def step(params, x):
        @functools.partial(al.automatic_layer_construction, layer_num=4)
        def loss_func(params, x):
            for w in params:
                x = jnp.tanh(x @ w)
            return jnp.mean(x**2)

        return jax.grad(loss_func)(params, x)

    p = al.parallelize(step, donate_argnums=(), method=al.PipeshardParallel(num_micro_batches=2))
    assert_close(jax.jit(step)(params, x), p(params, x), "gradients")
    assert p.current_plan.num_layers == 4



class BertLayer(nn.Module):
    """Alpa's testing BERT layer (``FlaxBertLayer``, deterministic), small: self-attention over heads under a padding
    mask (a batch argument every stage reads), then a feed-forward, each with its residual and layer norm."""

    hidden: int = 64
    heads: int = 4

    @nn.compact
    def __call__(self, hidden_states, attention_mask):
        B, S, H = hidden_states.shape
        head_dim = self.hidden // self.heads
        q = nn.Dense(self.hidden, name="query")(hidden_states)
        k = nn.Dense(self.hidden, name="key")(hidden_states)
        v = nn.Dense(self.hidden, name="value")(hidden_states)
        q, k, v = (t.reshape(B, S, self.heads, head_dim) for t in (q, k, v))
        bias = jnp.where(attention_mask[:, None, None, :] > 0, 0.0, -1e10).astype(jnp.float32)
        w = jax.nn.softmax(jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(head_dim).astype(jnp.float32) + bias, axis=-1)
        attn = nn.Dense(self.hidden, name="attn_out")(jnp.einsum("bhqk,bkhd->bqhd", w, v).reshape(B, S, H))
        x = nn.LayerNorm(epsilon=1e-12, name="ln1")(attn + hidden_states)
        h = nn.Dense(self.hidden, name="output")(jax.nn.gelu(nn.Dense(4 * self.hidden, name="intermediate")(x)))
        return (nn.LayerNorm(epsilon=1e-12, name="ln2")(h + x),)


class BertLayers(nn.Module):
    """Two such layers, the boundary between them."""

    def setup(self):
        self.layers = [BertLayer() for _ in range(2)]

    def __call__(self, x, attention_mask):
        x = self.layers[0](x, attention_mask)[0]
        al.mark_pipeline_boundary()
        return self.layers[1](x, attention_mask)[0]


def test_force_data_parallel_keeps_attention_layers_data_parallel_inside():
    """Alpa's test_reduce_scatter (BERT): with ``force_data_parallel`` the stages' forward tasks issue no collective.
    Restricting the arguments alone left the ILP free inside: the second stage split its attention over the heads
    (2 all-reduces, 2 all-gathers and an all-to-all in its forward). Each op that makes a tensor with a batch dimension
    now keeps it split over the mesh (``methods.batch_op_restrictions``). Oracle: XLA's compiled HLO; the parameters
    equal ``jax.jit``'s."""
    x = jax.random.normal(jax.random.PRNGKey(0), (16, 16, 64))
    batch = {"x": x, "y": jnp.sin(x), "mask": jnp.ones((16, 16), jnp.int8)}
    model = BertLayers()
    state = TrainState.create(apply_fn=model.apply, params=model.init(jax.random.PRNGKey(1), x, batch["mask"]),
                              tx=optax.sgd(1e-2, momentum=0.9))

    def step(state, batch):
        def loss_func(params):
            return jnp.mean((state.apply_fn(params, batch["x"], batch["mask"]) - batch["y"]) ** 2)

        loss, grads = al.value_and_grad(loss_func)(state.params)
        return state.apply_gradients(grads=grads), loss

    p, counts = reduce_scatter_pipeline(step, state, batch)
    assert len(counts) == 6
    assert counts[0][0] == 0 and counts[1][0] == 0, counts  # forward of stages 0 and 1
    assert_close(jax.jit(step)(state, batch)[0].params, p(state, batch)[0].params, "params")



def test_stage_execution_info_is_every_run_of_every_unit_task():
    """Alpa's ``get_stage_execution_info``: per unit task in ``get_hlo_text``'s order (forwards, backwards last stage
    first, updates), the (start, end, hosts, devices) of each run of the calls so far. Two stages, two micro-batches,
    two calls: 6 tasks, 4 runs of each forward and backward, 2 of each update. Oracle: the runtime's own records of
    each call (``last_timings``) and the dataflow (a micro-batch's forward on stage 1 starts after stage 0's ends)."""
    from alpa_lab.models import tiny_example
    from alpa_lab.runtime import pipeline as pipeline_runtime

    ex = tiny_example("mlp")
    step = al.parallelize(ex.train_step, cluster=al.ClusterSpec.local(2, 4), microbatches=2, layers=4)
    step.use(step.plan(*ex.args).pin_stages([[0, 1], [2, 3]], submeshes=[(1, 4), (1, 4)]))
    state, calls = ex.state, []
    for _ in range(2):
        state, _ = step(state, ex.batch)
        calls.append(step.compiled(*ex.args).last_timings["records"])
    executable = step.get_last_executable()
    info = executable.get_stage_execution_info()
    assert len(info) == 6 == len(executable.get_hlo_text())
    assert [len(runs) for runs in info] == [4, 4, 4, 4, 2, 2]
    assert all(a <= b for runs in info for a, b, *_ in runs)
    assert [runs[0][2:] for runs in info] == [((0,), (0, 1, 2, 3)), ((1,), (4, 5, 6, 7)), ((1,), (4, 5, 6, 7)),
                                              ((0,), (0, 1, 2, 3)), ((0,), (0, 1, 2, 3)), ((1,), (4, 5, 6, 7))]
    forward0, forward1 = info[0], info[1]
    for m in range(4):  # micro-batch m of the calls in turn: stage 1 reads what stage 0 made
        assert forward1[m][0] >= forward0[m][1]
    durations = sorted(b - a for r in calls for s, phase, mb, a, b in r if (s, phase) == (0, "forward"))
    assert sorted(b - a for a, b, *_ in forward0) == pytest.approx(durations, abs=1e-6)  # time.time()'s resolution
    cp = step.compiled(*ex.args)
    per_call = len(cp.tasks) * cp.num_microbatches + len(cp.update)
    assert len(cp.trace) == 2 and cp.trace.maxlen == pipeline_runtime.TRACE_RECORDS // per_call  # a bounded memory
    step.use(step.current_plan.with_schedule("gpipe"))  # the same tasks, another plan: none of its runs yet
    assert all(runs == [] for runs in step.get_last_executable().get_stage_execution_info())
    single = al.parallelize(ex.train_step, cluster=al.ClusterSpec.local(1, 4))
    single(ex.state, ex.batch)
    with pytest.raises(ValueError, match="no pipeline stages"):
        single.get_last_executable().get_stage_execution_info()


def test_stage_execution_info_of_a_step_on_ray_is_its_mesh_workers_runs():
    """Alpa's test_tracing: under ``init()`` (Ray) a two-stage MLP, two micro-batches, two calls: the runs are the
    mesh workers' RUN events (each worker's share of a stage merged into one run), in the same shape as in-process."""
    from alpa_lab.testing import get_mlp_train_state_and_step

    state, batch, train_step = get_mlp_train_state_and_step(batch_size=128, hidden_size=128, add_manual_pipeline_marker=True)
    al.init()
    try:
        step = al.parallelize(train_step, method=al.PipeshardParallel(num_micro_batches=2, layer_option="manual"))
        for _ in range(2):
            state, _ = step(state, batch)
        info = step.get_last_executable().get_stage_execution_info()
        stages = len(step.current_plan.stages)
        assert len(info) == 3 * stages
        assert [len(runs) for runs in info] == [4] * (2 * stages) + [2] * stages
        assert all(a <= b for runs in info for a, b, *_ in runs)
        assert all(runs == sorted(runs) for runs in info)
        assert {runs[0][3] for runs in info} == {tuple(st.device_ids) for st in step.current_plan.stages}
    finally:
        al.shutdown()
