"""A small Wide-ResNet (the paper's convolutional benchmark family).

Pre-activation residual blocks (BatchNorm -> ReLU -> 3x3 conv, twice) over three stages
of widths ``16k, 32k, 64k``, global average pooling and a linear classifier, trained with
SGD + momentum. BatchNorm runs in training mode; its running statistics are carried in
``TrainState.model_state`` so the step stays pure.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from alpa_lab.models.common import Example, PyTree, build_example, linen_init


@dataclass(frozen=True)
class WideResNetConfig:
    """``blocks`` residual blocks per stage; stage widths are ``base_width * 2**i * width_factor``."""

    batch: int = 8
    image_size: int = 16
    channels: int = 3
    width_factor: int = 2
    blocks: int = 1
    stages: int = 3
    base_width: int = 16
    num_classes: int = 16
    learning_rate: float = 0.1
    momentum: float = 0.9


def wide_resnet_config(
    batch: int = 32,
    image_size: int = 224,
    width_factor: int = 2,
    blocks: int = 2,
    stages: int = 4,
    base_width: int = 64,
    num_classes: int = 1024,
    **kwargs: Any,
) -> WideResNetConfig:
    """A benchmark-sized Wide-ResNet on ImageNet-sized images (ResNet-18-like stages, 2x wide)."""
    return WideResNetConfig(
        batch=batch, image_size=image_size, width_factor=width_factor, blocks=blocks, stages=stages,
        base_width=base_width, num_classes=num_classes, **kwargs,
    )


class ResidualBlock(nn.Module):
    """Pre-activation block; a 1x1 conv projects the shortcut when the shape changes."""

    features: int
    stride: int

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        h = nn.relu(nn.BatchNorm(use_running_average=False)(x))
        shortcut = x
        if self.stride != 1 or x.shape[-1] != self.features:
            shortcut = nn.Conv(self.features, (1, 1), strides=self.stride, use_bias=False)(h)
        h = nn.Conv(self.features, (3, 3), strides=self.stride, padding="SAME", use_bias=False)(h)
        h = nn.relu(nn.BatchNorm(use_running_average=False)(h))
        h = nn.Conv(self.features, (3, 3), padding="SAME", use_bias=False)(h)
        return shortcut + h


class WideResNet(nn.Module):
    config: WideResNetConfig

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        cfg = self.config
        x = nn.Conv(cfg.base_width, (3, 3), padding="SAME", use_bias=False)(x)
        for stage in range(cfg.stages):
            for block in range(cfg.blocks):
                stride = 2 if stage > 0 and block == 0 else 1
                x = ResidualBlock(cfg.base_width * 2**stage * cfg.width_factor, stride)(x)
        x = nn.relu(nn.BatchNorm(use_running_average=False)(x))
        return nn.Dense(cfg.num_classes)(jnp.mean(x, axis=(1, 2)))


def make_wide_resnet(config: WideResNetConfig | None = None, *, seed: int = 0, abstract: bool = False) -> Example:
    """Wide-ResNet classification with softmax cross-entropy and SGD + momentum."""
    config = config or WideResNetConfig()
    model = WideResNet(config)
    image_shape = (config.batch, config.image_size, config.image_size, config.channels)

    def loss_fn(params: PyTree, model_state: PyTree, batch: PyTree):
        logits, updates = model.apply({"params": params, **model_state}, batch["images"], mutable=["batch_stats"])
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["labels"]).mean()
        return loss, updates

    def make_batch(key: jax.Array) -> dict[str, jax.Array]:
        k_img, k_lab = jax.random.split(key)
        return {
            "images": jax.random.normal(k_img, image_shape, jnp.float32),
            "labels": jax.random.randint(k_lab, (config.batch,), 0, config.num_classes, jnp.int32),
        }

    return build_example(
        "wide_resnet",
        config,
        init=linen_init(model, lambda: jnp.zeros(image_shape, jnp.float32)),
        loss_fn=loss_fn,
        optimizer=optax.sgd(config.learning_rate, momentum=config.momentum),
        make_batch=make_batch,
        seed=seed,
        abstract=abstract,
    )
