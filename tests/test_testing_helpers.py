"""``alpa_lab.testing``: Alpa's test helpers, checked as Alpa's own tests use them (parallel step against the serial
step, params rtol/atol 1e-3 as ``PipelineBasicTest`` checks them)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import alpa_lab as al
from alpa_lab.testing import (
    assert_allclose, data_loader_input_iter_func, get_bert_layer_train_state_and_step, get_mlp_train_state_and_step,
    mlp_inference_step,
)


LEARNING_RATE = 1e-2
"""Adam's learning rate in ``get_bert_layer_train_state_and_step`` (the MLP's SGD steps are smaller)."""


def run_against_serial(method, state, batch, train_step, steps):
    parallel = al.parallelize(train_step, method=method)
    expected = actual = state
    for step in range(1, steps + 1):
        expected, expected_val = jax.jit(train_step)(expected, batch)
        actual, actual_val = parallel(actual, batch)
        (exp_rest, exp_keys), (act_rest, act_keys) = _split_key_biases(expected.params), _split_key_biases(actual.params)
        assert_allclose(exp_rest, act_rest, 1e-3, 1e-3)
        # An attention's key bias has a zero gradient in exact arithmetic (softmax ignores a constant added to a row of
        # scores): what is left is rounding, which Adam's g / (|g| + eps) turns into a step of up to its learning rate,
        # either way on either side. So the two agree on it only to twice that per step (measured here: up to 1.1e-3
        # after one); this only guards against a blow-up, since the key bias cannot change the outputs.
        assert_allclose(exp_keys, act_keys, 0.0, 2 * LEARNING_RATE * step)
        assert_allclose(expected_val, actual_val, 1e-3, 1e-3)
    return parallel


def _split_key_biases(params):
    """(every parameter but the attention key biases, the key biases), by path."""
    rest, keys = {}, {}
    for path, leaf in jax.tree_util.tree_leaves_with_path(params):
        name = jax.tree_util.keystr(path)
        (keys if name.endswith("['key']['bias']") else rest)[name] = leaf
    return rest, keys


@pytest.mark.parametrize("manual", [True, False])
def test_mlp_pipelines_as_alpas_run_mlp(manual):
    state, batch, train_step = get_mlp_train_state_and_step(batch_size=64, hidden_size=16, num_layers=4,
                                                             add_manual_pipeline_marker=manual)
    layer_option = al.ManualLayerOption() if manual else al.AutoLayerOption(layer_num=2)
    method = al.PipeshardParallel(num_micro_batches=4, layer_option=layer_option, stage_option=al.UniformStageOption())
    parallel = run_against_serial(method, state, batch, train_step, steps=3)
    assert len(parallel.current_plan.stages) == 2
    out, loss = al.parallelize(mlp_inference_step, method=al.ShardParallel())(state, batch)
    assert out.shape == (64, 16) and float(loss) == pytest.approx(float(mlp_inference_step(state, batch)[1]), rel=1e-5)


@pytest.mark.parametrize("options", [{}, {"clip_by_global_norm": True, "use_dynamic_scale": True}])
def test_bert_layers_shard_and_pipeline(options):
    state, batch, train_step = get_bert_layer_train_state_and_step(
        batch_size=8, seq_len=16, num_layers=2, hidden_size=32, num_heads=2, add_manual_pipeline_marker=True, **options)
    assert (state.dynamic_scale is not None) == bool(options)
    run_against_serial(al.ShardParallel(), state, batch, train_step, steps=1)
    method = al.PipeshardParallel(num_micro_batches=2, layer_option="manual", stage_option="uniform")
    assert len(run_against_serial(method, state, batch, train_step, steps=1).current_plan.stages) == 2


def test_assert_allclose_can_fail_and_the_loader_data_is_alpas():
    state, _, _ = get_mlp_train_state_and_step(batch_size=8, hidden_size=4)
    assert_allclose(state, state)
    moved = jax.tree_util.tree_map(lambda p: p + 1.0, state.params)
    with pytest.raises(AssertionError):
        assert_allclose(state.params, moved)
    with pytest.raises(AssertionError):
        assert_allclose({"a": 1.0}, {"b": 1.0})
    batches = list(data_loader_input_iter_func(64, 200, 32))
    assert len(batches) == 4 and batches[0][0][0, 0] == 64 * 32 and batches[-1][1][-1] == 64 + 4 * 32 - 1
    assert all(x.shape == (32, 32) and x.dtype == np.float32 and y.dtype == np.int32 for x, y in batches)


def test_a_dynamic_loss_scale_pipelines_and_skips_non_finite_steps():
    """Flax's ``DynamicScale`` differentiates with ``jax.value_and_grad``, where an argument-less boundary cannot be
    mirrored, so the helper's own ``use_dynamic_scale=True`` step refused to pipeline; ``al.DynamicScale`` (Alpa's
    own, for that reason) takes the gradient with ``al.value_and_grad``. Oracles: the same step with Flax's
    ``DynamicScale`` under ``jax.jit`` (params 1e-3, the scale and its counter exactly); a NaN in the batch leaves
    the weights as they were and halves the scale, as Flax's rule does."""
    from flax.training.dynamic_scale import DynamicScale as FlaxDynamicScale
    from flax.training.dynamic_scale import DynamicScaleResult as FlaxDynamicScaleResult

    state, batch, step = get_bert_layer_train_state_and_step(8, 16, 2, 32, 4, use_dynamic_scale=True,
                                                             add_manual_pipeline_marker=True)
    assert isinstance(state.dynamic_scale, al.DynamicScale)
    result = al.DynamicScale().value_and_grad(lambda w: (w ** 2).sum(), has_aux=False)(jnp.ones(3))
    assert isinstance(result, FlaxDynamicScaleResult) and result.grad.tolist() == [2.0] * 3 and bool(result.finite)
    method = al.PipeshardParallel(num_micro_batches=2, layer_option="manual")
    parallel = al.parallelize(step, method=method)
    flax_state = state.replace(dynamic_scale=FlaxDynamicScale())
    for bad in (False, True):
        data = dict(batch, x=batch["x"].at[0, 0, 0].set(np.nan)) if bad else batch
        want, want_loss = jax.jit(step)(flax_state, data)
        got, loss = parallel(state, data)
        assert_allclose(want.params, got.params, 1e-3, 1e-3)
        assert float(got.dynamic_scale.scale) == float(want.dynamic_scale.scale) == (32768.0 if bad else 65536.0)
        assert int(got.dynamic_scale.fin_steps) == int(want.dynamic_scale.fin_steps) == (0 if bad else 1)
        if bad:
            assert_allclose(state.params, got.params, 0, 0)
        else:
            assert_allclose(want_loss, loss, 1e-3, 1e-3)


def test_pipeline_basic_test_runs_alpas_cases():
    """``PipelineBasicTest`` as Alpa's pipeline tests subclass it: ``run_mlp`` (manual and automatic layers, three
    steps) and ``run_n_layer_bert`` (clipped, loss-scaled) against the serial steps (``assert_allclose``, which
    ``test_assert_allclose_can_fail_and_the_loader_data_is_alpas`` shows can fail), returning the HLO texts the
    tests count collectives in."""
    from alpa_lab.testing import PipelineBasicTest

    case = PipelineBasicTest()
    case.setUp()
    try:
        for manual in (True, False):
            texts = case.run_mlp(manual_pipeline_layer=manual)
            assert texts and all("HloModule" in t for t in texts)
            assert al.count_communication_primitives(texts)[0] >= 0
        texts = case.run_n_layer_bert(2, batch_size=8, seq_len=16, hidden_size=32, num_heads=2, use_dynamic_scale=True,
                                      clip_by_global_norm=True)
        assert len(texts) >= 4  # two stages' forward and backward at least
    finally:
        case.tearDown()


def test_bert_layer_model_takes_alpas_config():
    """Alpa's tests size the BERT layers with ``BertLayerModel(config=BertConfig(...))``; the same sizes given as
    fields make the same model (equal parameters and outputs), and a feed-forward width other than 4x is the
    config's."""
    from alpa_lab.testing import BertConfig, BertLayerModel

    x, mask = jnp.ones((2, 8, 32)), jnp.ones((2, 8), jnp.int8)
    by_config = BertLayerModel(config=BertConfig(hidden_size=32, num_attention_heads=4, intermediate_size=128,
                                                 num_hidden_layers=2), add_manual_pipeline_marker=False)
    by_fields = BertLayerModel(hidden_size=32, num_heads=4, num_layers=2, add_manual_pipeline_marker=False)
    p1, p2 = by_config.init(jax.random.PRNGKey(0), x, mask), by_fields.init(jax.random.PRNGKey(0), x, mask)
    for a, b in zip(jax.tree_util.tree_leaves(p1), jax.tree_util.tree_leaves(p2)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    np.testing.assert_array_equal(np.asarray(by_config.apply(p1, x, mask)), np.asarray(by_fields.apply(p2, x, mask)))
    narrow = BertLayerModel(config=BertConfig(32, 4, 48, 1)).init(jax.random.PRNGKey(0), x, mask)
    assert {(32, 48), (48, 32)} <= {tuple(w.shape) for w in jax.tree_util.tree_leaves(narrow) if w.ndim == 2}
    assert (32, 128) not in {tuple(w.shape) for w in jax.tree_util.tree_leaves(narrow)}
    with pytest.raises(ValueError, match="not both"):
        BertLayerModel(hidden_size=32, config=BertConfig()).init(jax.random.PRNGKey(0), x, mask)
    with pytest.raises(ValueError, match="needs hidden_size, num_heads and num_layers"):
        BertLayerModel(hidden_size=32).init(jax.random.PRNGKey(0), x, mask)
