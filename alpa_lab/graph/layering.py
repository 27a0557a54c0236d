"""Operator clustering into layers (Alpa, OSDI'22, sec. 5.2, eq. 6).

Alpa's inter-op pass first groups the K operators of a (topologically sorted)
graph into L contiguous layers.  The layers should be FLOP-balanced (so that a
later stage assignment has even building blocks) and should receive little
data from earlier layers (so that stage boundaries, which fall on layer
boundaries, are cheap to communicate across).  We solve this exactly:

* constraint: every layer's FLOPs <= (1 + delta) * total_flops / L, except a layer of a
  single op (an op heavier than the budget, e.g. a language model's vocabulary
  projection, cannot be split; without this exception one such op would force delta up
  for every other layer);
* objective:  minimise max_i C(layer_i), where C([j, k)) is the total bytes of
  edges (src, dst) with src < j <= dst < k, i.e. the data a layer receives
  from earlier layers;
* tie-break:  among all clusterings achieving the optimal maximum, minimise the
  *sum* of C over layers (total bytes crossing boundaries); remaining ties go
  to the lexicographically smallest boundary tuple when reading boundaries
  from the last one backwards (DP argmin takes the smallest predecessor).

If no clustering satisfies the balance constraint, delta is relaxed
(delta, 2*delta, 4*delta, ...; starting from 1.0 if delta == 0) until one
does; this terminates because delta >= L - 1 makes every clustering feasible.
The delta actually used is reported in :class:`Layering`.

Pure functions over plain data; no JAX. It sits in ``graph`` rather than ``passes`` because
automatic layering (``graph.markers.auto_layers``) runs it while tracing; the inter-op pass
uses the layers it makes.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Iterator, Sequence

import numpy as np

__all__ = ["Layering", "cluster_layers", "brute_force_layers", "input_bytes_table"]

Edge = tuple[int, int, float]

_MAX_BRUTE_FORCE_COMBINATIONS = 200_000
_REL_TOL = 1e-12  # slack on the FLOP budget so float round-off never breaks exact balance


@dataclass(frozen=True)
class Layering:
    """A clustering of ops into contiguous layers [boundaries[i], boundaries[i+1])."""

    boundaries: tuple[int, ...]
    max_input_bytes: float
    layer_flops: tuple[float, ...]
    delta: float

    @property
    def num_layers(self) -> int:
        return len(self.boundaries) - 1


# --------------------------------------------------------------------------- #
# validation and shared helpers
# --------------------------------------------------------------------------- #


def _validate(
    flops: Sequence[float], edges: Sequence[Edge], num_layers: int, delta: float
) -> tuple[np.ndarray, list[Edge]]:
    """Reject malformed input early, with messages that name the offending item."""
    f = np.asarray(list(flops), dtype=float)
    if f.ndim != 1:
        raise ValueError("flops must be a 1-D sequence of numbers")
    k = len(f)
    if k == 0:
        raise ValueError("flops is empty: need at least one op")
    if not np.all(np.isfinite(f)):
        raise ValueError("flops must be finite")
    if np.any(f < 0):
        bad = int(np.argmax(f < 0))
        raise ValueError(f"flops must be non-negative; flops[{bad}] = {f[bad]}")
    if isinstance(num_layers, bool) or int(num_layers) != num_layers:
        raise ValueError(f"num_layers must be an integer, got {num_layers!r}")
    if num_layers < 1 or num_layers > k:
        raise ValueError(f"num_layers must be in [1, {k}] (number of ops), got {num_layers}")
    if not (math.isfinite(delta) and delta >= 0):
        raise ValueError(f"delta must be a finite non-negative number, got {delta}")
    clean: list[Edge] = []
    for i, e in enumerate(edges):
        if len(e) != 3:
            raise ValueError(f"edge #{i} must be (src, dst, nbytes), got {e!r}")
        src, dst, nbytes = e
        if int(src) != src or int(dst) != dst:
            raise ValueError(f"edge #{i} {e!r}: src/dst must be integers")
        src, dst = int(src), int(dst)
        if not (0 <= src < k and 0 <= dst < k):
            raise ValueError(f"edge #{i} {e!r}: src/dst out of range [0, {k})")
        if src >= dst:
            raise ValueError(f"edge #{i} {e!r}: need src < dst (ops are topologically ordered)")
        nbytes = float(nbytes)
        if not (math.isfinite(nbytes) and nbytes >= 0):
            raise ValueError(f"edge #{i} {e!r}: nbytes must be finite and non-negative")
        clean.append((src, dst, nbytes))
    return f, clean


def _delta_schedule(delta: float, num_layers: int) -> Iterator[float]:
    """delta, 2*delta, 4*delta, ...; the last value is always >= L - 1 (always feasible)."""
    d = float(delta)
    while True:
        yield d
        if d >= num_layers - 1:
            return
        d = 2.0 * d if d > 0 else 1.0


def _budget(total: float, num_layers: int, delta: float) -> float:
    """Per-layer FLOP cap, with a tiny relative slack for float round-off."""
    cap = (1.0 + delta) * total / num_layers
    return cap * (1.0 + _REL_TOL) + _REL_TOL


def input_bytes_table(num_ops: int, edges: Sequence[Edge]) -> np.ndarray:
    """C[j, k] = bytes of edges with src < j <= dst < k (entries with j >= k are 0).

    O(K^2) time and memory: A[j, d] = sum_{s<j} E[s, d] (cumulative over rows),
    then C[j, k] = sum_{d=j}^{k-1} A[j, d] (masked cumulative over columns).
    About 32 MB for K = 2000.
    """
    k = num_ops
    e = np.zeros((k, k), dtype=float)
    for src, dst, nbytes in edges:
        e[src, dst] += nbytes
    a = np.zeros((k + 1, k), dtype=float)
    a[1:] = np.cumsum(e, axis=0)  # a[j, d] = sum over sources s < j
    j_idx = np.arange(k + 1)[:, None]
    d_idx = np.arange(k)[None, :]
    a = np.where(d_idx >= j_idx, a, 0.0)  # only destinations inside [j, ...)
    c = np.zeros((k + 1, k + 1), dtype=float)
    c[:, 1:] = np.cumsum(a, axis=1)
    return c


def _make_layering(
    boundaries: Sequence[int], flops: np.ndarray, table: np.ndarray, delta: float
) -> Layering:
    b = tuple(int(x) for x in boundaries)
    pairs = list(zip(b[:-1], b[1:]))
    return Layering(
        boundaries=b,
        max_input_bytes=float(max(table[j, k] for j, k in pairs)),
        layer_flops=tuple(float(flops[j:k].sum()) for j, k in pairs),
        delta=float(delta),
    )


# --------------------------------------------------------------------------- #
# dynamic program
# --------------------------------------------------------------------------- #


def _dp_min_max(table: np.ndarray, feasible: np.ndarray, num_layers: int) -> float:
    """G(k, l) = min_{j<k, feasible} max(G(j, l-1), C(j, k)); returns G(K, L) (inf if none)."""
    n = table.shape[0]  # K + 1
    g = np.full(n, np.inf)
    g[0] = 0.0
    for _ in range(num_layers):
        cand = np.where(feasible, np.maximum(g[:, None], table), np.inf)  # [j, k]
        g = cand.min(axis=0)
    return float(g[-1])


def _dp_min_sum(
    table: np.ndarray, feasible: np.ndarray, num_layers: int, cap: float
) -> tuple[int, ...]:
    """Tie-break pass: minimise sum of C with every layer's C <= cap; returns boundaries."""
    n = table.shape[0]
    allowed = feasible & (table <= cap)
    s = np.full(n, np.inf)
    s[0] = 0.0
    parents = []
    for _ in range(num_layers):
        cand = np.where(allowed, s[:, None] + table, np.inf)
        parents.append(cand.argmin(axis=0))  # smallest j on ties
        s = cand.min(axis=0)
    assert math.isfinite(s[-1]), "tie-break pass lost feasibility"
    bounds = [n - 1]
    for par in reversed(parents):
        bounds.append(int(par[bounds[-1]]))
    return tuple(reversed(bounds))


def cluster_layers(
    flops: Sequence[float],
    edges: Sequence[Edge],
    num_layers: int,
    delta: float = 0.5,
) -> Layering:
    """Cluster ops into `num_layers` contiguous, FLOP-balanced layers minimising max input bytes.

    Exact DP (see module docstring for objective and tie-break).  Cost: O(K^2 + |E|)
    to build the C table, then O(L * K^2) (numpy-vectorised over j and k) per tried
    delta; the number of deltas tried is O(log(L / delta)).
    """
    f, clean = _validate(flops, edges, num_layers, delta)
    k = len(f)
    table = input_bytes_table(k, clean)
    prefix = np.concatenate([[0.0], np.cumsum(f)])
    seg = prefix[None, :] - prefix[:, None]  # seg[j, k] = flops of [j, k)
    nonempty = np.arange(k + 1)[:, None] < np.arange(k + 1)[None, :]
    total = float(prefix[-1])
    for d in _delta_schedule(delta, num_layers):
        single = np.eye(k + 1, k=1, dtype=bool)  # [j, j + 1): one op, always allowed
        feasible = nonempty & ((seg <= _budget(total, num_layers, d)) | single)
        best = _dp_min_max(table, feasible, num_layers)
        if math.isfinite(best):
            bounds = _dp_min_sum(table, feasible, num_layers, best)
            return _make_layering(bounds, f, table, d)
    raise AssertionError("unreachable: delta >= L - 1 is always feasible")


# --------------------------------------------------------------------------- #
# exhaustive reference (tests only)
# --------------------------------------------------------------------------- #


def _direct_input_bytes(edges: Sequence[Edge], j: int, k: int) -> float:
    """C(j, k) straight from the edge list; independent of the table, for cross-checking."""
    return float(sum(nb for src, dst, nb in edges if src < j <= dst < k))


def brute_force_layers(
    flops: Sequence[float],
    edges: Sequence[Edge],
    num_layers: int,
    delta: float = 0.5,
) -> Layering:
    """Exhaustive search over all C(K-1, L-1) boundary choices; reference for tests.

    Same objective, tie-break (min max, then min sum, then first found in
    lexicographic enumeration) and delta relaxation as :func:`cluster_layers`.
    Raises ValueError above 200k combinations.
    """
    f, clean = _validate(flops, edges, num_layers, delta)
    k = len(f)
    n_comb = math.comb(k - 1, num_layers - 1)
    if n_comb > _MAX_BRUTE_FORCE_COMBINATIONS:
        raise ValueError(
            f"brute force would enumerate {n_comb} combinations "
            f"(> {_MAX_BRUTE_FORCE_COMBINATIONS}); use cluster_layers"
        )
    total = float(f.sum())
    for d in _delta_schedule(delta, num_layers):
        budget = _budget(total, num_layers, d)
        best_key: tuple[float, float] | None = None
        best_bounds: tuple[int, ...] | None = None
        for inner in itertools.combinations(range(1, k), num_layers - 1):
            bounds = (0, *inner, k)
            pairs = list(zip(bounds[:-1], bounds[1:]))
            if any(kk - j > 1 and f[j:kk].sum() > budget for j, kk in pairs):
                continue
            costs = [_direct_input_bytes(clean, j, kk) for j, kk in pairs]
            key = (max(costs), sum(costs))
            if best_key is None or key < best_key:
                best_key, best_bounds = key, bounds
        if best_bounds is not None:
            return _make_layering(best_bounds, f, input_bytes_table(k, clean), d)
    raise AssertionError("unreachable: delta >= L - 1 is always feasible")
