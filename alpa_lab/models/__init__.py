"""Example models: one pure training step per model family of the Alpa paper.

``EXAMPLES[name]`` is ``(config class, make function)``; ``make(config(), seed=0)`` gives an
``Example`` whose ``train_step(*ex.args)`` runs, traces and plans (``abstract=True`` for
shape-only state and batch).
"""

from __future__ import annotations

import functools
from typing import Callable, NamedTuple

from alpa_lab.models.bert import BertConfig, bert_config, make_bert
from alpa_lab.models.common import Example, TrainState
from alpa_lab.models.gpt import GPTConfig, gpt_config, make_gpt
from alpa_lab.models.mlp import MLPConfig, make_mlp, make_mlp_nnx
from alpa_lab.models.moe import MoEConfig, make_moe, moe_config
from alpa_lab.models.wide_resnet import WideResNetConfig, make_wide_resnet, wide_resnet_config


class Family(NamedTuple):
    """A registry entry; a tuple, so ``config_cls, make = EXAMPLES[name]`` works."""

    config: type
    make: Callable[..., Example]


EXAMPLES: dict[str, Family] = {
    "mlp": Family(MLPConfig, make_mlp),
    "gpt": Family(GPTConfig, make_gpt),
    "bert": Family(BertConfig, make_bert),
    "moe": Family(MoEConfig, make_moe),
    "wide_resnet": Family(WideResNetConfig, make_wide_resnet),
}



@functools.cache
def tiny_example(name: str, seed: int = 0) -> Example:
    """The default-config example of ``name`` (an ``EXAMPLES`` key or ``"mlp_nnx"``), made once.

    Making an example compiles its initialiser; demos and tests that only need the tiny
    models share this one (its arrays are immutable, so sharing is safe).
    """
    make = make_mlp_nnx if name == "mlp_nnx" else EXAMPLES[name].make
    return make(seed=seed)


__all__ = [
    "EXAMPLES", "Example", "Family", "TrainState", "tiny_example",
    "MLPConfig", "make_mlp", "make_mlp_nnx",
    "GPTConfig", "gpt_config", "make_gpt",
    "BertConfig", "bert_config", "make_bert",
    "MoEConfig", "moe_config", "make_moe",
    "WideResNetConfig", "wide_resnet_config", "make_wide_resnet",
]
