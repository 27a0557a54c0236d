"""Alpa's session and executable API as code written for Alpa uses it: ``init`` / ``shutdown`` (a real local
Ray), the batch argument Alpa assumes, ``get_last_executable()``'s objective, memory and debug dump, and
``count_communication_primitives`` on XLA's own HLO."""

from __future__ import annotations

import json
import os

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


@pytest.fixture
def no_session():
    yield
    if _SESSION.kind is not None:
        al.shutdown()


def test_init_local_and_its_errors(no_session):
    with pytest.raises(RuntimeError, match="without alpa_lab.init"):
        al.shutdown()
    with pytest.raises(ValueError, match="choose 'ray'.*or 'local'"):
        al.init("slurm")
    with pytest.raises(ValueError, match="num_nodes must be a positive integer"):
        al.init("ray", num_nodes=0)
    assert al.init("local") is None
    assert al.init("local") is None  # again with the same arguments: nothing happens (as Alpa's)
    with pytest.raises(RuntimeError, match=r"already called \('local'\).*shutdown\(\) before init\('ray'"):
        al.init("ray")
    assert al.get_global_cluster() is None and al.get_global_num_devices() == jax.device_count()
    state, batch = mlp_state()
    step = al.parallelize(train_step, method=al.ShardParallel())
    out = step(state, batch)
    assert step.ray_cluster is None  # "local": this process's devices
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
    finally:
        al.shutdown()
    assert not ray.is_initialized()
    with pytest.raises(al.LaunchError, match="was shut down.*alpa_lab.init"):
        step(out2, batch)
    assert al.get_global_cluster() is None


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
    assert ex.auto_sharding_objective == pytest.approx(p.current_plan.objective)
    size = ex.get_total_allocation_size()
    # at least the replicated weight in and out and the device's batch tile; far less than the whole batch 8 times
    assert 2 * w.nbytes + x.nbytes // 8 <= size < 8 * x.nbytes
    files = ex.dump_debug_info(str(tmp_path / "dump"))
    assert [os.path.basename(f) for f in files] == ["plan.json", "program.hlo"]
    assert al.Plan.load(files[0]).to_json() == p.current_plan.to_json()
    assert "all-reduce" in open(files[1]).read()
    json.loads(open(files[0]).read())  # plans are JSON


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


HLO = """
  %all-reduce.1 = f32[] all-reduce(f32[] %loss), channel_id=1, replica_groups={{0,1}}, to_apply=%add
  %all-reduce-start.2 = (f32[64]{0}, f32[]) all-reduce-start(%g, %l), channel_id=2, to_apply=%add
  %all-reduce-done.2 = (f32[64]{0}, f32[]) all-reduce-done(%all-reduce-start.2)
  %all-gather.3 = f32[64,8]{1,0} all-gather(f32[8,8]{1,0} %all-reduce.1), channel_id=3, dimensions={0}
  %reduce-scatter = f32[8]{0} reduce-scatter(f32[64]{0} %p), channel_id=4, dimensions={0}, to_apply=%add
  %all-to-all = (f32[8]{0}, f32[8]{0}) all-to-all(%a, %b), channel_id=5
  %collective-permute = f32[8]{0} collective-permute(%c), channel_id=6, source_target_pairs={{0,1}}
  %add.9 = f32[8]{0} add(%all-gather.3, %all-to-all)
"""


def test_count_communication_primitives_counts_instructions():
    assert al.count_communication_primitives(HLO) == (6, 2, 1, 1, 1)
    assert al.count_communication_primitives(HLO, ignore_scalar_all_reduce=True) == (5, 1, 1, 1, 1)
    assert al.count_communication_primitives([HLO, HLO]) == (12, 4, 2, 2, 2)


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
