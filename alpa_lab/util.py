"""Alpa's ``alpa.util`` helpers that its tests and benchmark scripts import, under their names.

Only the ones a script that measures or checks a plan needs: the collectives in compiled HLO, pytrees as
NumPy, parameter counts, the GPT FLOP count behind a TFLOP/s figure, and a timing loop.
"""

from __future__ import annotations

import math
import time
from typing import Any, Callable

import jax
import numpy as np

from alpa_lab.plan import count_communication_primitives

__all__ = [
    "benchmark_func", "compute_gpt_tflops", "compute_param_number", "count_communication_primitives", "map_to_nparray",
    "print_used_time",
]


def map_to_nparray(tree: Any) -> Any:
    """Every array leaf of ``tree`` as a NumPy array on the host (sharded arrays gathered)."""
    return jax.tree_util.tree_map(lambda x: np.asarray(x) if hasattr(x, "shape") else x, tree)


def compute_param_number(tree: Any) -> int:
    """How many numbers the array leaves of ``tree`` hold (a model's parameter count)."""
    return int(sum(math.prod(np.shape(x)) for x in jax.tree_util.tree_leaves(tree)))


def compute_gpt_tflops(
    batch_size: int, seq_len: int, num_layers: int, hidden_size: int, vocab_size: int, num_gpus: int,
    latency: float, backward: bool = True, checkpoint_activations: bool = False,
) -> float:
    """TFLOP/s per device of a GPT step that took ``latency`` seconds on ``num_gpus`` devices.

    The matmul FLOPs of one forward: per layer, the Q/K/V and output projections (8 B s h^2), the MLP with
    its 4h hidden width (16 B s h^2), and the attention scores and their weighted sum (4 B s^2 h); then the
    logits (2 B s h V). A backward costs two forwards, and recomputing the layers' activations (checkpointing)
    one more forward of the layers (the logits are not recomputed).
    """
    b, s, h = batch_size, seq_len, hidden_size
    layers = num_layers * (24 * b * s * h * h + 4 * b * s * s * h)
    logits = 2 * b * s * h * vocab_size
    passes = 3 if backward else 1
    total = (passes + (1 if backward and checkpoint_activations else 0)) * layers + passes * logits
    return total / latency / num_gpus / 1e12


def benchmark_func(
    run_func: Callable[[], Any], sync_func: Callable[[], Any] | None = None, warmup: int = 1, repeat: int = 3,
    number: int = 5, min_repeat_second: float | None = None,
) -> np.ndarray:
    """Seconds per call of ``run_func``: ``repeat`` measurements, each the mean of ``number`` calls timed together
    after ``warmup`` untimed ones; ``sync_func`` (e.g. an executable's ``sync``) is called before each clock
    read so asynchronous work is counted. ``min_repeat_second``: raise ``number`` so one measurement takes at
    least that long."""
    if warmup < 0 or repeat < 1 or number < 1:
        raise ValueError(f"benchmark_func needs warmup >= 0, repeat >= 1 and number >= 1, got {warmup}, {repeat}, {number}")
    sync = sync_func or (lambda: None)
    for _ in range(warmup):
        run_func()
    sync()
    if min_repeat_second is not None:
        t0 = time.perf_counter()
        run_func()
        sync()
        once = max(time.perf_counter() - t0, 1e-9)
        number = max(number, math.ceil(min_repeat_second / once))
    costs = []
    for _ in range(repeat):
        sync()
        t0 = time.perf_counter()
        for _ in range(number):
            run_func()
        sync()
        costs.append((time.perf_counter() - t0) / number)
    return np.array(costs)


_LAST = [time.perf_counter()]


def print_used_time(message: str) -> None:
    """Print the seconds since the last call (or since this module loaded), with ``message``."""
    now = time.perf_counter()
    print(f"{message}: {now - _LAST[0]:.2f} s")
    _LAST[0] = time.perf_counter()
