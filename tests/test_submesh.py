"""Sub-mesh shapes (sec. 5.2) and the Appendix A covering property."""

from __future__ import annotations

import random

import pytest

from alpa_lab.passes.submesh import Placement, PlacementError, place_submeshes, submesh_shapes


@pytest.mark.parametrize(
    "n, m, expected",
    [
        (1, 8, [(1, 1), (1, 2), (1, 4), (1, 8)]),
        (2, 8, [(1, 1), (1, 2), (1, 4), (1, 8), (2, 8)]),
        (4, 4, [(1, 1), (1, 2), (1, 4), (2, 4), (3, 4), (4, 4)]),
        (3, 6, [(1, 1), (1, 2), (1, 4), (1, 6), (2, 6), (3, 6)]),
        (1, 1, [(1, 1)]),
    ],
)
def test_submesh_shapes(n, m, expected):
    assert submesh_shapes(n, m) == expected


@pytest.mark.parametrize("n, m", [(0, 4), (2, 0), (-1, 4), (1.5, 4), (True, 4)])
def test_submesh_shapes_rejects_bad_cluster(n, m):
    with pytest.raises(ValueError, match="num_hosts|devices_per_host"):
        submesh_shapes(n, m)


def _multisets(shapes, target, start=0):
    """All multisets of ``shapes`` (non-decreasing index order) whose sizes sum to target."""
    if target == 0:
        yield []
        return
    for j in range(start, len(shapes)):
        size = shapes[j][0] * shapes[j][1]
        if size <= target:
            for rest in _multisets(shapes, target - size, j):
                yield [shapes[j], *rest]


def _check(placements, shapes, n, m):
    assert len(placements) == len(shapes)
    seen = []
    for p, s in zip(placements, shapes):
        assert isinstance(p, Placement)
        assert p.shape == s
        rows, cols = s
        assert len(p.device_ids) == rows * cols
        assert len(p.hosts) == rows
        if cols == m:  # whole hosts, host-major
            assert p.device_ids == tuple(h * m + d for h in p.hosts for d in range(m))
        else:  # one host, contiguous, aligned
            assert rows == 1
            (h,) = p.hosts
            first = p.device_ids[0]
            assert p.device_ids == tuple(range(first, first + cols))
            assert first // m == h and (first + cols - 1) // m == h
            assert (first % m) % cols == 0
        seen.extend(p.device_ids)
    assert sorted(seen) == list(range(n * m))


@pytest.mark.parametrize("n, m", [(1, 1), (1, 2), (1, 4), (1, 8), (2, 4), (2, 8), (3, 4), (4, 4)])
def test_appendix_a_every_multiset_places(n, m):
    valid = submesh_shapes(n, m)
    rng = random.Random(n * 100 + m)
    count = 0
    for ms in _multisets(valid, n * m):
        for order in (ms, ms[::-1], rng.sample(ms, len(ms))):
            _check(place_submeshes(order, n, m), order, n, m)
        count += 1
        assert count < 5000, "enumeration unexpectedly large"
    assert count >= 1


def test_order_matches_input():
    shapes = [(1, 1), (2, 4), (1, 2), (1, 1)]
    out = place_submeshes(shapes, 3, 4)
    assert [p.shape for p in out] == shapes
    assert out[1].hosts == (0, 1)
    assert out[2].device_ids == (8, 9)
    assert out[0].device_ids == (10,) and out[3].device_ids == (11,)


def test_sizes_must_sum():
    with pytest.raises(PlacementError, match="sum to 12.*16 devices"):
        place_submeshes([(1, 8), (1, 4)], 2, 8)
    with pytest.raises(PlacementError, match="sum to 20"):
        place_submeshes([(2, 8), (1, 4)], 2, 8)


@pytest.mark.parametrize("bad", [(1, 3), (2, 3), (3, 8), (0, 8), (2, 4)])
def test_invalid_shape(bad):
    with pytest.raises(PlacementError, match=r"not a valid sub-mesh shape for a 2x8 cluster"):
        place_submeshes([bad, (1, 8)], 2, 8)


def test_malformed_shape():
    with pytest.raises(PlacementError, match="pair"):
        place_submeshes([(1, 2, 3)], 1, 8)
    with pytest.raises(PlacementError, match="ints"):
        place_submeshes([(1, 2.0)], 1, 2)


def test_placement_error_is_value_error():
    assert issubclass(PlacementError, ValueError)


def test_non_power_of_two_packing_failure_is_reported():
    # 3 x (1, 4) = 12 devices on 2 hosts of 6: sums fit, but no host holds two 4-blocks.
    with pytest.raises(PlacementError, match="cannot pack"):
        place_submeshes([(1, 4), (1, 4), (1, 4)], 2, 6)
    # ...while a packable multiset on M=6 works.
    shapes = [(1, 4), (1, 2), (1, 6)]
    _check(place_submeshes(shapes, 2, 6), shapes, 2, 6)


def test_placement_is_frozen():
    p = place_submeshes([(1, 1)], 1, 1)[0]
    with pytest.raises(AttributeError):
        p.shape = (1, 2)  # type: ignore[misc]
