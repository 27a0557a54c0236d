"""``save_checkpoint`` / ``restore_checkpoint`` (Alpa's names, as its ``tests/runtime/test_save_load.py`` uses them):
a sharded state saved and read back where the plan keeps it. Oracles: the saved arrays' values, the plan's own
shardings (``plan.shardings``), and uninterrupted training (``jax.jit``)."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from test_alpa_state_methods import BATCH, close, create_state, leaves, train_step

import alpa_lab as al
from alpa_lab.models import tiny_example


def test_a_pipelined_state_restored_onto_its_stages_trains_on_like_an_uninterrupted_run(tmp_path):
    ex = tiny_example("mlp")
    p_train = al.parallelize(ex.train_step, microbatches=4, layers=4)
    p_train.use(p_train.plan(*ex.args).pin_stages([[0, 1], [2, 3]], submeshes=[(1, 4), (1, 4)]))
    state, _ = p_train(ex.state, ex.batch)
    path = al.save_checkpoint(tmp_path, state, 1)
    assert path == tmp_path / "checkpoint_1" and path.is_dir()
    uninterrupted, _ = p_train(state, ex.batch)
    specs = p_train.get_last_executable().get_input_placement_specs()[0]
    assert {s.mesh_ids[0] for s in leaves(specs)} == {0, 1}  # the state lies on both stages' meshes
    restored = al.restore_checkpoint(tmp_path, 1, specs)
    assert type(restored) is type(state) and close(restored, state, 0.0)
    plan = p_train.current_plan
    for x, sharding in zip(leaves(restored), leaves(plan.shardings(state, ex.batch)[0][0])):
        assert x.sharding == sharding  # read straight onto the stage meshes, in the plan's layout
    resumed, _ = p_train(restored, ex.batch)
    assert close(resumed, uninterrupted, 1e-6)
    # the same from arrays already placed, or from sharded ShapeDtypeStructs
    abstract = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)
    again = al.restore_checkpoint(tmp_path, 1, abstract)
    assert close(again, state, 0.0)
    assert close(al.restore_checkpoint(str(tmp_path), 1, state), state, 0.0)


def test_a_single_mesh_state_round_trips(tmp_path):
    p_train = al.parallelize(train_step, method=al.ShardParallel())
    state = p_train(create_state(), BATCH)
    al.save_checkpoint(tmp_path, state, 7)
    restored = al.restore_checkpoint(tmp_path, 7, p_train.get_last_executable().get_input_placement_specs()[0])
    assert close(restored, state, 0.0)
    assert [x.sharding for x in leaves(restored)] == [x.sharding for x in leaves(state)]
    for f in (tmp_path / "checkpoint_7").rglob("*"):  # no pickles: nothing loads code when read
        if f.is_file():
            assert f.read_bytes()[:1] != b"\x80" and f.suffix not in (".pkl", ".pickle"), f


def test_bad_checkpoints_and_placements_are_refused_by_name(tmp_path):
    p_train = al.parallelize(train_step, method=al.ShardParallel())
    state = p_train(create_state(), BATCH)
    specs = p_train.get_last_executable().get_input_placement_specs()[0]
    al.save_checkpoint(tmp_path, state, 3)
    with pytest.raises(al.CheckpointError, match="a checkpoint of step 3 exists"):
        al.save_checkpoint(tmp_path, state, 3)
    moved = jax.tree_util.tree_map(lambda x: x + 1, state)
    al.save_checkpoint(tmp_path, moved, 3, overwrite=True)
    assert close(al.restore_checkpoint(tmp_path, 3, specs), moved, 0.0)
    with pytest.raises(al.CheckpointError, match=r"no checkpoint of step 4 .*saved steps: \[3\]"):
        al.restore_checkpoint(tmp_path, 4, specs)
    with pytest.raises(al.CheckpointError, match="it holds none"):
        al.restore_checkpoint(tmp_path / "empty", 0, specs)
    for bad in (-1, True, 2.0, "3"):
        with pytest.raises(al.CheckpointError, match="step must be a non-negative integer"):
            al.save_checkpoint(tmp_path, state, bad)
    assert al.save_checkpoint(tmp_path, state, state.step) == tmp_path / f"checkpoint_{int(state.step)}"  # a JAX scalar
    assert close(al.restore_checkpoint(tmp_path, np.int64(int(state.step)), specs), state, 0.0)
    with pytest.raises(al.CheckpointError, match="local_cache_dir"):
        al.save_checkpoint(tmp_path, state, 5, "/tmp/cache")
    with pytest.raises(al.CheckpointError, match="arrays and numbers"):
        al.save_checkpoint(tmp_path, {"a": np.ones(3), "f": "text"}, 5)
    with pytest.raises(al.CheckpointError, match="places each leaf by a PlacementSpec"):
        al.restore_checkpoint(tmp_path, 3, jax.tree_util.tree_map(lambda x: "where?", state))
    with pytest.raises(al.CheckpointError, match="without shardings"):
        al.restore_checkpoint(tmp_path, 3, jax.tree_util.tree_map(
            lambda s: al.PlacementSpec(s.aval, s.mesh_ids, s.sharding_specs), specs, is_leaf=lambda x: isinstance(x, al.PlacementSpec)))
    other = {"w": jax.ShapeDtypeStruct((5, 5), np.float32, sharding=leaves(state)[1].sharding)}
    with pytest.raises(al.CheckpointError, match="does not match the placements given"):
        al.restore_checkpoint(tmp_path, 3, other)
