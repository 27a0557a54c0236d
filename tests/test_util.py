"""``alpa_lab.util`` (Alpa's ``alpa.util`` helpers) and the collective costs of Alpa's ``LogicalDeviceMesh``.

Oracles: the GPT FLOP formula against the matmul FLOPs of our traced GPT step (exact: the formula counts every
dot_general of forward and backward); the planner's own collective costs on the same mesh; call counts for the
timing loop."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import alpa_lab as al
from alpa_lab.models import gpt_config, make_gpt
from alpa_lab.util import (
    benchmark_func, compute_gpt_tflops, compute_param_number, count_communication_primitives, map_to_nparray,
)


def test_gpt_flops_are_the_traced_steps_matmuls():
    cfg = gpt_config(layers=2, hidden=64, heads=4, seq_len=32, batch=2, vocab=128)
    ex = make_gpt(cfg)
    graph = al.trace(ex.train_step, *ex.args)
    matmuls = sum(op.flops for op in graph.ops if op.primitive == "dot_general")
    assert compute_gpt_tflops(2, 32, 2, 64, 128, num_gpus=1, latency=1.0) * 1e12 == pytest.approx(matmuls, rel=1e-12)
    # per device and per second; checkpointing recomputes the layers' forward (not the logits); no backward: one pass
    layers = 2 * (24 * 2 * 32 * 64**2 + 4 * 2 * 32**2 * 64)
    logits = 2 * 2 * 32 * 64 * 128
    assert compute_gpt_tflops(2, 32, 2, 64, 128, 4, 0.5, checkpoint_activations=True) * 1e12 == pytest.approx(
        (4 * layers + 3 * logits) / 0.5 / 4)
    assert compute_gpt_tflops(2, 32, 2, 64, 128, 1, 1.0, backward=False) * 1e12 == pytest.approx(layers + logits)


def test_param_counts_arrays_and_the_timing_loop():
    params = {"w": jnp.ones((3, 4)), "b": np.zeros(4), "s": jnp.float32(1.0)}
    assert compute_param_number(params) == 12 + 4 + 1
    host = map_to_nparray({"w": jnp.ones((2, 2)), "n": 3})
    assert isinstance(host["w"], np.ndarray) and host["n"] == 3
    calls = {"run": 0, "sync": 0}

    def run():
        calls["run"] += 1

    def sync():
        calls["sync"] += 1

    costs = benchmark_func(run, sync, warmup=2, repeat=3, number=4)
    assert costs.shape == (3,) and (costs >= 0).all()
    assert calls["run"] == 2 + 3 * 4 and calls["sync"] == 1 + 2 * 3
    with pytest.raises(ValueError, match="repeat >= 1"):
        benchmark_func(run, repeat=0)
    assert count_communication_primitives is al.count_communication_primitives


def test_logical_device_mesh_prices_collectives_as_the_planner_does():
    mesh = al.LocalPhysicalDeviceMesh(jax.local_devices()[:4]).get_logical_mesh((2, 2), [1, 2], [1, 0.1])
    planner = mesh.cluster_spec().logical_mesh((2, 2))
    for kind, cost in (("all-reduce", mesh.all_reduce_cost), ("all-gather", mesh.all_gather_cost),
                       ("reduce-scatter", mesh.reduce_scatter_cost)):
        for dim in (0, 1):
            assert cost(1024, dim) == planner.collective_cost(kind, 1024.0, (dim,))
    # an all-to-all is given the whole tensor's bytes, as Alpa's tests count them; the planner prices each device's
    # tile: the oracle is the planner's resharding of a 64 x 64 float32 tensor from rows to columns over axis 0
    from alpa_lab.sharding.resharding import resharding_cost
    from alpa_lab.sharding.spec import ShardingSpec

    line = al.LocalPhysicalDeviceMesh(jax.local_devices()[:4]).get_logical_mesh((4, 1), [1, 1], [1, 1])
    moved = resharding_cost(ShardingSpec.parse("S0R"), ShardingSpec.parse("RS0"), (64, 64), 4, line.cluster_spec().logical_mesh((4, 1)))
    assert line.all_to_all_cost(64 * 64 * 4, 0) == pytest.approx(moved) == pytest.approx(1 + 3 / 4 * 64 * 64 * 4 / 4)
    assert mesh.all_reduce_cost(1000, 0) == pytest.approx(1 + 1 * 2 * (2 - 1) / 2 * 1000)
    assert mesh.all_reduce_cost(1000, 1) == pytest.approx(2 + 0.1 * 2 * (2 - 1) / 2 * 1000)
    flat = mesh.flatten()
    assert flat.shape == (4, 1) and flat.mesh_alpha == (2.0, 2.0) and flat.mesh_beta == (1.0, 1.0)
    with pytest.raises(al.MethodOptionError, match="mesh_dim must be 0 or 1"):
        mesh.all_reduce_cost(8, 2)
