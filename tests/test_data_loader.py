"""Alpa's ``DataLoader``: host batches put where the step's plan reads them, ``prefetch_size`` ahead.

Oracles: the placement specs themselves (each loaded leaf's sharding is the spec's, each device holds its tile
of the host array), the host batches (values equal), the same steps fed host batches (numerics equal), and
the input iterator's own count of what was taken (how far ahead the loader reads)."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.training.train_state import TrainState

import alpa_lab as al


class Model(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Dense(64)(x))
        al.mark_pipeline_boundary()
        return nn.Dense(16)(x)


def setup():
    rng = np.random.default_rng(0)
    batches = [{"x": rng.standard_normal((64, 32)).astype(np.float32), "y": rng.standard_normal((64, 16)).astype(np.float32)}
               for _ in range(4)]
    model = Model()
    state = TrainState.create(apply_fn=model.apply, params=model.init(jax.random.PRNGKey(0), batches[0]["x"]),
                              tx=optax.sgd(1e-2))

    def train_step(state, batch):
        grads = al.grad(lambda p: jnp.mean((state.apply_fn(p, batch["x"]) - batch["y"]) ** 2))(state.params)
        return state.apply_gradients(grads=grads)

    return state, batches, train_step


class Counted:
    """An iterator that counts the batches taken from it."""

    def __init__(self, items):
        self.items, self.taken = list(items), 0

    def __iter__(self):
        for item in self.items:
            self.taken += 1
            yield item


@pytest.mark.parametrize("method", ["data", "pipeshard"])
def test_batches_arrive_in_the_plans_layout_and_train_as_host_batches(method):
    state, batches, train_step = setup()
    m = al.DataParallel() if method == "data" else al.PipeshardParallel(num_micro_batches=2, layer_option="manual")
    step = al.parallelize(train_step, method=m)
    specs = step.get_executable(state, batches[0]).get_input_placement_specs()[1]
    source = Counted(batches)
    loader = al.DataLoader(source, specs, prefetch_size=2)
    fed, loaded = state, 0
    for got, host in zip(loader, batches):
        assert source.taken == min(loaded + 3, len(batches))  # the one in use and 2 ahead, already on their devices
        for x, h, spec in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(host),
                              jax.tree_util.tree_leaves(specs, is_leaf=lambda s: hasattr(s, "mesh_ids"))):
            assert x.sharding == spec.shardings[0]
            for shard in x.addressable_shards:  # each device holds its tile of the host array, no more
                np.testing.assert_array_equal(np.asarray(shard.data), h[shard.index])
        fed = step(fed, got)
        state = step(state, host)
        loaded += 1
    assert loaded == len(batches)
    for a, b in zip(jax.tree_util.tree_leaves(fed.params), jax.tree_util.tree_leaves(state.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    if method == "data":  # the batch split over the devices, as the data-parallel plan reads it
        assert jax.tree_util.tree_leaves(specs, is_leaf=lambda s: hasattr(s, "mesh_ids"))[0].sharding_specs[0].startswith("S")


def test_without_prefetch_each_batch_is_read_when_asked_for_and_bad_input_is_refused():
    state, batches, train_step = setup()
    step = al.parallelize(train_step, method=al.ShardParallel())
    specs = step.get_executable(state, batches[0]).get_input_placement_specs()[1]
    source = Counted(batches)
    for k, _ in enumerate(al.DataLoader(source, specs, prefetch_size=0)):
        assert source.taken == k + 1
    with pytest.raises(ValueError, match="prefetch_size must be a whole number"):
        al.DataLoader(batches, specs, prefetch_size=-1)
    with pytest.raises(ValueError, match="pytree of PlacementSpec"):
        al.DataLoader(batches, {"x": 3})
    with pytest.raises(ValueError, match="has 1 array leaves but the placement specs describe 2"):
        next(iter(al.DataLoader([{"x": batches[0]["x"]}], specs)))
    with pytest.raises(ValueError, match=r"batch leaf 0 has shape \(32, 32\) but its placement spec is for \(64, 32\)"):
        next(iter(al.DataLoader([{"x": batches[0]["x"][:32], "y": batches[0]["y"][:32]}], specs)))
    bare = jax.tree_util.tree_map(lambda s: al.PlacementSpec(s.aval, s.mesh_ids, s.sharding_specs), specs,
                                  is_leaf=lambda s: hasattr(s, "mesh_ids"))
    with pytest.raises(ValueError, match=r"has no shardings.*made by hand.*get_input_placement_specs\(\)\[1\]"):
        al.DataLoader(batches, bare)


def test_mesh_driver_data_loader_asks_for_every_sample_and_repeats():
    """Alpa's loader for per-host data: its ``input_iter_func(start, end, batch_size)`` is asked for all the samples
    (one process holds every device), the batches arrive placed and equal to the host's, and ``repeat`` starts over."""
    state, batches, train_step = setup()
    step = al.parallelize(train_step, method=al.DataParallel())
    specs = step.get_executable(state, batches[0]).get_input_placement_specs()[1]
    rng = np.random.default_rng(1)
    xs, ys = rng.standard_normal((256, 32)).astype(np.float32), rng.standard_normal((256, 16)).astype(np.float32)
    asked = []

    def input_iter_func(start, end, batch_size):
        asked.append((start, end, batch_size))
        for i in range(start, end, batch_size):
            yield {"x": xs[i:i + batch_size], "y": ys[i:i + batch_size]}

    loader = al.MeshDriverDataLoader(64, 256, input_iter_func, specs, prefetch_size=2)
    got = list(loader)
    assert asked == [(0, 256, 64)] and len(got) == len(loader) == 4
    for k, batch in enumerate(got):
        assert batch["x"].sharding == jax.tree_util.tree_leaves(specs, is_leaf=lambda s: hasattr(s, "mesh_ids"))[0].shardings[0]
        np.testing.assert_array_equal(np.asarray(batch["x"]), xs[64 * k:64 * (k + 1)])
    endless = iter(al.MeshDriverDataLoader(64, 256, input_iter_func, specs, repeat=True))
    again = [next(endless) for _ in range(6)]  # past the end: the first samples again
    np.testing.assert_array_equal(np.asarray(again[4]["x"]), xs[:64])
    asked.clear()
    assert len(list(al.MeshDriverDataLoader(64, 300, input_iter_func, specs))) == 4 and asked == [(0, 256, 64)]  # whole batches
    with pytest.raises(ValueError, match="batch_size must be a positive whole number"):
        al.MeshDriverDataLoader(0, 256, input_iter_func, specs)
    with pytest.raises(ValueError, match="yielded 1 batches, not the 4"):
        list(al.MeshDriverDataLoader(64, 256, lambda s, e, b: iter([{"x": xs[:64], "y": ys[:64]}]), specs))
