"""Alpa's test helpers (``alpa.testing``) under their names, so tests written for Alpa run here unchanged.

Small models with their training state, batch and step (an MLP, a stack of BERT encoder layers), an
``assert_allclose`` that walks pytrees and train states, and the data-loader function Alpa's loader tests
read. The steps take their gradients with ``alpa_lab.value_and_grad``, so that a ``mark_pipeline_boundary()``
in the model cuts a pipeline, and run as plain JAX too (the serial reference a test compares with).
"""

from __future__ import annotations

import dataclasses
import functools
import unittest
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax.training import train_state

from alpa_lab.graph.loss_scale import DynamicScale
from alpa_lab.graph.markers import mark_pipeline_boundary, value_and_grad

__all__ = [
    "BertConfig", "BertLayerModel", "MLPModel", "PipelineBasicTest", "TrainState", "assert_allclose", "create_train_state",
    "data_loader_input_iter_func",
    "get_bert_layer_train_state_and_step", "get_mlp_train_state_and_step", "mlp_inference_step",
]


class TrainState(train_state.TrainState):
    """Flax's train state with Alpa's ``dynamic_scale`` (a ``DynamicScale`` for mixed precision, or None)."""

    dynamic_scale: Any = None


def assert_allclose(x: Any, y: Any, rtol: float = 1e-4, atol: float = 1e-4) -> None:
    """``np.testing.assert_allclose`` over two pytrees of the same structure (train states, dicts, lists, arrays,
    numbers); any other leaves must be equal."""
    if isinstance(x, train_state.TrainState) or isinstance(y, train_state.TrainState):
        x, y = jax.tree_util.tree_leaves(x), jax.tree_util.tree_leaves(y)
    if isinstance(x, dict) or isinstance(y, dict):
        assert isinstance(x, dict) and isinstance(y, dict) and set(x) == set(y), (type(x), type(y))
        for k in x:
            assert_allclose(x[k], y[k], rtol, atol)
        return
    if isinstance(x, (list, tuple)) and not hasattr(x, "shape"):
        assert isinstance(y, (list, tuple)) and len(x) == len(y), (type(y), len(x))
        for a, b in zip(x, y):
            assert_allclose(a, b, rtol, atol)
        return
    if hasattr(x, "__array__") or np.isscalar(x):
        assert hasattr(y, "__array__") or np.isscalar(y), type(y)
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol, atol)
        return
    if jax.tree_util.tree_structure(x).num_leaves:  # another pytree (a flax struct): leaf by leaf
        assert jax.tree_util.tree_structure(x) == jax.tree_util.tree_structure(y)
        assert_allclose(jax.tree_util.tree_leaves(x), jax.tree_util.tree_leaves(y), rtol, atol)
        return
    assert x == y, (x, y)


class MLPModel(nn.Module):
    """``num_layers`` dense layers of ``hidden_size``; with ``add_manual_pipeline_marker`` a stage boundary after
    the first half."""

    num_layers: int
    hidden_size: int
    use_bias: bool = True
    add_manual_pipeline_marker: bool = True

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        for i in range(self.num_layers):
            x = nn.Dense(self.hidden_size, use_bias=self.use_bias)(x)
            if self.add_manual_pipeline_marker and i == self.num_layers // 2 - 1:
                mark_pipeline_boundary()
        return x


def _regression_step(inputs: Callable[[Any], tuple]) -> Callable:
    """A step that fits the model's output on ``inputs(batch)`` to ``batch["y"]`` (mean squared error), with a
    dynamic loss scale where the state has one (steps with non-finite gradients are skipped)."""

    def train_step(state: TrainState, batch: Any) -> tuple[TrainState, jax.Array]:
        def loss_func(params: Any) -> jax.Array:
            return jnp.mean((state.apply_fn(params, *inputs(batch)) - batch["y"]) ** 2)

        scale = getattr(state, "dynamic_scale", None)
        if scale is None:
            loss, grads = value_and_grad(loss_func)(state.params)
            return state.apply_gradients(grads=grads), loss
        scale, finite, loss, grads = scale.value_and_grad(loss_func)(state.params)
        new = state.apply_gradients(grads=grads)
        keep = functools.partial(jnp.where, finite)
        return new.replace(params=jax.tree_util.tree_map(keep, new.params, state.params),
                           opt_state=jax.tree_util.tree_map(keep, new.opt_state, state.opt_state),
                           dynamic_scale=scale), loss

    return train_step


def get_mlp_train_state_and_step(batch_size: int, hidden_size: int, num_layers: int = 4, use_bias: bool = True,
                                 add_manual_pipeline_marker: bool = False) -> tuple[TrainState, dict, Callable]:
    """(state, batch, train_step) of an ``MLPModel`` fitting random ``y`` from random ``x`` (SGD with momentum)."""
    key = jax.random.PRNGKey(0)
    x = jax.random.normal(key, (batch_size, hidden_size))
    y = jax.random.normal(jax.random.fold_in(key, 1), (batch_size, hidden_size))
    model = MLPModel(num_layers=num_layers, hidden_size=hidden_size, use_bias=use_bias,
                     add_manual_pipeline_marker=add_manual_pipeline_marker)
    state = TrainState.create(apply_fn=model.apply, params=model.init(key, x), tx=optax.sgd(1e-2, momentum=0.9))
    return state, {"x": x, "y": y}, _regression_step(lambda batch: (batch["x"],))


class BertLayer(nn.Module):
    """One BERT encoder layer: masked self-attention and a GELU feed-forward block, each added back and normalised."""

    hidden_size: int
    num_heads: int
    intermediate_size: int
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array, attention_mask: jax.Array) -> jax.Array:
        mask = nn.make_attention_mask(attention_mask > 0, attention_mask > 0)
        attended = nn.MultiHeadDotProductAttention(num_heads=self.num_heads, dtype=self.dtype)(x, x, mask=mask)
        x = nn.LayerNorm(dtype=self.dtype)(x + attended)
        h = nn.gelu(nn.Dense(self.intermediate_size, dtype=self.dtype)(x))
        return nn.LayerNorm(dtype=self.dtype)(x + nn.Dense(self.hidden_size, dtype=self.dtype)(h))


@dataclasses.dataclass(frozen=True)
class BertConfig:
    """The sizes of ``BertLayerModel``'s layers, in the names of Alpa's (and Hugging Face's) ``BertConfig``; the
    defaults are BERT-base's."""

    hidden_size: int = 768
    num_attention_heads: int = 12
    intermediate_size: int = 3072
    num_hidden_layers: int = 12


class BertLayerModel(nn.Module):
    """``num_layers`` BERT encoder layers; with ``add_manual_pipeline_marker`` a stage boundary between each two.
    Sized by ``hidden_size``, ``num_heads`` and ``num_layers`` (a feed-forward 4x wide), or by ``config`` (a
    ``BertConfig``, as Alpa's tests write ``BertLayerModel(config=BertConfig(...))``)."""

    hidden_size: int | None = None
    num_heads: int | None = None
    num_layers: int | None = None
    dtype: Any = jnp.float32
    add_manual_pipeline_marker: bool = True
    config: BertConfig | None = None

    def sizes(self) -> tuple[int, int, int, int]:
        """(hidden, heads, feed-forward width, layers), from the config or the fields, whichever was given."""
        given = (self.hidden_size, self.num_heads, self.num_layers)
        if self.config is not None:
            if any(v is not None for v in given):
                raise ValueError("BertLayerModel takes config=BertConfig(...) or hidden_size/num_heads/num_layers, not both")
            c = self.config
            return c.hidden_size, c.num_attention_heads, c.intermediate_size, c.num_hidden_layers
        if any(v is None for v in given):
            raise ValueError("BertLayerModel needs hidden_size, num_heads and num_layers (or config=BertConfig(...))")
        return self.hidden_size, self.num_heads, 4 * self.hidden_size, self.num_layers

    @nn.compact
    def __call__(self, x: jax.Array, attention_mask: jax.Array) -> jax.Array:
        hidden, heads, intermediate, layers = self.sizes()
        for i in range(layers):
            x = BertLayer(hidden, heads, intermediate, self.dtype)(x, attention_mask)
            if self.add_manual_pipeline_marker and i != layers - 1:
                mark_pipeline_boundary()
        return x


def get_bert_layer_train_state_and_step(batch_size: int, seq_len: int, num_layers: int, hidden_size: int, num_heads: int,
                                        clip_by_global_norm: bool = False, use_dynamic_scale: bool = False,
                                        add_manual_pipeline_marker: bool = True) -> tuple[TrainState, dict, Callable]:
    """(state, batch, train_step) of a ``BertLayerModel`` fitting random ``y`` (Adam; optionally clipped by global
    norm first, and with a dynamic loss scale: ``alpa_lab.DynamicScale``, whose gradients a pipeline can cut)."""
    key = jax.random.PRNGKey(0)
    x = jax.random.normal(key, (batch_size, seq_len, hidden_size))
    y = jax.random.normal(jax.random.fold_in(key, 1), (batch_size, seq_len, hidden_size))
    batch = {"x": x, "y": y, "attention_mask": jnp.ones((batch_size, seq_len), dtype=jnp.int8)}
    model = BertLayerModel(hidden_size=hidden_size, num_heads=num_heads, num_layers=num_layers,
                           add_manual_pipeline_marker=add_manual_pipeline_marker)
    tx = optax.adam(1e-2)
    if clip_by_global_norm:
        tx = optax.chain(optax.clip_by_global_norm(0.05), tx)
    state = TrainState.create(apply_fn=model.apply, params=model.init(key, x, batch["attention_mask"]), tx=tx,
                              dynamic_scale=DynamicScale() if use_dynamic_scale else None)
    return state, batch, _regression_step(lambda batch: (batch["x"], batch["attention_mask"]))


def create_train_state(rngkey: jax.Array, model: nn.Module, inputs: tuple) -> TrainState:
    """``model`` initialised on ``inputs`` with Adam (learning rate 1e-2)."""
    return TrainState.create(apply_fn=model.apply, params=model.init(rngkey, *inputs), tx=optax.adam(1e-2))


def mlp_inference_step(state: TrainState, batch: dict) -> tuple[jax.Array, jax.Array]:
    """The model's output on ``batch["x"]`` and its mean squared error against ``batch["y"]``."""
    out = state.apply_fn(state.params, batch["x"])
    return out, jnp.mean((out - batch["y"]) ** 2)


def data_loader_input_iter_func(start: int, end: int, batch_size: int):
    """Alpa's loader tests' data: rows ``start`` to ``end - 1`` of a 1024 x 32 float ``arange`` and its 1024 int
    labels, in whole batches of ``batch_size``."""
    xs = np.arange(1024 * 32, dtype=np.float32).reshape(1024, 32)
    ys = np.arange(1024, dtype=np.int32)
    for i in range(start, start + (end - start) // batch_size * batch_size, batch_size):
        yield xs[i:i + batch_size], ys[i:i + batch_size]


class PipelineBasicTest(unittest.TestCase):
    """Alpa's base class for pipeline tests: each test plans a small model with ``PipeshardParallel`` (4
    micro-batches), runs it, and checks it against the serial step; ``run_mlp`` / ``run_n_layer_bert`` return the
    executable's HLO texts for the test to count collectives in.

    The session is a local one (``init("local")``: the in-process runtime on this process's devices), where Alpa's
    starts Ray; a subclass wanting mesh workers overrides ``setUp`` with ``init("ray")``.
    """

    def setUp(self) -> None:
        from alpa_lab.api import init

        init("local")

    def tearDown(self) -> None:
        from alpa_lab.api import shutdown

        shutdown()

    @staticmethod
    def _method(num_layers: int, manual_pipeline_layer: bool, use_remat: bool, stage_option: Any, as_option: Any) -> Any:
        from alpa_lab.parallel_method import AutoLayerOption, AutoShardingOption, ManualLayerOption, PipeshardParallel

        layers = (ManualLayerOption(remat_layer=use_remat) if manual_pipeline_layer else
                  AutoLayerOption(layer_num=num_layers, remat_mode="coarse_grained_remat" if use_remat else "none"))
        return PipeshardParallel(num_micro_batches=4, default_auto_sharding_option=as_option or AutoShardingOption(),
                                 layer_option=layers, stage_option=stage_option or "uniform")

    @staticmethod
    def _compare(train_step: Callable, state: Any, batch: Any, method: Any, steps: int, atol: float) -> Any:
        """Run ``steps`` steps (none: only compile) serially and parallelized from ``state``, comparing the new
        parameters and the loss after each; the executable of the parallelized step."""
        from alpa_lab.api import parallelize

        parallel = parallelize(train_step, method=method)
        executable = parallel.get_executable(state, batch)
        expected = actual = state
        for _ in range(steps):
            expected, expected_loss = train_step(expected, batch)
            actual, actual_loss = parallel(actual, batch)
            assert_allclose(expected.params, actual.params, 1e-3, atol)
            assert_allclose(expected_loss, actual_loss, 1e-3, 1e-3)
        return executable

    def run_mlp(self, manual_pipeline_layer: bool = True, use_remat: bool = False, stage_option: Any = None,
                as_option: Any = None, do_numerical_test: bool = True) -> Any:
        """A 4-layer MLP (batch 64, width 16), three steps against the serial ones; its HLO texts."""
        state, batch, step = get_mlp_train_state_and_step(64, 16, num_layers=4, add_manual_pipeline_marker=manual_pipeline_layer)
        method = self._method(2, manual_pipeline_layer, use_remat, stage_option, as_option)
        return self._compare(step, state, batch, method, 3 if do_numerical_test else 0, 1e-3).get_hlo_text()

    def run_n_layer_bert(self, num_layers: int, batch_size: int = 16, seq_len: int = 256, hidden_size: int = 512,
                         num_heads: int = 8, use_remat: bool = False, clip_by_global_norm: bool = False,
                         use_dynamic_scale: bool = False, inject_train_step: Callable | None = None,
                         manual_pipeline_layer: bool = True, stage_option: Any = None, as_option: Any = None,
                         do_numerical_test: bool = True) -> Any:
        """``num_layers`` BERT encoder layers, one step against the serial one (``inject_train_step``: another
        step on the same state and batch); its HLO texts."""
        state, batch, step = get_bert_layer_train_state_and_step(
            batch_size, seq_len, num_layers, hidden_size, num_heads, clip_by_global_norm=clip_by_global_norm,
            use_dynamic_scale=use_dynamic_scale, add_manual_pipeline_marker=manual_pipeline_layer)
        step = inject_train_step or step
        method = self._method(num_layers, manual_pipeline_layer, use_remat, stage_option, as_option)
        return self._compare(step, state, batch, method, 1 if do_numerical_test else 0, 1.5e-3).get_hlo_text()
