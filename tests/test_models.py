"""The example models: each tiny config trains, keeps its state's structure, and has an
abstract twin with the same shapes (so large configs can be planned without memory)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from alpa_lab.models import (
    EXAMPLES,
    Example,
    GPTConfig,
    bert_config,
    gpt_config,
    make_gpt,
    make_mlp,
    make_mlp_nnx,
    make_moe,
    moe_config,
    tiny_example,
    wide_resnet_config,
)
from alpa_lab.models.common import TrainState
from alpa_lab.models.moe import MoEConfig

MAKERS = {name: family.make for name, family in EXAMPLES.items()} | {"mlp_nnx": make_mlp_nnx}


def leaf_specs(tree) -> list[tuple[tuple[int, ...], str]]:
    return [(tuple(x.shape), str(x.dtype)) for x in jax.tree_util.tree_leaves(tree)]


@pytest.fixture(scope="module", params=sorted(MAKERS))
def example(request) -> Example:
    return tiny_example(request.param)


def test_registry_lists_the_paper_families():
    assert set(EXAMPLES) == {"mlp", "gpt", "bert", "moe", "wide_resnet"}
    for name, (config_cls, make) in EXAMPLES.items():
        assert dataclasses.is_dataclass(config_cls) and config_cls.__dataclass_params__.frozen
        assert make(config_cls(), abstract=True).name == name


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_tiny_sizes_shard_over_8_devices(name):
    config = EXAMPLES[name].config()
    for field in ("batch", "hidden", "seq_len", "expert_hidden", "experts", "vocab", "num_classes"):
        if hasattr(config, field):
            assert getattr(config, field) % 8 == 0, (name, field)


def test_train_step_runs_and_loss_decreases(example):
    step = jax.jit(example.train_step)
    structure, specs = jax.tree_util.tree_structure(example.state), leaf_specs(example.state)
    state, losses = example.state, []
    for _ in range(3):
        state, loss = step(state, example.batch)
        assert isinstance(state, TrainState)
        assert jax.tree_util.tree_structure(state) == structure
        assert leaf_specs(state) == specs
        assert loss.shape == () and np.isfinite(float(loss))
        losses.append(float(loss))
    _, final = step(state, example.batch)
    assert float(final) < losses[0], (example.name, losses, float(final))
    assert all(np.all(np.isfinite(np.asarray(x))) for x in jax.tree_util.tree_leaves(state))
    old, new = jax.tree_util.tree_leaves(example.state.model_state), jax.tree_util.tree_leaves(state.model_state)
    assert any(not np.allclose(a, b) for a, b in zip(old, new)) == (example.name == "wide_resnet")  # batch_stats


def test_abstract_matches_concrete(example):
    abstract = MAKERS[example.name](example.config, abstract=True)
    assert abstract.abstract and not example.abstract
    for tree_a, tree_c in ((abstract.state, example.state), (abstract.batch, example.batch)):
        assert jax.tree_util.tree_structure(tree_a) == jax.tree_util.tree_structure(tree_c)
        assert all(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree_util.tree_leaves(tree_a))
        assert leaf_specs(tree_a) == leaf_specs(tree_c)


def test_batch_and_params_are_deterministic_in_the_seed():
    a, b, c = tiny_example("mlp"), make_mlp(), make_mlp(seed=1)
    same = jax.tree_util.tree_map(np.array_equal, (a.state, a.batch), (b.state, b.batch))
    assert all(jax.tree_util.tree_leaves(same))
    assert not np.array_equal(a.batch["x"], c.batch["x"])
    assert not np.array_equal(a.state.params["Dense_0"]["kernel"], c.state.params["Dense_0"]["kernel"])


def test_state_is_params_plus_optimizer_plus_model_state(example):
    n_params = len(jax.tree_util.tree_leaves(example.state.params))
    assert n_params > 0
    assert len(jax.tree_util.tree_leaves(example.state.opt_state)) >= n_params  # Adam: mu + nu; SGD: momentum
    if example.name == "wide_resnet":
        assert "batch_stats" in example.state.model_state
    else:
        assert example.state.model_state == {}


def test_benchmark_presets_plan_without_memory():
    gpt = make_gpt(gpt_config(), abstract=True)
    n = sum(x.size for x in jax.tree_util.tree_leaves(gpt.state.params))
    assert 350e6 < n < 360e6  # the paper's GPT-350M
    assert gpt.batch["tokens"].shape == (8, 1024)
    assert gpt_config(layers=4, hidden=512, heads=8, seq_len=128, batch=16).layers == 4
    assert bert_config().seq_len == 512 and moe_config().experts == 16
    assert wide_resnet_config().image_size == 224


def test_reduced_precision_params():
    ex = make_gpt(gpt_config(layers=1, hidden=64, heads=4, seq_len=16, vocab=128, dtype="bfloat16"), abstract=True)
    assert {x.dtype for x in jax.tree_util.tree_leaves(ex.state.params)} == {jnp.dtype("bfloat16")}
    _, loss = jax.eval_shape(ex.train_step, *ex.args)
    assert loss.dtype == jnp.float32


def test_gpt_head_can_be_tied_or_untied():
    tied = make_gpt(abstract=True).state.params
    untied = make_gpt(GPTConfig(tied_embeddings=False), abstract=True).state.params
    assert "lm_head" not in tied and untied["lm_head"]["kernel"].shape == (64, 128)


def test_moe_routes_through_an_expert_axis():
    config = MoEConfig()
    ex = make_moe(config, abstract=True)
    block = ex.state.params["Block_0"]["MoEFFN_0"]
    assert block["wi"].shape == (config.experts, config.hidden, config.expert_hidden)
    assert block["wo"].shape == (config.experts, config.expert_hidden, config.hidden)
    assert config.capacity == 4  # 2.0 * 16 tokens / 8 experts
