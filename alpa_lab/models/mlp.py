"""An n-layer MLP regression model, in flax linen and in Flax NNX.

The smallest program with the structure Alpa plans (matmul chains, forward and backward,
an Adam update); the NNX variant shows a model whose parameters live in a module object
being turned into a pure step over ``nnx.split`` state.
"""

from __future__ import annotations

from dataclasses import dataclass

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from flax import nnx

from alpa_lab.models.common import Example, PyTree, build_example, linen_init


@dataclass(frozen=True)
class MLPConfig:
    """``layers`` hidden layers of width ``hidden`` (ReLU), then a linear head to ``out_dim``."""

    batch: int = 8
    in_dim: int = 16
    hidden: int = 64
    layers: int = 3
    out_dim: int = 8
    learning_rate: float = 1e-3


class MLP(nn.Module):
    config: MLPConfig

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        for _ in range(self.config.layers):
            x = nn.relu(nn.Dense(self.config.hidden)(x))
        return nn.Dense(self.config.out_dim)(x)


def mlp_batch(config: MLPConfig):
    """key -> {"x", "y"}: Gaussian inputs and regression targets."""

    def make_batch(key: jax.Array) -> dict[str, jax.Array]:
        kx, ky = jax.random.split(key)
        return {
            "x": jax.random.normal(kx, (config.batch, config.in_dim), jnp.float32),
            "y": jax.random.normal(ky, (config.batch, config.out_dim), jnp.float32),
        }

    return make_batch


def mse(pred: jax.Array, target: jax.Array) -> jax.Array:
    return jnp.mean((pred - target) ** 2)


def make_mlp(config: MLPConfig | None = None, *, seed: int = 0, abstract: bool = False) -> Example:
    """The linen MLP trained with MSE and Adam."""
    config = config or MLPConfig()
    model = MLP(config)

    def loss_fn(params: PyTree, model_state: PyTree, batch: PyTree):
        return mse(model.apply({"params": params}, batch["x"]), batch["y"]), model_state

    return build_example(
        "mlp",
        config,
        init=linen_init(model, lambda: jnp.zeros((config.batch, config.in_dim), jnp.float32)),
        loss_fn=loss_fn,
        optimizer=optax.adam(config.learning_rate),
        make_batch=mlp_batch(config),
        seed=seed,
        abstract=abstract,
    )


class NNXMLP(nnx.Module):
    """The same MLP as ``MLP``, written as a Flax NNX module."""

    def __init__(self, config: MLPConfig, rngs: nnx.Rngs):
        dims = [config.in_dim] + [config.hidden] * config.layers
        self.hidden = nnx.List([nnx.Linear(a, b, rngs=rngs) for a, b in zip(dims, dims[1:])])
        self.head = nnx.Linear(dims[-1], config.out_dim, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        for layer in self.hidden:
            x = nnx.relu(layer(x))
        return self.head(x)


def make_mlp_nnx(config: MLPConfig | None = None, *, seed: int = 0, abstract: bool = False) -> Example:
    """The NNX MLP as a pure step: the graphdef is closed over, the ``nnx.State`` is the params.

    The graphdef comes from ``nnx.eval_shape``, so finding it allocates nothing.
    """
    config = config or MLPConfig()
    graphdef, _ = nnx.split(nnx.eval_shape(lambda: NNXMLP(config, nnx.Rngs(0))))

    def init(key: jax.Array) -> tuple[PyTree, PyTree]:
        _, params = nnx.split(NNXMLP(config, nnx.Rngs(key)))
        return params, {}

    def loss_fn(params: PyTree, model_state: PyTree, batch: PyTree):
        model = nnx.merge(graphdef, params)
        return mse(model(batch["x"]), batch["y"]), model_state

    return build_example(
        "mlp_nnx",
        config,
        init=init,
        loss_fn=loss_fn,
        optimizer=optax.adam(config.learning_rate),
        make_batch=mlp_batch(config),
        seed=seed,
        abstract=abstract,
    )
