"""A GShard-style mixture-of-experts transformer (the paper's MoE benchmark family).

Each block's feed-forward is E expert FFNs behind top-1 gating. Tokens are grouped (one
group per sequence), routed with softmax + argmax + one-hot, and moved in and out of a
per-expert buffer of ``capacity`` slots with einsums that carry an explicit expert axis
(``gsec,gsm->egcm``); the expert weights ``[E, M, H]`` are applied with that axis as a
batch dimension. That expert axis is what expert parallelism shards, so it has to be
visible in the traced program rather than hidden in a gather.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from alpa_lab.models.common import Example, dtype_of
from alpa_lab.models.gpt import GPTConfig, lm_batch, make_lm


@dataclass(frozen=True)
class MoEConfig(GPTConfig):
    """GPT's sizes (``mlp_ratio`` unused) plus the experts that replace each block's FFN."""

    experts: int = 8
    expert_hidden: int = 128
    capacity_factor: float = 2.0
    aux_loss_weight: float = 0.01

    @property
    def capacity(self) -> int:
        """Slots per expert and group: ``capacity_factor`` times a fair share of the group."""
        return max(1, math.ceil(self.capacity_factor * self.seq_len / self.experts))


def moe_config(
    layers: int = 8,
    hidden: int = 768,
    heads: int = 16,
    experts: int = 16,
    seq_len: int = 1024,
    batch: int = 8,
    vocab: int = 32000,
    **kwargs: Any,
) -> MoEConfig:
    """A benchmark-sized MoE; the defaults are near the paper's smallest MoE (8 x 768, 16 experts).

    Expert FFNs are 4x hidden and capacity factor 1.25 unless given.
    """
    kwargs.setdefault("expert_hidden", 4 * hidden)
    kwargs.setdefault("capacity_factor", 1.25)
    return MoEConfig(
        batch=batch, seq_len=seq_len, hidden=hidden, heads=heads, layers=layers, vocab=vocab, experts=experts, **kwargs
    )


class MoEFFN(nn.Module):
    """Top-1 gated experts over groups ``[G, S, M]``; returns (y, load-balancing aux loss)."""

    experts: int
    expert_hidden: int
    capacity: int
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        e, c, m = self.experts, self.capacity, x.shape[-1]
        logits = nn.Dense(e, use_bias=False, dtype=self.dtype, param_dtype=self.dtype, name="gate")(x)
        probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)  # [g, s, e]
        mask = jax.nn.one_hot(jnp.argmax(probs, axis=-1), e, dtype=jnp.float32)  # [g, s, e]
        position = jnp.cumsum(mask, axis=1) * mask  # 1-based slot in the chosen expert's buffer
        keep = mask * (position <= c)  # tokens past capacity are dropped
        slot = jnp.sum(position * keep, axis=-1).astype(jnp.int32) - 1  # -1: dropped
        dispatch = keep[..., None] * jax.nn.one_hot(slot, c, dtype=jnp.float32)[:, :, None, :]  # [g, s, e, c]
        combine = jnp.sum(probs * keep, axis=-1)[..., None, None] * dispatch
        aux = e * jnp.mean(jnp.sum(jnp.mean(mask, axis=1) * jnp.mean(probs, axis=1), axis=-1))

        init = nn.initializers.variance_scaling(1.0, "fan_in", "truncated_normal", in_axis=-2, out_axis=-1, batch_axis=(0,))
        w_in = self.param("wi", init, (e, m, self.expert_hidden), self.dtype)
        w_out = self.param("wo", init, (e, self.expert_hidden, m), self.dtype)
        expert_in = jnp.einsum("gsec,gsm->egcm", dispatch.astype(self.dtype), x)
        h = nn.gelu(jnp.einsum("egcm,emh->egch", expert_in, w_in))
        expert_out = jnp.einsum("egch,ehm->egcm", h, w_out)
        return jnp.einsum("gsec,egcm->gsm", combine.astype(self.dtype), expert_out), aux


def make_moe(config: MoEConfig | None = None, *, seed: int = 0, abstract: bool = False) -> Example:
    """An MoE language model: next-token loss plus ``aux_loss_weight`` x load balancing."""
    config = config or MoEConfig()
    make_ffn = functools.partial(
        MoEFFN, config.experts, config.expert_hidden, config.capacity, dtype_of(config.dtype)
    )
    return make_lm(
        "moe",
        config,
        causal=True,
        make_batch=lm_batch(config),
        make_ffn=make_ffn,
        aux_weight=config.aux_loss_weight,
        seed=seed,
        abstract=abstract,
    )
