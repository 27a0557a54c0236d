"""Tests for the Alpa operator-clustering DP (sec. 5.2, eq. 6)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from alpa_lab.graph.layering import (
    Layering,
    brute_force_layers,
    cluster_layers,
    input_bytes_table,
)


def _input_bytes(edges, j, k):
    return sum(nb for s, d, nb in edges if s < j <= d < k)


def _check_valid(lay: Layering, flops, edges, num_layers):
    b = lay.boundaries
    assert len(b) == num_layers + 1 and b[0] == 0 and b[-1] == len(flops)
    assert all(x < y for x, y in zip(b[:-1], b[1:]))
    budget = (1 + lay.delta) * sum(flops) / num_layers
    for (j, k), lf in zip(zip(b[:-1], b[1:]), lay.layer_flops):
        assert math.isclose(lf, sum(flops[j:k]), rel_tol=1e-9, abs_tol=1e-9)
        assert k - j == 1 or lf <= budget * (1 + 1e-9) + 1e-9  # a single op may exceed it
    costs = [_input_bytes(edges, j, k) for j, k in zip(b[:-1], b[1:])]
    assert math.isclose(lay.max_input_bytes, max(costs), rel_tol=1e-9, abs_tol=1e-9)
    return costs


def _random_instance(rng):
    k = int(rng.integers(2, 13))
    num_layers = int(rng.integers(1, k + 1))
    flops = [float(x) for x in rng.integers(0, 10, size=k)]
    if rng.random() < 0.2:
        flops = [0.0] * k
    edges = []
    for _ in range(int(rng.integers(0, 3 * k))):
        s = int(rng.integers(0, k - 1))
        d = int(rng.integers(s + 1, k))
        edges.append((s, d, float(rng.integers(0, 100))))
    if rng.random() < 0.5:  # long skip edge
        edges.append((0, k - 1, float(rng.integers(1, 1000))))
    delta = float(rng.choice([0.0, 0.1, 0.5, 1.0]))
    return flops, edges, num_layers, delta


def test_dp_matches_brute_force_on_random_instances():
    rng = np.random.default_rng(0)
    for _ in range(300):
        flops, edges, num_layers, delta = _random_instance(rng)
        dp = cluster_layers(flops, edges, num_layers, delta)
        bf = brute_force_layers(flops, edges, num_layers, delta)
        assert dp.delta == bf.delta
        assert dp.delta >= delta
        dp_costs = _check_valid(dp, flops, edges, num_layers)
        bf_costs = _check_valid(bf, flops, edges, num_layers)
        assert math.isclose(dp.max_input_bytes, bf.max_input_bytes, abs_tol=1e-9)
        # tie-break: minimum total input bytes among max-optimal clusterings
        assert math.isclose(sum(dp_costs), sum(bf_costs), abs_tol=1e-9)


def test_chain_of_identical_ops_splits_evenly():
    k, num_layers = 12, 4
    flops = [5.0] * k
    edges = [(i, i + 1, 8.0) for i in range(k - 1)]
    lay = cluster_layers(flops, edges, num_layers, delta=0.0)
    assert lay.boundaries == (0, 3, 6, 9, 12)
    assert lay.layer_flops == (15.0,) * 4
    assert lay.max_input_bytes == 8.0
    assert lay.delta == 0.0


def test_huge_edge_boundary_avoided_when_balance_allows():
    k = 8
    flops = [1.0] * k
    edges = [(i, i + 1, 1.0) for i in range(k - 1)]
    edges.append((3, 4, 1e6))  # huge tensor crossing position 4
    # Even split would put a boundary at 4; delta=0.5 allows layers of up to 6 flops.
    lay = cluster_layers(flops, edges, 2, delta=0.5)
    assert 4 not in lay.boundaries
    assert lay.max_input_bytes == 1.0
    # With strict balance the boundary at 4 is forced.
    strict = cluster_layers(flops, edges, 2, delta=0.0)
    assert strict.boundaries == (0, 4, 8)
    assert strict.max_input_bytes == 1e6 + 1.0


def test_input_bytes_table_counts_only_edges_entering_the_layer():
    table = input_bytes_table(4, [(0, 3, 7.0), (1, 2, 2.0)])
    assert table[2, 4] == 9.0  # both edges enter [2, 4)
    assert table[1, 4] == 7.0  # (1, 2) starts inside [1, 4): internal
    assert table[1, 3] == 0.0  # (0, 3) lands after [1, 3)
    assert table[2, 3] == 2.0  # only (1, 2)
    assert table[3, 4] == 7.0  # only (0, 3)
    assert table[0, 4] == 0.0  # nothing enters the first layer
    assert table[2, 2] == 0.0


def test_a_heavy_op_gets_a_layer_of_its_own_without_relaxing_balance():
    flops = [90.0, 2.0, 2.0, 2.0, 2.0, 2.0]  # op 0 holds 90% of the flops (a vocabulary projection)
    edges = [(i, i + 1, 1.0) for i in range(5)]
    lay = cluster_layers(flops, edges, 3, delta=0.5)
    assert lay.delta == 0.5 and lay.boundaries[:2] == (0, 1)
    bf = brute_force_layers(flops, edges, 3, delta=0.5)
    assert bf.delta == 0.5 and bf.max_input_bytes == lay.max_input_bytes


def test_delta_relaxed_and_reported_when_balance_impossible():
    flops = [1.0, 98.0, 1.0]  # the heavy op cannot be alone in one of 2 layers
    edges = [(0, 1, 1.0), (1, 2, 1.0)]
    lay = cluster_layers(flops, edges, 2, delta=0.5)
    # needs (1 + d) * 100 / 2 >= 99  ->  d >= 0.98  ->  0.5, 1 tried
    assert lay.delta == 1.0
    bf = brute_force_layers(flops, edges, 2, delta=0.5)
    assert bf.delta == 1.0 and bf.max_input_bytes == lay.max_input_bytes


def test_zero_delta_relaxes_from_one():
    lay = cluster_layers([1.0, 3.0, 1.0], [], 2, delta=0.0)
    assert lay.delta == 1.0  # 0 -> 1.0 (=L-1, always feasible)


def test_larger_instance_is_fast_and_valid():
    rng = np.random.default_rng(1)
    k = 300
    flops = [float(x) for x in rng.integers(1, 100, size=k)]
    edges = [(i, i + 1, float(rng.integers(1, 50))) for i in range(k - 1)]
    edges += [(i, min(k - 1, i + 17), 500.0) for i in range(0, k - 1, 29)]
    lay = cluster_layers(flops, edges, 16, delta=0.3)
    _check_valid(lay, flops, edges, 16)


@pytest.mark.parametrize(
    "flops, edges, num_layers, delta, msg",
    [
        ([1.0, 2.0], [], 0, 0.5, "num_layers"),
        ([1.0, 2.0], [], 3, 0.5, "num_layers"),
        ([], [], 1, 0.5, "empty"),
        ([1.0, -2.0], [], 1, 0.5, "non-negative"),
        ([1.0, 2.0], [(0, 2, 1.0)], 1, 0.5, "out of range"),
        ([1.0, 2.0], [(-1, 1, 1.0)], 1, 0.5, "out of range"),
        ([1.0, 2.0], [(1, 1, 1.0)], 1, 0.5, "src < dst"),
        ([1.0, 2.0], [(1, 0, 1.0)], 1, 0.5, "src < dst"),
        ([1.0, 2.0], [(0, 1, -1.0)], 1, 0.5, "nbytes"),
        ([1.0, 2.0], [], 1, -0.1, "delta"),
    ],
)
def test_bad_input_raises(flops, edges, num_layers, delta, msg):
    with pytest.raises(ValueError, match=msg):
        cluster_layers(flops, edges, num_layers, delta)
    with pytest.raises(ValueError, match=msg):
        brute_force_layers(flops, edges, num_layers, delta)


def test_brute_force_refuses_huge_enumeration():
    with pytest.raises(ValueError, match="combinations"):
        brute_force_layers([1.0] * 40, [], 10)
