"""BERT: the GPT transformer without the causal mask, trained on masked tokens (MLM-style).

Same layers as GPT, so the two differ only in the attention mask and the data; the loss is
taken on every token, which keeps the program free of label-dependent control.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp

from alpa_lab.models.common import BatchFn, Example
from alpa_lab.models.gpt import GPTConfig, make_lm


@dataclass(frozen=True)
class BertConfig(GPTConfig):
    """GPT's sizes plus the fraction of input tokens replaced by ``mask_token``."""

    mask_prob: float = 0.15
    mask_token: int = 0


def bert_config(
    layers: int = 24,
    hidden: int = 1024,
    heads: int = 16,
    seq_len: int = 512,
    batch: int = 8,
    vocab: int = 30528,
    **kwargs: Any,
) -> BertConfig:
    """A benchmark-sized BERT (BERT-large by default; vocab padded to a multiple of 64)."""
    return BertConfig(batch=batch, seq_len=seq_len, hidden=hidden, heads=heads, layers=layers, vocab=vocab, **kwargs)


def mlm_batch(config: BertConfig) -> BatchFn:
    """key -> {"tokens", "labels"}: random ids with some masked; labels are the originals."""

    def make_batch(key: jax.Array) -> dict[str, jax.Array]:
        k_ids, k_mask = jax.random.split(key)
        labels = jax.random.randint(k_ids, (config.batch, config.seq_len), 0, config.vocab, jnp.int32)
        masked = jax.random.bernoulli(k_mask, config.mask_prob, labels.shape)
        return {"tokens": jnp.where(masked, config.mask_token, labels), "labels": labels}

    return make_batch


def make_bert(config: BertConfig | None = None, *, seed: int = 0, abstract: bool = False) -> Example:
    """BERT with bidirectional attention and a loss on all tokens."""
    config = config or BertConfig()
    return make_lm("bert", config, causal=False, make_batch=mlm_batch(config), seed=seed, abstract=abstract)
