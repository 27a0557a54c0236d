"""Inter-operator pass: stage construction by dynamic programming (Alpa, OSDI'22, sec. 5.2).

The L layers (from :mod:`alpa_lab.graph.layering`) are sliced into S contiguous stages;
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

and returns the best T*(t_max). The candidates (the options' times) start at the least t_max
with any feasible slicing (one min-max DP, ``_bottlenecks``) and none at or above a t_max with
B * t_max >= best T is needed (any plan whose slowest stage is t_max costs at least B * t_max,
since sum_i t_i >= t_max). Between those, F only falls as t_max grows, so ``_least_latency``
searches by branch and bound, with the same optimum as trying every candidate. Sub-mesh sizes summing to N*M suffice for a tiling
(Appendix A), which :func:`place_submeshes` then builds to give real device ids.

Memory (eq. 5, Alpa's ``max_n_succ_stages``): under a pipeline schedule the stage at
position s -- s stages from itself to the last one inclusive, s = 1 for the last stage --
holds ``in_flight(s)`` micro-batches of activations (1F1B: min(s, B); GPipe: B; eager
1F1B: min(2s - 1, B)). An option (layer range, sub-mesh, logical mesh) whose
``StageCost.max_in_flight`` is below ``in_flight(s)`` may not be used at position s. In F
above, the first stage of F(s, k, d) is at position s, so each s uses its own table of
eligible times; the stage-count-free fast path is only used when no limit binds.

Pure functions over a ``stage_cost`` callable; no JAX.
"""

from __future__ import annotations

import bisect
import itertools
import math
import operator
from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from alpa_lab.plan.timeline import pipeline_latency  # eq. 2: a pipeline plan's latency too
from alpa_lab.passes.submesh import PlacementError, place_submeshes, submesh_shapes

__all__ = [
    "InFlightFn",
    "InterOpError",
    "InterOpPlan",
    "RangeCostFn",
    "RangeCosts",
    "StageCost",
    "StageCostFn",
    "StagePlan",
    "brute_force_stages",
    "logical_shapes",
    "pipeline_latency",
    "profile_stage_options",
    "stage_dp",
    "stage_dp_capped",
    "stage_dp_uniform",
]

Shape = tuple[int, int]

_MAX_BRUTE_FORCE_COMBINATIONS = 2_000_000


class InterOpError(ValueError):
    """No feasible stage construction exists, or the arguments are malformed."""


@dataclass(frozen=True)
class StageCost:
    """Cost of one stage on one (sub-mesh, logical mesh): per-micro-batch t_intra and memory.

    ``max_in_flight`` is the most micro-batches of activations the stage can hold in device
    memory at once (None: no limit; 0: it does not fit at all, treated as infeasible). With
    ``stage_dp(..., in_flight=...)`` the option is only used at positions s with
    ``in_flight(s) <= max_in_flight``.
    """

    time: float
    memory: float = 0.0
    max_in_flight: int | None = None
    variant: str = ""
    """which of several plans of one logical mesh this is (``stage_cost`` may return a list:
    e.g. the fastest plan and a slower one that needs less memory); reported in StagePlan."""


StageCostFn = Callable[[int, int, Shape, Shape], "StageCost | None"]


@dataclass(frozen=True)
class RangeCosts:
    """One plan of a (sub-mesh, logical mesh) for every layer range at once: what ``stage_cost(start, end,
    ...)`` answers as ``StageCost(time[start, end], max_in_flight=max_in_flight[start, end], variant=variant)``,
    with ``time`` NaN where it answers nothing and ``max_in_flight`` -1 where it has no limit. Arrays of
    (L + 1, L + 1); only start < end is read.

    Why: the profile asks for every range, sub-mesh and logical mesh (66,000 calls on GPT-39B / 64
    devices, half a second); a planner whose costs are prefix sums makes each plan's ranges at once."""

    time: np.ndarray
    max_in_flight: np.ndarray
    variant: str = ""


RangeCostFn = Callable[[Shape, Shape], "Sequence[RangeCosts]"]
"""(sub-mesh, logical mesh) -> its plans over every range, in the order ``stage_cost`` lists them"""

InFlightFn = Callable[[int], int]


@dataclass(frozen=True)
class StagePlan:
    """One pipeline stage: layers [start, end), its sub-mesh, logical mesh, devices, t_i."""

    layers: tuple[int, int]
    submesh_shape: Shape
    logical_shape: Shape
    device_ids: tuple[int, ...]
    time: float
    variant: str = ""


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


def _in_flight_needs(in_flight: object, S: int) -> list[int] | None:
    """[0, in_flight(1), ..., in_flight(S)] (index = position s), or None without in_flight."""
    if in_flight is None:
        return None
    if not callable(in_flight):
        raise InterOpError(f"in_flight must be callable or None, got {in_flight!r}")
    return [0] + [_check_int(f"in_flight({s})", in_flight(s)) for s in range(1, S + 1)]


def _fits(max_in_flight: int | None, need: int | None) -> bool:
    """Whether an option holding at most ``max_in_flight`` micro-batches may hold ``need``."""
    return max_in_flight is None or need is None or max_in_flight >= need


def _checked_costs(
    stage_cost: StageCostFn, start: int, end: int, shape: Shape, logical: Shape
) -> list[StageCost]:
    """``stage_cost``'s answer as a list of checked plans (it may give one, several or None)."""
    cost = stage_cost(start, end, shape, logical)
    if isinstance(cost, (list, tuple)):
        return [c for c in (_check_one(c, start, end, shape, logical) for c in cost) if c is not None]
    checked = _check_one(cost, start, end, shape, logical)
    return [] if checked is None else [checked]


def _check_one(cost: object, start: int, end: int, shape: Shape, logical: Shape) -> StageCost | None:
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
    limit = cost.max_in_flight
    if limit is not None and (
        isinstance(limit, bool) or not isinstance(limit, (int, np.integer)) or limit < 0
    ):
        raise InterOpError(
            f"stage_cost({start}, {end}, {shape}, {logical}) returned max_in_flight {limit!r}; "
            "it must be None (no limit) or an int >= 0"
        )
    return cost


class _Option(NamedTuple):
    """One feasible logical mesh of a (layer range, sub-mesh) (a tuple: cheap to build)."""

    time: float
    logical_shape: Shape
    max_in_flight: int | None = None
    variant: str = ""


class _Options:
    """Every feasible logical mesh of one (layer range, sub-mesh), fastest first (ties in
    logical-shape order). ``time`` is the fastest one's."""

    __slots__ = ("options", "time")

    def __init__(self, options: tuple[_Option, ...]):
        self.options = options
        self.time = options[0].time

    def __repr__(self) -> str:
        return f"_Options({self.options!r})"

    def best(self, need: int | None) -> _Option | None:
        """The fastest option that may hold ``need`` micro-batches (None: no limit)."""
        if need is None:
            return self.options[0]
        for opt in self.options:
            if opt.max_in_flight is None or opt.max_in_flight >= need:
                return opt
        return None


_time_of = operator.itemgetter(0)


def _frontier(found: list[tuple[float, Shape, int | None, str]]) -> tuple[_Option, ...]:
    """The options that are the fastest eligible one for some in-flight count: by time
    (stable, so ties keep logical-shape order), each kept only if it holds more than every
    faster one (None = no limit, which ends the list). The rest can never be chosen."""
    found.sort(key=_time_of)
    kept: list[_Option] = []
    most = 0
    for time, logical, limit, variant in found:
        if limit is None:
            kept.append(_Option(time, logical, None, variant))
            break
        if limit > most:
            kept.append(_Option(time, logical, limit, variant))
            most = limit
    return tuple(kept)


def _options(found: list[tuple[float, Shape, int | None, str]]) -> _Options:
    """The options of one (range, sub-mesh) that can be chosen (``_frontier``), from its feasible ones."""
    return _Options((_Option(*found[0]),)) if len(found) == 1 else _Options(_frontier(found))


def _profile(
    stage_cost: StageCostFn, L: int, shapes: list[Shape], stats: dict[str, int] | None = None,
    range_costs: RangeCostFn | None = None,
) -> dict[tuple[int, int, Shape], _Options]:
    """Ask stage_cost once per (range, sub-mesh, logical shape); keep every feasible one. With
    ``range_costs``, ask it once per (sub-mesh, logical shape) instead: the same table (``_profile_ranges``).

    Without memory limits only the fastest logical mesh matters (a faster stage only lowers
    both sum_i t_i and max_j t_j in eq. 2); with them the fastest may be ineligible at some
    positions, so every option that is the fastest eligible one for some in-flight count is
    kept, fastest first (:func:`_frontier`; the others are never chosen, so the DP, its
    t_max candidates and the reported logical shapes are unchanged by dropping them).
    Options with ``max_in_flight == 0`` cannot hold one micro-batch and are dropped
    (counted in ``stats["no_memory"]``).
    """
    if range_costs is not None:
        return _profile_ranges(range_costs, L, shapes, stats)
    table: dict[tuple[int, int, Shape], _Options] = {}
    logicals_of = [(shape, logical_shapes(shape)) for shape in shapes]
    no_memory = 0
    for start in range(L):
        for end in range(start + 1, L + 1):
            for shape, logicals in logicals_of:
                found: list[tuple[float, Shape, int | None, str]] = []
                for logical in logicals:
                    for cost in _checked_costs(stage_cost, start, end, shape, logical):
                        limit = cost.max_in_flight
                        if limit is not None:
                            if limit == 0:
                                no_memory += 1
                                continue
                            limit = int(limit)
                        found.append((float(cost.time), logical, limit, cost.variant))
                if found:
                    table[(start, end, shape)] = _options(found)
    if stats is not None:
        stats["no_memory"] = stats.get("no_memory", 0) + no_memory
    return table


def _profile_ranges(
    range_costs: RangeCostFn, L: int, shapes: list[Shape], stats: dict[str, int] | None
) -> dict[tuple[int, int, Shape], _Options]:
    """``_profile``'s table from each (sub-mesh, logical shape)'s plans over every range: the same options
    in the same order (logical shapes, then each one's plans), so ties and ``_frontier`` come out the same."""
    plans_of: list[tuple[Shape, list[tuple[list, list, Shape, str]]]] = []
    upper = np.triu(np.ones((L + 1, L + 1), dtype=bool), 1)  # start < end
    no_memory = 0
    for shape in shapes:
        plans = []
        for logical in logical_shapes(shape):
            for rc in range_costs(shape, logical):
                time, limit = _checked_ranges(rc, L, shape, logical)
                known = upper & ~np.isnan(time)
                no_memory += int(np.count_nonzero(known & (limit == 0)))
                time = np.where(known & (limit != 0), time, np.nan)
                plans.append((time.tolist(), limit.tolist(), logical, rc.variant))
        plans_of.append((shape, plans))
    table: dict[tuple[int, int, Shape], _Options] = {}
    for start in range(L):
        for end in range(start + 1, L + 1):
            for shape, plans in plans_of:
                found = []
                for times, limits, logical, variant in plans:
                    t = times[start][end]
                    if t == t:  # not NaN
                        limit = limits[start][end]
                        found.append((t, logical, None if limit < 0 else limit, variant))
                if found:
                    table[(start, end, shape)] = _options(found)
    if stats is not None:
        stats["no_memory"] = stats.get("no_memory", 0) + no_memory
    return table


def _checked_ranges(rc: object, L: int, shape: Shape, logical: Shape) -> tuple[np.ndarray, np.ndarray]:
    """``rc``'s arrays, checked as ``_check_one`` checks one answer."""
    if not isinstance(rc, RangeCosts):
        raise InterOpError(f"range_costs({shape}, {logical}) must give RangeCosts, got {rc!r}")
    time, limit = np.asarray(rc.time, dtype=float), np.asarray(rc.max_in_flight)
    if time.shape != (L + 1, L + 1) or limit.shape != (L + 1, L + 1):
        raise InterOpError(
            f"range_costs({shape}, {logical}) gave arrays of {time.shape} and {limit.shape}; both must be "
            f"({L + 1}, {L + 1}), indexed [start, end]"
        )
    if not np.issubdtype(limit.dtype, np.integer):
        raise InterOpError(f"range_costs({shape}, {logical}) gave max_in_flight of {limit.dtype}; it must be integers")
    upper = np.triu(np.ones_like(limit, dtype=bool), 1)
    bad = upper & ~np.isnan(time) & ~((time >= 0) & np.isfinite(time))
    if bad.any():
        start, end = map(int, np.argwhere(bad)[0])
        raise InterOpError(
            f"range_costs({shape}, {logical}) gave time {time[start, end]} for layers [{start}, {end}); it must be "
            "finite and >= 0 (NaN for an infeasible stage)"
        )
    if (upper & (limit < -1)).any():
        raise InterOpError(f"range_costs({shape}, {logical}) gave a max_in_flight below -1 (-1: no limit)")
    return time, limit


class _Dense:
    """The profiled table as dense arrays for the vectorised DP.

    ``times[k, end, j]`` is the fastest option for layers [k, end) on any sub-mesh of the
    j-th distinct size ``sizes[j]`` (inf where none); ``times_for(need)`` is the same over
    the options that may hold ``need`` micro-batches (built lazily, cached per need).
    Taking the min over sub-meshes of equal size is exact: t + F is monotone in t, so
    min_i(t_i) + F == min_i(t_i + F) in floating point too. ``shift[j, d]`` indexes
    d - sizes[j] into a row padded with one trailing inf (index D + 1) where d < sizes[j].
    ``bands(need, t_max)`` is ``times_for(need)``'s entries <= t_max as the DP walks them.

    Devices are counted in units of the greatest common divisor of the sub-mesh sizes with a
    feasible option (``unit``; ``D`` and ``sizes`` are in units): only multiples of it can be
    used up, so F at the other device counts is inf and need not be computed. On 128 hosts
    where no stage fits fewer than a host's 8 devices, the tables are 8x smaller. If N*M is
    not a multiple of the unit no slicing covers the cluster (``sizes`` is then empty).
    """

    def __init__(self, table: dict[tuple[int, int, Shape], _Options], L: int, D: int):
        real = sorted({shape[0] * shape[1] for (_, _, shape) in table if shape[0] * shape[1] <= D})
        unit = math.gcd(*real) if real else 1
        if D % unit:
            real = []
        self.unit = unit
        D //= unit
        sizes = [size // unit for size in real]
        self.table = table
        self.index = {size: j for j, size in enumerate(real)}  # real sizes -> j
        d = np.arange(D + 1)
        shift = d[None, :] - np.asarray(sizes, dtype=np.int64)[:, None]
        shift[shift < 0] = D + 1
        self.sizes, self.shift = sizes, shift
        self.L, self.D = L, D
        self._times: dict[int | None, np.ndarray] = {}
        self._diagonals: dict[int | None, tuple] = {}  # per need, for bands()
        self._options: tuple[np.ndarray, ...] | None = None  # start, end, size index, time, limit, fastest
        self.times = self.times_for(None)

    def times_for(self, need: int | None) -> np.ndarray:
        """Dense times over options eligible where ``need`` micro-batches are in flight: per
        (range, size), the least time of an eligible option (an ``_Options.best``), as arrays."""
        times = self._times.get(need)
        if times is None:
            if self._options is None:
                rows = [
                    (start, end, j, opt.time, math.inf if opt.max_in_flight is None else opt.max_in_flight, i == 0)
                    for (start, end, shape), opts in self.table.items()
                    if (j := self.index.get(shape[0] * shape[1])) is not None
                    for i, opt in enumerate(opts.options)
                ]
                columns = list(zip(*rows)) or [()] * 6
                self._options = tuple(
                    np.array(col, dtype=dtype) for col, dtype in zip(columns, (np.int64, np.int64, np.int64, float, float, bool))
                )
            start, end, j, time, limit, fastest = self._options
            keep = fastest if need is None else limit >= need
            times = np.full((self.L + 1, self.L + 1, len(self.sizes)), np.inf)
            np.minimum.at(times, (start[keep], end[keep], j[keep]), time[keep])
            self._times[need] = times
        return times

    def allowed(self, t_max: float, need: int | None = None) -> np.ndarray:
        times = self.times_for(need)
        return np.where(times <= t_max, times, np.inf)

    def bands(self, need: int | None, t_max: float) -> list[tuple[int, int, int, np.ndarray]]:
        """The entries of ``times_for(need)`` that are <= t_max, by (sub-mesh size, width): (size in units,
        width w, first start k0, times v) with v[i] the time of layers [k0 + i, k0 + i + w), inf where that
        range has no option <= t_max. Each run spans the starts from the first to the last one allowed, so
        the DP combines it with a contiguous block of rows (views, no gathers). Memory limits and t_max keep
        stages a few layers wide, so there are few runs (14 widths at most for GPT-3 175B's 96 layers)."""
        diagonals = self._diagonals.get(need)
        if diagonals is None:  # per (size, width): the times along that diagonal, and their running minima
            table, rows = self.times_for(need), []
            for j, size in enumerate(self.sizes):
                t = table[:, :, j]
                starts, ends = np.nonzero(np.isfinite(t))
                for width in np.unique(ends - starts):
                    v = np.diagonal(t, offset=int(width)).copy()  # v[k] = t[k, k + width]
                    rows.append((size, int(width), v, float(v[np.isfinite(v)].max())))
            # the running minima of every diagonal, one row each (padded with +inf, which no search counts):
            # ascending, so the count of entries below -t_max is where ``searchsorted`` would put it, for every
            # diagonal at once (a t_max search asks bands() a few hundred times, over a hundred diagonals each)
            left = np.full((len(rows), self.L + 1), np.inf)
            right = np.full((len(rows), self.L + 1), np.inf)
            for r, (_, _, v, _) in enumerate(rows):
                left[r, : len(v)] = -np.minimum.accumulate(v)  # the first start <= a time
                right[r, : len(v)] = -np.minimum.accumulate(v[::-1])  # likewise the last start
            lengths = np.array([len(v) for _, _, v, _ in rows], dtype=np.int64)
            slowest = np.array([top for *_, top in rows])
            diagonals = self._diagonals[need] = (rows, left, right, lengths, slowest)
        rows, left, right, lengths, slowest = diagonals
        limits = np.minimum(t_max, slowest)  # finite: an infinite time is never allowed
        first = (left < -limits[:, None]).sum(axis=1)
        last = lengths - (right < -limits[:, None]).sum(axis=1)
        out = []
        for r in np.flatnonzero(first < lengths):
            size, width, v, _ = rows[r]
            limit, k0 = limits[r], int(first[r])
            run = v[k0 : int(last[r])]
            if run.max() > limit:  # starts in between with no option, or none <= t_max
                run = np.where(run <= limit, run, math.inf)
            out.append((size, width, k0, run))
        return out


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


def _f_rows(
    dense: _Dense,
    t_max: float,
    S: int,
    needs: list[int] | None = None,
    combine: np.ufunc = np.add,
    base: float = 0.0,
) -> Iterator[tuple[int, np.ndarray]]:
    """(s, F[s]) for s = 1..S (``_solve_f``), F[0] being ``base`` at (L, 0) and inf elsewhere.

    Two buffers take turns: the row yielded for s is overwritten when s + 2 is made, so a caller
    copies what it keeps (``_solve_f``) or keeps only F[s, 0, D] (``_totals``), never holding the
    whole (S, L, D) table (77 MB per t_max for GPT-3 175B on 1,024 devices)."""
    L, D = dense.L, dense.D
    prev, row = np.full((L + 1, D + 1), np.inf), np.empty((L + 1, D + 1))
    scratch = np.empty((L + 1, D + 1))
    prev[L, 0] = base
    bands: dict[int | None, list] = {}
    for s in range(1, S + 1):
        need = None if needs is None else needs[s]
        if need not in bands:
            bands[need] = dense.bands(need, t_max)
        row.fill(np.inf)
        last = L - s + 1  # stage s (counting from the end) ends at k + w <= L - s + 1: s - 1 stages follow
        for size, width, k0, ts in bands[need]:
            k1 = min(k0 + len(ts), last - width + 1)
            if k1 <= k0:
                continue
            # rows k0..k1 - 1 of F[s] from rows k0 + width.. of F[s - 1], d shifted by size: all views
            n, m = k1 - k0, D + 1 - size
            cand = combine(prev[k0 + width : k1 + width, :m], ts[:n, None], out=scratch[:n, :m])
            np.minimum(row[k0:k1, size:], cand, out=row[k0:k1, size:])
        yield s, row
        prev, row = row, prev


def _solve_f(
    dense: _Dense,
    t_max: float,
    S: int,
    needs: list[int] | None = None,
    stop_at: float | None = None,
) -> np.ndarray:
    """F[s, k, d] of eq. 3 for one t_max (numpy over starts and devices, per stage width); inf where infeasible.

    Position s uses the options eligible for ``needs[s]`` micro-batches in flight (every fastest
    option when ``needs`` is None), those no slower than ``t_max``. With ``stop_at``, stops after the
    first s with F[s, 0, D] == stop_at (the rest is left inf; it is not needed to reconstruct that s).
    Only the runs of stage times <= t_max are combined (``_Dense.bands``; a start inside a run with
    no such option is an inf term, which never wins a min), so F is the same as over every (k, end)
    pair, bit for bit.
    """
    F = np.full((S + 1, dense.L + 1, dense.D + 1), np.inf)
    F[0, dense.L, 0] = 0.0
    for s, row in _f_rows(dense, t_max, S, needs):
        F[s] = row
        if stop_at is not None and row[0, dense.D] == stop_at:
            break
    return F


def _totals(
    dense: _Dense,
    t_max: float,
    S: int,
    needs: list[int] | None = None,
    combine: np.ufunc = np.add,
    base: float = 0.0,
) -> np.ndarray:
    """F[:, 0, D] of ``_solve_f`` (item 0 inf) without the table: what the search over t_max compares."""
    out = np.full(S + 1, np.inf)
    for s, row in _f_rows(dense, t_max, S, needs, combine, base):
        out[s] = row[0, dense.D]
    return out


def _bottlenecks(dense: _Dense, S: int, needs: list[int] | None) -> np.ndarray:
    """[s]: the least t_max at which some slicing into s stages covers the cluster (inf: none at any).

    One min-max DP instead of a bisection over t_max whose every probe is a full DP: a slicing is
    feasible at t_max exactly when its slowest stage is <= t_max, and the slowest stage is one of
    the option times, so the first feasible candidate is found by ``bisect`` on this value.
    """
    return _totals(dense, math.inf, S, needs, combine=np.maximum, base=-math.inf)


def _reconstruct(
    F: np.ndarray,
    dense: _Dense,
    s: int,
    t_max: float,
    needs: list[int] | None = None,
) -> list[tuple[int, int, Shape, _Option]]:
    """Walk F back from (s, 0, D): pick any choice attaining the stored minimum exactly.

    At position s the candidate of a (range, sub-mesh) is its fastest option eligible for
    ``needs[s]`` micro-batches in flight (any option when ``needs`` is None): exactly the
    time the dense table for that position holds.
    """
    L, D = dense.L, dense.D
    by_start: dict[int, list[tuple[int, Shape, _Options]]] = {}
    for (start, end, shape), opts in dense.table.items():
        by_start.setdefault(start, []).append((end, shape, opts))
    stages: list[tuple[int, int, Shape, _Option]] = []
    k, d = 0, D
    while s > 0:
        target = F[s, k, d]
        need = None if needs is None else needs[s]
        for end, shape, opts in by_start.get(k, ()):
            size = shape[0] * shape[1] // dense.unit
            opt = opts.best(need)
            if opt is None or opt.time > t_max or size > d:
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
    in_flight: InFlightFn | None = None,
    cache: dict | None = None,
    submesh_space: str = "all",
) -> InterOpPlan:
    """Alpa's stage-construction DP (eq. 2-5): optimal slicing, sub-meshes and logical meshes.

    ``stage_cost(start, end, submesh_shape, logical_shape)`` is called exactly once per
    distinct argument tuple. With ``in_flight`` (position s -> micro-batches in flight at
    the stage s stages from the end, s = 1 for the last; called once per s), an option is
    only used at position s when ``max_in_flight is None or max_in_flight >= in_flight(s)``;
    without it, ``max_in_flight`` only rules out options with 0. Raises
    :class:`InterOpError` on bad arguments or when no slicing fits the cluster (or memory).

    ``cache``: a dict kept by the caller between calls with the same ``stage_cost`` (the DP run
    again with fewer stages): the profiled table is kept there and ``stage_cost`` not asked again.
    ``submesh_space``: the sub-mesh shapes searched (``submesh.SUBMESH_SPACES``; the optimum
    is over that space).
    """
    L, N, M, B, S = _validate(
        num_layers, num_hosts, devices_per_host, num_microbatches, stage_cost, max_stages
    )
    needs = _in_flight_needs(in_flight, S)
    D = N * M
    table, stats = _profiled(stage_cost, L, N, M, cache, submesh_space)
    if not table:
        if stats.get("no_memory"):
            raise InterOpError(
                f"no slicing of {L} layers fits {N}x{M} devices: no (layer range, sub-mesh, "
                "logical shape) fits in device memory even with one micro-batch in flight "
                "(max_in_flight = 0 or infeasible everywhere); use more devices"
            )
        raise InterOpError(
            f"no slicing of {L} layers fits {N}x{M} devices: stage_cost is infeasible for "
            "every (layer range, sub-mesh, logical shape)"
        )

    dense, binds, needs, (best_value, best_tmax, best_s, best_F) = _optimum(table, L, D, B, S, needs)
    if best_F is None:
        limit = f" with at most {max_stages} stages" if max_stages is not None else ""
        if binds and dense.sizes and _search(dense, table, B, S)[3] is not None:
            raise InterOpError(
                f"no slicing of {L} layers fits {N}x{M} devices{limit}: no slicing fits in "
                "device memory with this schedule's micro-batches in flight; use more "
                "devices, more stages or fewer micro-batches in flight"
            )
        raise InterOpError(
            f"no slicing of {L} layers fits {N}x{M} devices{limit}: {len(table)} feasible "
            f"(layer range, sub-mesh) options exist, but none combine into contiguous stages "
            f"covering all layers on exactly {D} devices"
        )

    chosen = _reconstruct(best_F, dense, best_s, best_tmax, needs)
    return _placed(chosen, N, M, B)


def _limits_bind(table: dict[tuple[int, int, Shape], _Options], needs: list[int] | None) -> bool:
    """Whether memory limits bind: some (range, sub-mesh)'s fastest option cannot be used at every
    position, so the per-position tables differ and the stage count matters."""
    return needs is not None and any(not _fits(opts.options[0].max_in_flight, max(needs)) for opts in table.values())


def _optimum(
    table: dict[tuple[int, int, Shape], _Options], L: int, D: int, B: int, S: int, needs: list[int] | None
) -> tuple[_Dense, bool, list[int] | None, _Search]:
    """Eq. 4's search over ``table``: its dense form, whether memory limits bind, the needs the
    search used (None where they do not bind) and the search's result."""
    dense = _Dense(table, L, D)
    binds = _limits_bind(table, needs)
    if binds:
        assert needs is not None
        return dense, True, needs, _search_per_position(dense, table, B, S, needs)
    return dense, False, None, _search(dense, table, B, S)  # every fastest option is eligible everywhere


def stage_dp_uniform(
    num_layers: int,
    num_hosts: int,
    devices_per_host: int,
    num_microbatches: int,
    stage_cost: StageCostFn,
    in_flight: InFlightFn | None = None,
    cache: dict | None = None,
    submesh_space: str = "all",
) -> dict[Shape, InterOpPlan]:
    """For each sub-mesh shape of the space, the DP's optimum among plans whose stages all take
    that shape (N M / size stages), as Megatron-style pipelines do; shapes with more stages than
    layers, or with no slicing that fits, are left out.

    Each is eq. 4's optimum over a part of ``stage_dp``'s space, so never better by eq. 2; but
    eq. 2 leaves out the boundary transfers, which 1F1B waits for on every micro-batch, and
    equal sub-meshes spread the hops between hosts over more stages: ``plan_pipeline`` simulates
    these candidates with the others. Same profiled table (``cache``) as ``stage_dp``.
    """
    L, N, M, B, S = _validate(num_layers, num_hosts, devices_per_host, num_microbatches, stage_cost, None)
    needs = _in_flight_needs(in_flight, S)
    D = N * M
    table, _ = _profiled(stage_cost, L, N, M, cache, submesh_space)
    out: dict[Shape, InterOpPlan] = {}
    for shape in _shapes(N, M, submesh_space):
        size = shape[0] * shape[1]
        if D % size or D // size > L:
            continue
        part = {key: opts for key, opts in table.items() if key[2] == shape}
        if not part:
            continue
        dense, _, used, (_, t_max, s, F) = _optimum(part, L, D, B, D // size, needs)
        if F is None:
            continue
        try:
            out[shape] = _placed(_reconstruct(F, dense, s, t_max, used), N, M, B)
        except InterOpError:  # its sub-meshes cannot be placed: not a plan
            continue
    return out


def _placed(chosen: list[tuple[int, int, Shape, _Option]], N: int, M: int, B: int) -> InterOpPlan:
    """The DP's stages (range, sub-mesh, option) placed on the cluster's devices."""
    try:
        placements = place_submeshes([shape for _, _, shape, _ in chosen], N, M)
    except PlacementError as err:
        raise InterOpError(f"optimal stage sub-meshes cannot be placed on the cluster: {err}") from err
    stages = tuple(
        StagePlan((start, end), shape, opt.logical_shape, p.device_ids, opt.time, opt.variant)
        for (start, end, shape, opt), p in zip(chosen, placements)
    )
    times = [st.time for st in stages]
    return InterOpPlan(
        stages=stages,
        total_time=pipeline_latency(times, B),
        t_max=max(times),
        num_microbatches=B,
    )


def stage_dp_capped(
    num_layers: int,
    num_hosts: int,
    devices_per_host: int,
    num_microbatches: int,
    stage_cost: StageCostFn,
    caps: Collection[int],
    in_flight: InFlightFn | None = None,
    cache: dict | None = None,
    submesh_space: str = "all",
) -> dict[int, InterOpPlan]:
    """``stage_dp(..., max_stages=k)`` for every k in ``caps``, sharing the DP's rows between caps.

    F[s, 0, D] of one t_max holds every stage count s at once, so the optimum with at most k
    stages is the best over t_max of min_{s <= k} F[s, 0, D] + (B - 1) t_max: one branch and
    bound per cap (``_least_latency``), largest cap first, each reusing the t_max already
    solved for a larger one. Caps with no feasible slicing (or whose stages cannot be placed),
    and caps above min(L, N M), are left out. Same optima (T) as ``stage_dp`` per cap
    (``tests/test_inter_op.py`` compares them).
    """
    caps = sorted({_check_int("a stage cap", k) for k in caps})
    if not caps:
        return {}
    L, N, M, B, S = _validate(num_layers, num_hosts, devices_per_host, num_microbatches, stage_cost, max(caps))
    caps = [k for k in caps if k <= S]
    needs = _in_flight_needs(in_flight, S)
    D = N * M
    table, _ = _profiled(stage_cost, L, N, M, cache, submesh_space)
    if not table:
        return {}
    dense = _Dense(table, L, D)
    if not dense.sizes:
        return {}
    if not _limits_bind(table, needs):
        needs = None
    out: dict[int, InterOpPlan] = {}
    for k, (_, t_max, s, F) in sorted(_optima_per_cap(dense, table, B, caps, S, needs).items()):
        try:
            out[k] = _placed(_reconstruct(F, dense, s, t_max, needs), N, M, B)
        except InterOpError:  # its sub-meshes cannot be placed: not a plan
            continue
    return out


_Search = tuple[float, float, int, "np.ndarray | None"]


def _tmax_candidates(table: dict[tuple[int, int, Shape], _Options], needs: list[int] | None) -> list[float]:
    """Eq. 4's t_max candidates, ascending: every option's time where memory limits bind (a slower
    layout may be the fastest eligible one somewhere), else each (range, sub-mesh)'s fastest."""
    if needs is None:
        return sorted({opts.time for opts in table.values()})
    return sorted({opt.time for opts in table.values() for opt in opts.options})


def _least_latency(
    candidates: list[float],
    first: int,
    floor: float,
    B: int,
    k: int,
    totals: dict[int, np.ndarray],
    solve: Callable[[float], np.ndarray],
) -> tuple[float, int]:
    """Eq. 4's outer search with at most k stages: the least (T, i), T = F_k(t) + (B - 1) t at
    t = candidates[i], F_k(t) = min_{s <= k} F[s, 0, D; t] (i = -1 if none is feasible).

    Branch and bound over the candidates rather than a scan of them: F_k does not grow with t
    (a larger t_max only allows more options), so no t strictly between candidates a and b beats
    F_k(candidates[b]) + (B - 1) candidates[a + 1]. Intervals whose bound cannot beat the best found
    (nor tie it at a smaller t) are skipped, the others halved; the paper's pruning (B t >= best)
    and the floor (the least sum of stage times at any t) cut the top. Each evaluated t is one DP
    (``solve``: F[:, 0, D] there with at least k stages), kept in ``totals`` by index for the
    other caps. Same optimum, and the same t among ties, as scanning every candidate from ``first``.
    """
    n = len(candidates)
    best_value, best_i = math.inf, -1

    def total(i: int) -> float:
        row = totals.get(i)
        if row is None or row.shape[0] <= k:
            row = totals[i] = solve(candidates[i])
        return float(row[1 : k + 1].min())

    def consider(i: int) -> float:
        nonlocal best_value, best_i
        f = total(i)
        value = f + (B - 1) * candidates[i]
        if value < best_value or (value == best_value and i < best_i):
            best_value, best_i = value, i
        return f

    if first >= n:
        return best_value, best_i
    # indices already evaluated (for another cap, with as many stages) cost nothing and split the range
    known = [first] + sorted(i for i, row in totals.items() if i > first and row.shape[0] > k)
    f_known = [consider(i) for i in known]
    intervals = [(known[-1], n, floor)]  # (a, b, F_k at b or the floor): indices a < i < b not yet evaluated
    intervals += [(known[j], known[j + 1], f_known[j + 1]) for j in reversed(range(len(known) - 1))]

    def beaten(bound: float, i: int) -> bool:  # no t_max at index >= i whose T is >= bound is the answer
        return bound > best_value or (bound == best_value and i > best_i)

    while intervals:
        a, b, f_b = intervals.pop()

        def cut(i: int, f_b: float = f_b) -> bool:  # the paper's pruning (a plan with slowest stage t costs >= B t)
            t = candidates[i]  # t + (B - 1) t, not B t: F >= t exactly in floating point, so T >= this rounded alike
            return beaten(t + (B - 1) * t, i) or beaten(f_b + (B - 1) * t, i)  # and the bound

        if b > a + 1 and cut(b - 1):  # both grow with i: what survives is a prefix of the interval
            b = a + 1 + bisect.bisect_left(range(a + 1, b), True, key=cut)
        if b <= a + 1:
            continue
        mid = (a + b) // 2
        f_mid = consider(mid)
        intervals.append((mid, b, f_b))
        intervals.append((a, mid, f_mid))
    return best_value, best_i


def _search(
    dense: _Dense, table: dict[tuple[int, int, Shape], _Options], B: int, S: int
) -> _Search:
    """Eq. 4 without memory limits (each (range, sub-mesh) at its fastest logical mesh).

    Returns (best T, its t_max, its stage count, its F table), F None when infeasible.
    """
    L, D = dense.L, dense.D
    uncapped = S >= min(L, D)
    best_value, best_tmax, best_s, best_F = math.inf, math.nan, 0, None
    if not dense.sizes:
        return best_value, best_tmax, best_s, best_F
    # lower bound on sum_i t_i for any t_max: the DP with every option allowed
    if uncapped:
        floor = _MinOverStages(dense).solve(dense.allowed(math.inf), L - 1)
    else:
        floor = float(_totals(dense, math.inf, S)[1:].min())
    starts_at: dict[float, int] = {}
    for (start, _, _), opts in table.items():
        if starts_at.get(opts.time, -1) < start:
            starts_at[opts.time] = start
    solver = _MinOverStages(dense) if uncapped else None
    top = -1  # rows 0..top of the incremental solver are out of date
    for t_max in sorted(starts_at):
        top = max(top, starts_at[t_max])
        if math.isinf(floor) or t_max + (B - 1) * t_max >= best_value:  # early pruning (sec. 5.2), as T is rounded
            break
        # every plan with slowest stage <= t_max costs >= floor + (B - 1) * t_max
        if floor + (B - 1) * t_max >= best_value:
            break
        if solver is not None:
            total = solver.solve(dense.allowed(t_max), top)
            top = -1
            value = total + (B - 1) * t_max
            if value < best_value:
                best_value, best_tmax, best_F = value, t_max, total
        else:
            F = _solve_f(dense, t_max, S)
            s = int(np.argmin(F[1:, 0, D])) + 1
            value = float(F[s, 0, D]) + (B - 1) * t_max
            if value < best_value:
                best_value, best_tmax, best_s, best_F = value, t_max, s, F
    if uncapped and best_F is not None:
        total = best_F
        best_F = _solve_f(dense, best_tmax, S, stop_at=total)
        best_s = int(np.argmin(best_F[1:, 0, D])) + 1
        assert best_F[best_s, 0, D] == total
    return best_value, best_tmax, best_s, best_F


def profile_stage_options(
    num_layers: int, num_hosts: int, devices_per_host: int, stage_cost: StageCostFn, cache: dict, submesh_space: str = "all",
    range_costs: RangeCostFn | None = None,
) -> None:
    """Ask ``stage_cost`` for every option ``stage_dp`` would and keep them in ``cache``, so the DP runs
    given that cache never call it: they can then run in another thread while this one goes on
    (``plan_pipeline`` runs its two DPs at once; ``stage_cost`` need not be thread-safe). ``range_costs``,
    the same costs over every range at once (``RangeCosts``), is asked instead where given."""
    _profiled(stage_cost, num_layers, num_hosts, devices_per_host, cache, submesh_space, range_costs)


def _profiled(
    stage_cost: StageCostFn, L: int, N: int, M: int, cache: dict | None, space: str = "all",
    range_costs: RangeCostFn | None = None,
) -> tuple[dict, dict[str, int]]:
    """The profiled table of stage options and its stats, kept in ``cache`` between DP runs."""
    profiled = cache.get((L, N, M, space)) if cache is not None else None
    if profiled is None:
        stats: dict[str, int] = {}
        profiled = (_profile(stage_cost, L, _shapes(N, M, space), stats, range_costs), stats)
        if cache is not None:
            cache[(L, N, M, space)] = profiled
    return profiled


def _shapes(N: int, M: int, space: str) -> list[Shape]:
    """The sub-mesh shapes of ``space``; an unknown space is an InterOpError naming the choices."""
    try:
        return submesh_shapes(N, M, space)
    except ValueError as err:
        raise InterOpError(str(err)) from None


def _search_per_position(
    dense: _Dense,
    table: dict[tuple[int, int, Shape], _Options],
    B: int,
    S: int,
    needs: list[int],
) -> _Search:
    """Eq. 4 with memory limits: position s uses the options eligible for needs[s] (``_optima_per_cap``
    with the one cap S). Returns (best T, its t_max, its stage count, its F table), F None when infeasible."""
    return _optima_per_cap(dense, table, B, [S], S, needs).get(S, (math.inf, math.nan, 0, None))


def _optima_per_cap(
    dense: _Dense,
    table: dict[tuple[int, int, Shape], _Options],
    B: int,
    caps: list[int],
    S: int,
    needs: list[int] | None,
) -> dict[int, _Search]:
    """Eq. 4's optimum with at most k stages for each cap k <= S that has a feasible slicing.

    Candidate t_max values are ``_tmax_candidates`` (every option's time where limits bind: a
    slower logical mesh may be the fastest eligible one somewhere), searched from the first
    feasible one (``_bottlenecks``: memory limits rule out the small t_max of most candidates)
    by ``_least_latency``, the largest cap first: its DP rows serve the smaller caps.
    """
    D = dense.D
    if not dense.sizes:
        return {}
    candidates = _tmax_candidates(table, needs)
    every = _totals(dense, math.inf, S, needs)  # [s]: the least sum of stage times at any t_max, a floor
    lowest = _bottlenecks(dense, S, needs)
    totals: dict[int, np.ndarray] = {}  # candidate index -> F[:, 0, D] there, shared by the caps
    out: dict[int, _Search] = {}
    for k in sorted(caps, reverse=True):
        floor = float(every[1 : k + 1].min())
        if math.isinf(floor):
            continue
        first = bisect.bisect_left(candidates, float(lowest[1 : k + 1].min()))
        value, i = _least_latency(candidates, first, floor, B, k, totals, lambda t, k=k: _totals(dense, t, k, needs))
        if i >= 0:
            F = _solve_f(dense, candidates[i], k, needs)
            out[k] = (value, candidates[i], int(np.argmin(F[1:, 0, D])) + 1, F)
    return out


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
    in_flight: InFlightFn | None = None,
    submesh_space: str = "all",
) -> float:
    """Reference optimum of eq. 2 by exhaustive search (for tests).

    Enumerates every contiguous slicing, every sub-mesh assignment whose sizes sum to
    N*M, and every logical shape per stage; returns the best T. With ``in_flight``, stage
    i of S is at position S - i and may only use an option whose ``max_in_flight`` is None
    or >= in_flight(S - i); options with ``max_in_flight == 0`` are always infeasible.
    Raises :class:`InterOpError` when nothing is feasible or the search would be too large.
    """
    L, N, M, B, S = _validate(
        num_layers, num_hosts, devices_per_host, num_microbatches, stage_cost, max_stages
    )
    needs = _in_flight_needs(in_flight, S)
    D = N * M
    shapes = _shapes(N, M, submesh_space)
    memo: dict[tuple[int, int, Shape, Shape], list[StageCost]] = {}

    def cost(start: int, end: int, shape: Shape, logical: Shape) -> list[StageCost]:
        key = (start, end, shape, logical)
        if key not in memo:
            memo[key] = _checked_costs(stage_cost, start, end, shape, logical)
        return memo[key]

    # refuse up front (it used to find out after enumerating two million of them): per stage count s,
    # C(L - 1, s - 1) slicings times the sub-mesh sequences tiling D devices, each weighted by its logical views
    ways = [[0] * (D + 1) for _ in range(S + 1)]
    ways[0][0] = 1
    for k in range(1, S + 1):
        for d in range(D + 1):
            ways[k][d] = sum(ways[k - 1][d - r * c] * len(logical_shapes((r, c))) for r, c in shapes if r * c <= d)
    total = sum(math.comb(L - 1, k - 1) * ways[k][D] for k in range(1, min(L, S) + 1))
    if total > _MAX_BRUTE_FORCE_COMBINATIONS:
        raise InterOpError(
            f"brute force over {L} layers on {N}x{M} devices would try {total} combinations, over its "
            f"{_MAX_BRUTE_FORCE_COMBINATIONS}; use stage_dp"
        )
    best = math.inf
    for slicing in _compositions(L, S):
        for assignment in itertools.product(shapes, repeat=len(slicing)):
            if sum(r * c for r, c in assignment) != D:
                continue
            per_stage = [logical_shapes(shape) for shape in assignment]
            for logicals in itertools.product(*per_stage):
                times = []
                num = len(slicing)
                for i, ((start, end), shape, logical) in enumerate(
                    zip(slicing, assignment, logicals)
                ):
                    # eq. 2 grows with each stage's time: the fastest eligible variant wins
                    eligible = [
                        c.time
                        for c in cost(start, end, shape, logical)
                        if c.max_in_flight != 0 and (needs is None or _fits(c.max_in_flight, needs[num - i]))
                    ]
                    if not eligible:
                        break
                    times.append(min(eligible))
                else:
                    best = min(best, pipeline_latency(times, B))
    if math.isinf(best):
        raise InterOpError(f"no slicing of {L} layers fits {N}x{M} devices (brute force)")
    return best
