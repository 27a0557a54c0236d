"""Inter-operator pass: stage construction by dynamic programming (Alpa, OSDI'22, sec. 5.2).

The L layers (from :mod:`alpa_lab.passes.layering`) are sliced into S contiguous stages;
stage i runs on a sub-mesh of shape (n_i, m_i) from :func:`submesh_shapes`, viewed as a
logical mesh (a, b) with a * b = n_i * m_i, and costs t_i per micro-batch (forward +
backward, as profiled/estimated by the intra-op pass). With B micro-batches the pipeline
latency is (eq. 2)

    T = sum_i t_i + (B - 1) * max_j t_j.

The max term makes T non-decomposable, so Alpa enumerates t_max and solves, for each, the
decomposable problem (eq. 3-4)

    F(s, k, d; t_max) = min total latency of slicing layers k..L-1 into s stages on exactly
                        d devices, every stage time <= t_max
    T*(t_max)         = min_s F(s, 0, N*M; t_max) + (B - 1) * t_max,

and returns the best T*(t_max). Candidates are tried in increasing order and the search
stops once B * t_max >= best T (any plan whose slowest stage is t_max costs at least
B * t_max, since sum_i t_i >= t_max). Sub-mesh sizes summing to N*M suffice for a tiling
(Appendix A), which :func:`place_submeshes` then builds to give real device ids.

Pure functions over a ``stage_cost`` callable; no JAX.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from alpa_lab.passes.submesh import PlacementError, place_submeshes, submesh_shapes

__all__ = [
    "InterOpError",
    "InterOpPlan",
    "StageCost",
    "StageCostFn",
    "StagePlan",
    "brute_force_stages",
    "logical_shapes",
    "stage_dp",
]

Shape = tuple[int, int]

_MAX_BRUTE_FORCE_COMBINATIONS = 2_000_000


class InterOpError(ValueError):
    """No feasible stage construction exists, or the arguments are malformed."""


@dataclass(frozen=True)
class StageCost:
    """Cost of one stage on one (sub-mesh, logical mesh): per-micro-batch t_intra and memory."""

    time: float
    memory: float = 0.0


StageCostFn = Callable[[int, int, Shape, Shape], "StageCost | None"]


@dataclass(frozen=True)
class StagePlan:
    """One pipeline stage: layers [start, end), its sub-mesh, logical mesh, devices, t_i."""

    layers: tuple[int, int]
    submesh_shape: Shape
    logical_shape: Shape
    device_ids: tuple[int, ...]
    time: float


@dataclass(frozen=True)
class InterOpPlan:
    """The stage construction minimising eq. 2; ``t_max`` is the slowest stage's time."""

    stages: tuple[StagePlan, ...]
    total_time: float
    t_max: float
    num_microbatches: int

    @property
    def num_stages(self) -> int:
        return len(self.stages)


# --------------------------------------------------------------------------- #
# helpers
# --------------------------------------------------------------------------- #


def logical_shapes(submesh_shape: Shape) -> tuple[Shape, ...]:
    """All 2-D views (a, b), a * b = n * m, of a sub-mesh (1-D meshes included), a ascending.

    Alpa lets the intra-op pass pick the logical mesh shape per stage, so the DP must
    consider each one.
    """
    n, m = submesh_shape
    size = n * m
    return tuple((a, size // a) for a in range(1, size + 1) if size % a == 0)


def _pipeline_latency(times: list[float] | tuple[float, ...], num_microbatches: int) -> float:
    """Eq. 2: sum of stage latencies plus (B - 1) times the slowest stage."""
    return float(sum(times)) + (num_microbatches - 1) * float(max(times))


def _check_int(name: str, value: object, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise InterOpError(f"{name} must be an int, got {value!r}")
    if value < minimum:
        raise InterOpError(f"{name} must be >= {minimum}, got {value}")
    return int(value)


def _validate(
    num_layers: object,
    num_hosts: object,
    devices_per_host: object,
    num_microbatches: object,
    stage_cost: object,
    max_stages: object,
) -> tuple[int, int, int, int, int]:
    """Reject bad arguments early; returns (L, N, M, B, max stages allowed)."""
    L = _check_int("num_layers", num_layers)
    N = _check_int("num_hosts", num_hosts)
    M = _check_int("devices_per_host", devices_per_host)
    B = _check_int("num_microbatches", num_microbatches)
    if not callable(stage_cost):
        raise InterOpError(f"stage_cost must be callable, got {stage_cost!r}")
    # every stage needs >= 1 layer and >= 1 device
    cap = min(L, N * M)
    if max_stages is not None:
        cap = min(cap, _check_int("max_stages", max_stages))
    return L, N, M, B, cap


def _checked_cost(
    stage_cost: StageCostFn, start: int, end: int, shape: Shape, logical: Shape
) -> StageCost | None:
    """Call stage_cost and validate its answer (a StageCost with finite time >= 0, or None)."""
    cost = stage_cost(start, end, shape, logical)
    if cost is None:
        return None
    if not isinstance(cost, StageCost):
        raise InterOpError(
            f"stage_cost({start}, {end}, {shape}, {logical}) must return StageCost or None, "
            f"got {cost!r}"
        )
    if not (math.isfinite(cost.time) and cost.time >= 0):
        raise InterOpError(
            f"stage_cost({start}, {end}, {shape}, {logical}) returned time {cost.time}; "
            "it must be finite and >= 0 (return None for an infeasible stage)"
        )
    return cost


@dataclass(frozen=True)
class _Option:
    """Best logical mesh for one (layer range, sub-mesh): the min-time feasible one."""

    time: float
    logical_shape: Shape


def _profile(
    stage_cost: StageCostFn, L: int, shapes: list[Shape]
) -> dict[tuple[int, int, Shape], _Option]:
    """Ask stage_cost once per (range, sub-mesh, logical shape); keep the fastest logical mesh.

    Taking the min over logical shapes is exact: a faster stage only lowers both
    sum_i t_i and max_j t_j in eq. 2.
    """
    table: dict[tuple[int, int, Shape], _Option] = {}
    logicals_of = [(shape, logical_shapes(shape)) for shape in shapes]
    for start in range(L):
        for end in range(start + 1, L + 1):
            for shape, logicals in logicals_of:
                best_time, best_logical = math.inf, None
                for logical in logicals:
                    cost = _checked_cost(stage_cost, start, end, shape, logical)
                    if cost is not None and (best_logical is None or cost.time < best_time):
                        best_time, best_logical = cost.time, logical
                if best_logical is not None:
                    table[(start, end, shape)] = _Option(float(best_time), best_logical)
    return table


class _Dense:
    """The profiled table as dense arrays for the vectorised DP.

    ``times[k, end, j]`` is the fastest option for layers [k, end) on any sub-mesh of the
    j-th distinct size ``sizes[j]`` (inf where none). Taking the min over sub-meshes of
    equal size is exact: t + F is monotone in t, so min_i(t_i) + F == min_i(t_i + F) in
    floating point too. ``shift[j, d]`` indexes d - sizes[j] into a row padded with one
    trailing inf (index D + 1) where d < sizes[j].
    """

    def __init__(self, table: dict[tuple[int, int, Shape], _Option], L: int, D: int):
        sizes = sorted({shape[0] * shape[1] for (_, _, shape) in table if shape[0] * shape[1] <= D})
        index = {size: j for j, size in enumerate(sizes)}
        times = np.full((L + 1, L + 1, len(sizes)), np.inf)
        for (start, end, shape), opt in table.items():
            j = index.get(shape[0] * shape[1])
            if j is not None and opt.time < times[start, end, j]:
                times[start, end, j] = opt.time
        d = np.arange(D + 1)
        shift = d[None, :] - np.asarray(sizes, dtype=np.int64)[:, None]
        shift[shift < 0] = D + 1
        self.sizes, self.times, self.shift = sizes, times, shift
        self.L, self.D = L, D

    def allowed(self, t_max: float) -> np.ndarray:
        return np.where(self.times <= t_max, self.times, np.inf)


def _shifted(row: np.ndarray, shift: np.ndarray) -> np.ndarray:
    """H[j, d] = row[d - sizes[j]] (inf where d < sizes[j])."""
    return np.append(row, np.inf)[shift]


class _MinOverStages:
    """G(k, d) = min_s F(s, k, d; t_max): eq. 3 without the stage-count dimension.

    Exact when the number of stages is not capped below min(L, D) (which any slicing
    already satisfies): every path's latency is summed in the same order as in F, so
    G(0, D) == min_s F(s, 0, D) bit for bit. Rows are kept across increasing t_max and
    only rows k <= (largest start of a newly allowed option) are recomputed.
    """

    def __init__(self, dense: _Dense):
        L, D = dense.L, dense.D
        self.dense = dense
        self.G = np.full((L + 1, D + 1), np.inf)
        self.G[L, 0] = 0.0
        self.H = np.full((L + 1, len(dense.sizes), D + 1), np.inf)
        self.H[L] = _shifted(self.G[L], dense.shift)

    def solve(self, allowed: np.ndarray, top: int) -> float:
        """Recompute rows top..0 with ``allowed`` times; returns G(0, D)."""
        G, H, shift = self.G, self.H, self.dense.shift
        for k in range(top, -1, -1):
            t = allowed[k, k + 1 :]
            ends = np.flatnonzero(np.isfinite(t).any(axis=1))
            if ends.size == 0:
                G[k] = np.inf
            else:
                lo, hi = ends[0], ends[-1] + 1
                cand = t[lo:hi, :, None] + H[k + 1 + lo : k + 1 + hi]
                G[k] = cand.min(axis=(0, 1))
            H[k] = _shifted(G[k], shift)
        return float(G[0, -1])


def _solve_f(dense: _Dense, allowed: np.ndarray, S: int, stop_at: float | None = None) -> np.ndarray:
    """F[s, k, d] of eq. 3 for one t_max (numpy over k, end and d); inf where infeasible.

    With ``stop_at``, stops after the first s with F[s, 0, D] == stop_at (the rest is left
    inf; it is not needed to reconstruct that s).
    """
    L, D, sizes = dense.L, dense.D, dense.sizes
    F = np.full((S + 1, L + 1, D + 1), np.inf)
    F[0, L, 0] = 0.0
    for s in range(1, S + 1):
        # stage s (counting from the end) starts at k <= L - s and ends at end <= L - s + 1
        kmax, emax = L - s + 1, L - s + 2
        prev = F[s - 1, :emax]
        row = F[s, :kmax]
        for j, size in enumerate(sizes):
            t = allowed[:kmax, :emax, j]
            if not np.isfinite(t).any():
                continue
            cand = (t[:, :, None] + prev[None, :, : D + 1 - size]).min(axis=1)
            np.minimum(row[:, size:], cand, out=row[:, size:])
        if stop_at is not None and F[s, 0, D] == stop_at:
            break
    return F


def _reconstruct(
    F: np.ndarray,
    table: dict[tuple[int, int, Shape], _Option],
    L: int,
    D: int,
    s: int,
    t_max: float,
) -> list[tuple[int, int, Shape, _Option]]:
    """Walk F back from (s, 0, D): pick any choice attaining the stored minimum exactly."""
    by_start: dict[int, list[tuple[int, Shape, _Option]]] = {}
    for (start, end, shape), opt in table.items():
        by_start.setdefault(start, []).append((end, shape, opt))
    stages: list[tuple[int, int, Shape, _Option]] = []
    k, d = 0, D
    while s > 0:
        target = F[s, k, d]
        for end, shape, opt in by_start.get(k, ()):
            size = shape[0] * shape[1]
            if opt.time > t_max or size > d:
                continue
            if opt.time + F[s - 1, end, d - size] == target:
                stages.append((k, end, shape, opt))
                k, d, s = end, d - size, s - 1
                break
        else:  # pragma: no cover - F was built from exactly these terms
            raise AssertionError("inter-op DP reconstruction failed")
    assert k == L and d == 0
    return stages


# --------------------------------------------------------------------------- #
# public API
# --------------------------------------------------------------------------- #


def stage_dp(
    num_layers: int,
    num_hosts: int,
    devices_per_host: int,
    num_microbatches: int,
    stage_cost: StageCostFn,
    max_stages: int | None = None,
) -> InterOpPlan:
    """Alpa's stage-construction DP (eq. 2-4): optimal slicing, sub-meshes and logical meshes.

    ``stage_cost(start, end, submesh_shape, logical_shape)`` is called exactly once per
    distinct argument tuple. Raises :class:`InterOpError` on bad arguments or when no
    slicing fits the cluster.
    """
    L, N, M, B, S = _validate(
        num_layers, num_hosts, devices_per_host, num_microbatches, stage_cost, max_stages
    )
    D = N * M
    shapes = submesh_shapes(N, M)
    table = _profile(stage_cost, L, shapes)
    if not table:
        raise InterOpError(
            f"no slicing of {L} layers fits {N}x{M} devices: stage_cost is infeasible for "
            "every (layer range, sub-mesh, logical shape)"
        )

    dense = _Dense(table, L, D)
    uncapped = S >= min(L, D)
    best_value, best_tmax, best_s, best_F = math.inf, math.nan, 0, None
    if dense.sizes:
        # lower bound on sum_i t_i for any t_max: the DP with every option allowed
        every = dense.allowed(math.inf)
        if uncapped:
            floor = _MinOverStages(dense).solve(every, L - 1)
        else:
            floor = float(_solve_f(dense, every, S)[1:, 0, D].min())
        starts_at: dict[float, int] = {}
        for (start, _, _), opt in table.items():
            if starts_at.get(opt.time, -1) < start:
                starts_at[opt.time] = start
        solver = _MinOverStages(dense) if uncapped else None
        top = -1  # rows 0..top of the incremental solver are out of date
        for t_max in sorted(starts_at):
            top = max(top, starts_at[t_max])
            if math.isinf(floor) or B * t_max >= best_value:  # early pruning (sec. 5.2)
                break
            # every plan with slowest stage <= t_max costs >= floor + (B - 1) * t_max
            if floor + (B - 1) * t_max >= best_value:
                break
            allowed = dense.allowed(t_max)
            if solver is not None:
                total = solver.solve(allowed, top)
                top = -1
                value = total + (B - 1) * t_max
                if value < best_value:
                    best_value, best_tmax, best_F = value, t_max, total
            else:
                F = _solve_f(dense, allowed, S)
                s = int(np.argmin(F[1:, 0, D])) + 1
                value = float(F[s, 0, D]) + (B - 1) * t_max
                if value < best_value:
                    best_value, best_tmax, best_s, best_F = value, t_max, s, F
        if uncapped and best_F is not None:
            total = best_F
            best_F = _solve_f(dense, dense.allowed(best_tmax), S, stop_at=total)
            best_s = int(np.argmin(best_F[1:, 0, D])) + 1
            assert best_F[best_s, 0, D] == total

    if best_F is None:
        limit = f" with at most {max_stages} stages" if max_stages is not None else ""
        raise InterOpError(
            f"no slicing of {L} layers fits {N}x{M} devices{limit}: {len(table)} feasible "
            f"(layer range, sub-mesh) options exist, but none combine into contiguous stages "
            f"covering all layers on exactly {D} devices"
        )

    chosen = _reconstruct(best_F, table, L, D, best_s, best_tmax)
    try:
        placements = place_submeshes([shape for _, _, shape, _ in chosen], N, M)
    except PlacementError as err:
        raise InterOpError(f"optimal stage sub-meshes cannot be placed on the cluster: {err}") from err
    stages = tuple(
        StagePlan((start, end), shape, opt.logical_shape, p.device_ids, opt.time)
        for (start, end, shape, opt), p in zip(chosen, placements)
    )
    times = [st.time for st in stages]
    return InterOpPlan(
        stages=stages,
        total_time=_pipeline_latency(times, B),
        t_max=max(times),
        num_microbatches=B,
    )


def _compositions(L: int, max_parts: int):
    """All slicings of layers 0..L-1 into contiguous [start, end) ranges (<= max_parts)."""
    for cuts_count in range(0, min(L, max_parts)):
        for cuts in itertools.combinations(range(1, L), cuts_count):
            bounds = (0, *cuts, L)
            yield [(bounds[i], bounds[i + 1]) for i in range(len(bounds) - 1)]


def brute_force_stages(
    num_layers: int,
    num_hosts: int,
    devices_per_host: int,
    num_microbatches: int,
    stage_cost: StageCostFn,
    max_stages: int | None = None,
) -> float:
    """Reference optimum of eq. 2 by exhaustive search (for tests).

    Enumerates every contiguous slicing, every sub-mesh assignment whose sizes sum to
    N*M, and every logical shape per stage; returns the best T. Raises
    :class:`InterOpError` when nothing is feasible or the search would be too large.
    """
    L, N, M, B, S = _validate(
        num_layers, num_hosts, devices_per_host, num_microbatches, stage_cost, max_stages
    )
    D = N * M
    shapes = submesh_shapes(N, M)
    memo: dict[tuple[int, int, Shape, Shape], StageCost | None] = {}

    def cost(start: int, end: int, shape: Shape, logical: Shape) -> StageCost | None:
        key = (start, end, shape, logical)
        if key not in memo:
            memo[key] = _checked_cost(stage_cost, start, end, shape, logical)
        return memo[key]

    best = math.inf
    visited = 0
    for slicing in _compositions(L, S):
        for assignment in itertools.product(shapes, repeat=len(slicing)):
            if sum(r * c for r, c in assignment) != D:
                continue
            per_stage = [logical_shapes(shape) for shape in assignment]
            for logicals in itertools.product(*per_stage):
                visited += 1
                if visited > _MAX_BRUTE_FORCE_COMBINATIONS:
                    raise InterOpError(
                        f"brute force over {L} layers on {N}x{M} devices exceeds "
                        f"{_MAX_BRUTE_FORCE_COMBINATIONS} combinations; use stage_dp"
                    )
                times = []
                for (start, end), shape, logical in zip(slicing, assignment, logicals):
                    c = cost(start, end, shape, logical)
                    if c is None:
                        break
                    times.append(c.time)
                else:
                    best = min(best, _pipeline_latency(times, B))
    if math.isinf(best):
        raise InterOpError(f"no slicing of {L} layers fits {N}x{M} devices (brute force)")
    return best
