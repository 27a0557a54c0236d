"""GPT: a decoder-only transformer language model (the paper's GPT-3 benchmark family).

Written with plain ``nn.Dense``/``nn.DenseGeneral`` and explicit einsums, no scan, remat
or dropout, so the traced step is a flat, deterministic program whose matmuls carry the
head and hidden axes Alpa shards. ``TransformerLM`` is shared with BERT (no causal mask)
and the MoE model (another feed-forward block).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from alpa_lab.models.common import BatchFn, Example, PyTree, build_example, dtype_of, linen_init


@dataclass(frozen=True)
class GPTConfig:
    """Sizes of a GPT; ``dtype`` is the parameter and compute dtype (the loss is float32)."""

    batch: int = 8
    seq_len: int = 16
    hidden: int = 64
    heads: int = 4
    layers: int = 2
    vocab: int = 128
    mlp_ratio: int = 4
    tied_embeddings: bool = True
    learning_rate: float = 1e-3
    dtype: str = "float32"


def gpt_config(
    layers: int = 24,
    hidden: int = 1024,
    heads: int = 16,
    seq_len: int = 1024,
    batch: int = 8,
    vocab: int = 51200,
    **kwargs: Any,
) -> GPTConfig:
    """A benchmark-sized GPT; the defaults are the paper's GPT-350M (24 x 1024, 16 heads)."""
    return GPTConfig(batch=batch, seq_len=seq_len, hidden=hidden, heads=heads, layers=layers, vocab=vocab, **kwargs)


class Attention(nn.Module):
    """Multi-head self-attention; q/k/v/out projections keep an explicit heads axis."""

    hidden: int
    heads: int
    causal: bool
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        head_dim = self.hidden // self.heads
        proj = dict(features=(self.heads, head_dim), dtype=self.dtype, param_dtype=self.dtype)
        q = nn.DenseGeneral(**proj, name="query")(x)
        # no key bias: softmax ignores it, so its gradient is rounding noise that Adam
        # would blow up to full-size updates (as in GPT-NeoX/LLaMA-style attention)
        k = nn.DenseGeneral(**proj, use_bias=False, name="key")(x)
        v = nn.DenseGeneral(**proj, name="value")(x)
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k).astype(jnp.float32) / math.sqrt(head_dim)
        if self.causal:
            seq = x.shape[1]
            mask = jnp.tril(jnp.ones((seq, seq), jnp.bool_))
            scores = jnp.where(mask, scores, jnp.finfo(jnp.float32).min)
        probs = jax.nn.softmax(scores, axis=-1).astype(self.dtype)
        out = jnp.einsum("bhqk,bkhd->bqhd", probs, v)
        return nn.DenseGeneral(self.hidden, axis=(-2, -1), dtype=self.dtype, param_dtype=self.dtype, name="out")(out)


class MLPBlock(nn.Module):
    """The transformer's feed-forward block: Dense -> GELU -> Dense. Returns (y, aux loss)."""

    hidden: int
    mlp_hidden: int
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> tuple[jax.Array, float]:
        h = nn.gelu(nn.Dense(self.mlp_hidden, dtype=self.dtype, param_dtype=self.dtype)(x))
        return nn.Dense(self.hidden, dtype=self.dtype, param_dtype=self.dtype)(h), 0.0


FFNFactory = Callable[[], nn.Module]
"""Makes a block's feed-forward module (called inside the block, so it nests there);
the module returns (y, aux loss)."""


class Block(nn.Module):
    """Pre-LayerNorm transformer block: x + attn(ln(x)), then x + ffn(ln(x))."""

    hidden: int
    heads: int
    causal: bool
    make_ffn: FFNFactory
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> tuple[jax.Array, Any]:
        norm = dict(dtype=self.dtype, param_dtype=self.dtype)
        x = x + Attention(self.hidden, self.heads, self.causal, self.dtype)(nn.LayerNorm(**norm)(x))
        y, aux = self.make_ffn()(nn.LayerNorm(**norm)(x))
        return x + y, aux


class TransformerLM(nn.Module):
    """Token + position embeddings (``nn.Embed``: gathers), blocks, LM head -> (logits, aux)."""

    config: GPTConfig
    causal: bool = True
    make_ffn: FFNFactory | None = None

    @nn.compact
    def __call__(self, tokens: jax.Array) -> tuple[jax.Array, Any]:
        cfg = self.config
        dtype = dtype_of(cfg.dtype)
        embed = nn.Embed(cfg.vocab, cfg.hidden, dtype=dtype, param_dtype=dtype, name="wte")
        positions = nn.Embed(cfg.seq_len, cfg.hidden, dtype=dtype, param_dtype=dtype, name="wpe")
        x = embed(tokens) + positions(jnp.arange(tokens.shape[1]))[None]
        make_ffn = self.make_ffn or functools.partial(MLPBlock, cfg.hidden, cfg.mlp_ratio * cfg.hidden, dtype)
        aux: Any = 0.0
        for i in range(cfg.layers):
            x, layer_aux = Block(cfg.hidden, cfg.heads, self.causal, make_ffn, dtype, name=f"Block_{i}")(x)
            aux = aux + layer_aux
        x = nn.LayerNorm(dtype=dtype, param_dtype=dtype, name="ln_f")(x)
        if cfg.tied_embeddings:
            logits = embed.attend(x)
        else:
            logits = nn.Dense(cfg.vocab, use_bias=False, dtype=dtype, param_dtype=dtype, name="lm_head")(x)
        return logits, aux


def lm_batch(config: GPTConfig) -> BatchFn:
    """key -> {"tokens", "labels"}: random token ids, labels the next token."""

    def make_batch(key: jax.Array) -> dict[str, jax.Array]:
        ids = jax.random.randint(key, (config.batch, config.seq_len + 1), 0, config.vocab, jnp.int32)
        return {"tokens": ids[:, :-1], "labels": ids[:, 1:]}

    return make_batch


def make_lm(
    name: str,
    config: GPTConfig,
    *,
    causal: bool,
    make_batch: BatchFn,
    make_ffn: FFNFactory | None = None,
    aux_weight: float = 0.0,
    seed: int,
    abstract: bool,
) -> Example:
    """A transformer LM example: token cross-entropy (+ ``aux_weight`` x aux loss), Adam."""
    model = TransformerLM(config, causal=causal, make_ffn=make_ffn)

    def loss_fn(params: PyTree, model_state: PyTree, batch: PyTree):
        logits, aux = model.apply({"params": params}, batch["tokens"])
        loss = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), batch["labels"]).mean()
        if aux_weight:
            loss = loss + aux_weight * aux
        return loss, model_state

    return build_example(
        name,
        config,
        init=linen_init(model, lambda: jnp.zeros((config.batch, config.seq_len), jnp.int32)),
        loss_fn=loss_fn,
        optimizer=optax.adam(config.learning_rate),
        make_batch=make_batch,
        seed=seed,
        abstract=abstract,
    )


def make_gpt(config: GPTConfig | None = None, *, seed: int = 0, abstract: bool = False) -> Example:
    """GPT with a causal mask and next-token loss."""
    config = config or GPTConfig()
    return make_lm("gpt", config, causal=True, make_batch=lm_batch(config), seed=seed, abstract=abstract)
