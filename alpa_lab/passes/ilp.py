"""The intra-operator ILP (Alpa, OSDI'22, sec. 4.2, eq. 1), on plain numpy data.

Every node v picks one of its k_v strategies; the plan costs

    sum_v c_v[s_v] + sum_(u,v) R_uv[s_u, s_v]    (+ optionally: sum_v mem_v[s_v] <= budget)

``solve`` first shrinks the graph with exact reductions (PBQP-style, as in the
register-allocation literature): drop strategies that are not allowed, infeasible or
dominated, fold edges whose cost splits into a row and a column term, and eliminate nodes
of degree <= 2 by dynamic programming. Real graphs are chains and trees of ops with a few
long edges (residual, forward-backward), so most nodes go and the ILP that CBC sees is
small. The remaining core is written as Alpa's eq. 1 straight into an LP file with numpy
(building a PuLP model term by term is the slow part for big graphs) and solved by the CBC
binary that ships with PuLP. The objective is always recomputed exactly from the choice.

Infinite costs are allowed: an infinite node cost or edge entry forbids that strategy or
pair. NaN and -inf are errors.
"""

from __future__ import annotations

import functools
import math
import os
import subprocess
import tempfile
import time
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import pulp

BRUTE_FORCE_LIMIT = 2_000_000
_DECOMPOSE_RTOL = 1e-12  # an edge within this (relative) of a_i + b_j is folded into its nodes
_OBJECTIVE_SCALE = 1e4  # largest objective coefficient CBC sees; keeps its tolerances relative
_INCUMBENT_SWEEPS = 20  # coordinate-descent passes of the fallback when CBC runs out of time


@dataclass(frozen=True)
class CostGraph:
    """Strategies, their costs, and resharding costs between them: the ILP's data."""

    node_costs: tuple[np.ndarray, ...]
    """node v: cost (seconds) of each of its k_v strategies."""
    node_memory: tuple[np.ndarray, ...]
    """node v: bytes per device of each strategy."""
    edges: tuple[tuple[int, int, np.ndarray], ...]
    """(u, v, R) with R.shape == (k_u, k_v); parallel edges add up."""
    names: tuple[str, ...] = ()

    @property
    def num_nodes(self) -> int:
        return len(self.node_costs)

    def label(self, v: int) -> str:
        """How error messages name node v."""
        return f"node {v} ({self.names[v]!r})" if v < len(self.names) else f"node {v}"


@dataclass(frozen=True)
class ILPSolution:
    """The chosen strategy of every node, and what it took to find it."""

    choice: tuple[int, ...]
    objective: float
    status: str  # "optimal", or "time_limit" (feasible, optimality not proven)
    num_variables: int
    num_constraints: int
    build_seconds: float  # reductions + writing the ILP
    solve_seconds: float  # CBC, including its start-up and reading its answer
    reduced_nodes: int  # nodes eliminated by the exact reductions
    solver: str  # "reductions" when no ILP was needed, else "cbc"
    reduce_seconds: float = 0.0  # the reductions' part of build_seconds


class InfeasibleError(ValueError):
    """No choice satisfies the pins (allowed sets), the memory budget or infinite costs."""

    def __init__(self, message: str, nodes: Iterable[int] = ()):
        super().__init__(message)
        self.nodes = tuple(nodes)


# ----------------------------------------------------------------------------- public API


def evaluate(graph: CostGraph, choice: Sequence[int]) -> float:
    """The exact (correctly rounded) objective of a choice."""
    terms = [float(c[s]) for c, s in zip(graph.node_costs, choice)]
    terms += [float(r[choice[u], choice[v]]) for u, v, r in graph.edges]
    return math.fsum(terms)


def memory_of(graph: CostGraph, choice: Sequence[int]) -> float:
    """Exact bytes per device of a choice."""
    return math.fsum(float(m[s]) for m, s in zip(graph.node_memory, choice))


ILP_TIME_LIMIT = 60.0
"""Seconds one CBC run may take before its best plan so far is taken (a heuristic's where it has none)."""

BRANCH_ON_SETS = True
"""CBC branches on each node's one-hot row as an SOS1 set and trusts pseudo-costs after one strong-branching look
(``_build_model``, ``_run_cbc``). False: one variable at a time with CBC's default trust, the same-run baseline of
``benchmarks/ilp_solver.py --mirrored``."""

CBC_HEURISTICS = False
"""Run CBC's primal heuristics (diving, greedy, RINS; rounding the LP solution, which costs nothing, runs always).
Off: on the stage ILPs whose LP bound is loose (a Wide-ResNet 4B stage on 2x2 with its update weighed once a step:
bound 2246, optimum 2685) the dives re-solved the LP of 68,000 columns many times before the search, which then found
the optimum in 10 nodes by itself (9.4 s -> 2.5 s); on tight ones (every GPT layer) the LP's own solution is integral
and they never ran. True: CBC's default, the same-run baseline of ``benchmarks/ilp_solver.py --mirrored --heuristics``
(mirror-symmetric graphs of 40, 60 and 80 nodes: 1.9x, 1.8x, 1.2x faster, the same optima). Where it can lose: a
search cut short by its time limit has fewer plans to keep; one 80-node mirrored graph, out of time at 120 s either
way, kept a plan 0.4% dearer (94.60 against 94.24). A search that ends without a plan takes ``_incumbent``'s."""


def solve(
    graph: CostGraph,
    *,
    allowed: Mapping[int, Collection[int]] | None = None,
    memory_budget: float | None = None,
    time_limit: float = ILP_TIME_LIMIT,
    reduce: bool = True,
) -> ILPSolution:
    """Minimise eq. 1 of the Alpa paper; ``allowed`` pins nodes to subsets of strategies.

    With a memory budget the degree reductions are not exact (the budget couples all
    nodes), so only the budget-safe ones run: dropping dominated strategies that also use
    no less memory, and folding decomposable edges.
    """
    t_start = time.perf_counter()
    _validate(graph)
    live = _live_strategies(graph, allowed)
    if memory_budget is not None:
        memory_budget = float(memory_budget)  # a numpy scalar's repr would corrupt the LP text
        _check_memory_floor(graph, live, memory_budget)
    work = _WorkGraph(graph, live)
    if reduce:
        work.reduce(eliminate=memory_budget is None, memory_aware=memory_budget is not None)
    t_reduced = time.perf_counter()

    core = work.core_nodes()
    core_choice: dict[int, int] = {}
    status, solver, num_vars, num_cons, build_extra, solve_seconds = "optimal", "reductions", 0, 0, 0.0, 0.0
    if core:
        budget = memory_budget
        for _attempt in range(3):
            model = _build_model(work, core, budget)
            # run once: asked for by _run_cbc when CBC has no plan, and by the comparison below after a time limit
            fallback = functools.cache(functools.partial(_incumbent, work, core, budget))
            core_choice, status, solve_seconds_i = _run_cbc(model, fallback, time_limit, graph)
            if status == "time_limit":  # CBC's best so far, or the fallback's plan where that is cheaper
                core_choice = _cheaper(graph, work, core_choice, fallback(), budget)
            build_extra += model.build_seconds
            solve_seconds += solve_seconds_i
            num_vars, num_cons, solver = model.num_variables, model.num_constraints, "cbc"
            if memory_budget is None:
                break
            excess = memory_of(graph, work.back_substitute(core_choice)) - memory_budget
            if excess <= 0:
                break
            budget -= excess + 1e-9 * abs(memory_budget)  # CBC's tolerances let it overshoot
        else:
            raise RuntimeError("CBC kept returning plans that exceed the memory budget")
    choice = work.back_substitute(core_choice)
    objective = evaluate(graph, choice)
    if not math.isfinite(objective):
        raise InfeasibleError("every choice uses a forbidden (infinite-cost) strategy pair", core)
    return ILPSolution(
        choice=choice,
        objective=objective,
        status=status,
        num_variables=num_vars,
        num_constraints=num_cons,
        build_seconds=(t_reduced - t_start) + build_extra,
        solve_seconds=solve_seconds,
        reduced_nodes=work.num_eliminated,
        solver=solver,
        reduce_seconds=t_reduced - t_start,
    )


def brute_force(
    graph: CostGraph,
    *,
    allowed: Mapping[int, Collection[int]] | None = None,
    memory_budget: float | None = None,
) -> tuple[tuple[int, ...], float]:
    """Exhaustive optimum, the ground truth for tests on tiny graphs."""
    _validate(graph)
    live = _live_strategies(graph, allowed)
    total = math.prod(len(s) for s in live)
    if total > BRUTE_FORCE_LIMIT:
        raise ValueError(f"{total} combinations is too many for brute force (limit {BRUTE_FORCE_LIMIT})")
    flat = np.arange(total)
    picks, stride = [], 1
    for strategies in live:  # mixed-radix digits of the flat index, as original strategy indices
        picks.append(strategies[(flat // stride) % len(strategies)])
        stride *= len(strategies)
    cost = np.zeros(total)
    memory = np.zeros(total)
    for v, pick in enumerate(picks):
        cost += graph.node_costs[v][pick]
        memory += graph.node_memory[v][pick]
    for u, v, r in graph.edges:
        cost += r[picks[u], picks[v]]
    ok = np.isfinite(cost)
    if memory_budget is not None:  # loose here, exact (fsum) below
        ok &= memory <= memory_budget + 1e-9 * max(1.0, abs(memory_budget))
    for flat_index in np.flatnonzero(ok)[np.argsort(cost[ok], kind="stable")]:
        choice = tuple(int(p[flat_index]) for p in picks)
        if memory_budget is None or memory_of(graph, choice) <= memory_budget:
            return choice, evaluate(graph, choice)
    raise InfeasibleError("no choice satisfies the allowed sets, the memory budget and finite costs")


# ------------------------------------------------------------------------- validation


def _validate(graph: CostGraph) -> None:
    """Shapes and values, so that the reductions can trust their inputs."""
    if len(graph.node_memory) != graph.num_nodes:
        raise ValueError(f"{graph.num_nodes} node cost vectors but {len(graph.node_memory)} memory vectors")
    for v, (c, m) in enumerate(zip(graph.node_costs, graph.node_memory)):
        if np.ndim(c) != 1 or np.shape(c) != np.shape(m):
            raise ValueError(f"{graph.label(v)}: costs {np.shape(c)} and memory {np.shape(m)} must be equal 1-D")
        if len(c) == 0:
            raise InfeasibleError(f"{graph.label(v)} has no strategies", (v,))
        if np.isnan(c).any() or (np.asarray(c) == -np.inf).any() or not np.isfinite(m).all():
            raise ValueError(f"{graph.label(v)}: costs must not be NaN or -inf, memory must be finite")
    for u, v, r in graph.edges:
        if not (0 <= u < graph.num_nodes and 0 <= v < graph.num_nodes) or u == v:
            raise ValueError(f"edge ({u}, {v}) must join two different nodes of {graph.num_nodes}")
        if np.shape(r) != (len(graph.node_costs[u]), len(graph.node_costs[v])):
            raise ValueError(
                f"edge {graph.label(u)} -> {graph.label(v)}: resharding matrix {np.shape(r)}, "
                f"expected {(len(graph.node_costs[u]), len(graph.node_costs[v]))}"
            )
        if np.isnan(r).any() or (np.asarray(r) == -np.inf).any():
            raise ValueError(f"edge {graph.label(u)} -> {graph.label(v)}: costs must not be NaN or -inf")


def _live_strategies(graph: CostGraph, allowed: Mapping[int, Collection[int]] | None) -> list[np.ndarray]:
    """Original indices of the strategies each node may take: allowed and of finite cost."""
    allowed = allowed or {}
    for v in allowed:
        if not 0 <= v < graph.num_nodes:
            raise ValueError(f"allowed names node {v}, but the graph has {graph.num_nodes} nodes")
    live = []
    for v, costs in enumerate(graph.node_costs):
        k = len(costs)
        if v in allowed:
            wanted = sorted({int(i) for i in allowed[v]})
            if not wanted:
                raise InfeasibleError(f"{graph.label(v)}: its allowed set of strategies is empty", (v,))
            bad = [i for i in wanted if not 0 <= i < k]
            if bad:
                raise InfeasibleError(
                    f"{graph.label(v)}: allowed strategies {bad} are out of range (it has {k}: 0..{k - 1})", (v,)
                )
        else:
            wanted = list(range(k))
        strategies = np.array(wanted, dtype=np.int64)
        strategies = strategies[np.isfinite(np.asarray(costs, dtype=float)[strategies])]
        if strategies.size == 0:
            raise InfeasibleError(f"{graph.label(v)}: every allowed strategy has infinite cost", (v,))
        live.append(strategies)
    return live


def _check_memory_floor(graph: CostGraph, live: list[np.ndarray], budget: float) -> None:
    """Memory is the only coupling constraint, so the smallest plan decides feasibility."""
    floor = math.fsum(float(np.min(np.asarray(m)[s])) for m, s in zip(graph.node_memory, live))
    if floor > budget:
        raise InfeasibleError(
            f"memory budget {budget:.6g} bytes is below the minimum {floor:.6g} bytes needed "
            f"(every node at its smallest allowed strategy)",
            range(graph.num_nodes),
        )


# ------------------------------------------------------------------------- reductions


@dataclass(frozen=True)
class _Elimination:
    """Node ``node`` left the graph; ``table`` gives its original strategy index for each
    combination of original strategy indices of ``neighbours`` (DP back-substitution)."""

    node: int
    neighbours: tuple[int, ...]
    table: np.ndarray


class _WorkGraph:
    """Mutable working copy of a CostGraph for the reductions (private, one solve long).

    ``adj[v][u]`` is the merged cost matrix of all edges between v and u, shaped
    (live k_v, live k_u); ``adj[u][v]`` is its transpose. ``live[v]`` maps live positions
    back to original strategy indices, so eliminations stay valid when strategies go later.
    """

    def __init__(self, graph: CostGraph, live: list[np.ndarray]):
        self.graph = graph
        self.live = list(live)
        self.cost = [np.asarray(c, dtype=float)[s] for c, s in zip(graph.node_costs, live)]
        self.memory = [np.asarray(m, dtype=float)[s] for m, s in zip(graph.node_memory, live)]
        self.adj: list[dict[int, np.ndarray]] = [{} for _ in range(graph.num_nodes)]
        self.eliminated: list[_Elimination] = []
        self.alive = np.ones(graph.num_nodes, dtype=bool)
        self.dirty: list[int] = []  # nodes whose neighbourhood changed, to revisit
        self._penalty_cache: dict[tuple[int, int], tuple[np.ndarray, np.ndarray]] = {}
        for u, v, r in graph.edges:
            r = np.asarray(r, dtype=float)  # never written to: edits make new matrices
            if r.shape != (len(self.live[u]), len(self.live[v])):  # some strategies are not live
                r = r[np.ix_(self.live[u], self.live[v])]
            self.add_edge(u, v, r)

    @property
    def num_eliminated(self) -> int:
        return len(self.eliminated)

    def core_nodes(self) -> list[int]:
        return [int(v) for v in np.flatnonzero(self.alive)]

    # --- edits that keep the graph consistent

    def add_edge(self, u: int, v: int, r: np.ndarray) -> None:
        """Merge r into edge u-v (parallel edges add up), then simplify it."""
        if v in self.adj[u]:
            r = self.adj[u][v] + r
        self.adj[u][v], self.adj[v][u] = r, r.T
        self.dirty += [u, v]
        self._examine(u, v)

    def _examine(self, u: int, v: int) -> None:
        """Strategies that fit no neighbour strategy go; an a_i + b_j edge joins the nodes."""
        r = self.adj[u][v]
        if np.isinf(r).any():
            dead_rows, dead_cols = np.isinf(r).all(axis=1), np.isinf(r).all(axis=0)
            if dead_rows.any():
                return self.restrict(u, ~dead_rows, blame=v)  # which re-examines this edge
            if dead_cols.any():
                return self.restrict(v, ~dead_cols, blame=u)
        if _is_decomposable(r):
            self.cost[u] = self.cost[u] + r[:, 0]
            self.cost[v] = self.cost[v] + (r[0, :] - r[0, 0])
            del self.adj[u][v], self.adj[v][u]

    def restrict(self, v: int, keep: np.ndarray, blame: int | None = None) -> None:
        """Drop the strategies of v where ``keep`` is False."""
        if keep.all():
            return
        if not keep.any():
            nodes = (v,) if blame is None else (v, blame)
            raise InfeasibleError(
                f"{self.graph.label(v)}: no strategy is left that fits "
                + ("its neighbours" if blame is None else self.graph.label(blame))
                + " at finite cost",
                nodes,
            )
        self.live[v] = self.live[v][keep]
        self.cost[v] = self.cost[v][keep]
        self.memory[v] = self.memory[v][keep]
        for u, r in self.adj[v].items():  # consistent first, so re-examining may recurse safely
            self.adj[v][u] = r[keep]
            self.adj[u][v] = self.adj[v][u].T
        self.dirty.append(v)
        for u in list(self.adj[v]):
            if u in self.adj[v]:
                self.dirty.append(u)
                self._examine(v, u)

    # --- the reductions

    def reduce(self, *, eliminate: bool, memory_aware: bool) -> None:
        """Eliminate nodes of degree <= 2 (if ``eliminate``) and prune dominated strategies,
        to a fixpoint. Eliminations cascade first; dominance tests, which cost the degree of
        the node, wait for a quiet moment so that a hub is tested once per batch of changes."""
        to_test = set(self.core_nodes())
        to_eliminate = [v for v in self.core_nodes() if len(self.adj[v]) <= 2] if eliminate else []
        while to_eliminate or to_test:
            while to_eliminate:
                v = to_eliminate.pop()
                if self.alive[v] and len(self.adj[v]) <= 2:
                    self.dirty = []
                    self.eliminate(v)
                    to_test.update(self.dirty)
                    to_eliminate += [u for u in self.dirty if self.alive[u] and len(self.adj[u]) <= 2]
            for v in sorted(to_test):
                to_test.discard(v)
                if self.alive[v]:
                    self.dirty = []
                    self.restrict(v, ~_dominated(self.cost[v], self.memory[v], self._penalties(v), memory_aware))
                    to_test.update(u for u in self.dirty if u != v)
                    if eliminate:
                        to_eliminate += [u for u in self.dirty if self.alive[u] and len(self.adj[u]) <= 2]
                if to_eliminate:
                    break
            to_test = {v for v in to_test if self.alive[v]}

    def _penalties(self, v: int) -> list[np.ndarray]:
        """Per edge of v, the switch penalties of ``_switch_penalty``, cached per matrix."""
        penalties = []
        for u, r in self.adj[v].items():
            cached = self._penalty_cache.get((v, u))
            if cached is None or cached[0] is not r:
                cached = self._penalty_cache[(v, u)] = (r, _switch_penalty(r))
            penalties.append(cached[1])
        return penalties

    def eliminate(self, v: int) -> None:
        """Remove v by minimising over its strategies for each choice of its <= 2 neighbours."""
        neighbours = tuple(self.adj[v])
        best_of = self.live[v]
        if not neighbours:
            table = np.asarray(best_of[int(np.argmin(self.cost[v]))])
        elif len(neighbours) == 1:
            (u,) = neighbours
            total = self.adj[u][v] + self.cost[v][None, :]  # (k_u, k_v)
            best = np.argmin(total, axis=1)
            table = self._table((u,), best_of[best])
            self._detach(v)
            self.cost[u] = self.cost[u] + total[np.arange(len(best)), best]
            self.dirty.append(u)
        else:
            u, w = neighbours
            total = self.adj[u][v][:, :, None] + self.cost[v][None, :, None] + self.adj[v][w][None, :, :]
            best = np.argmin(total, axis=1)  # (k_u, k_w)
            table = self._table((u, w), best_of[best])
            self._detach(v)
            self.add_edge(u, w, np.take_along_axis(total, best[:, None, :], axis=1)[:, 0, :])
        self.eliminated.append(_Elimination(v, neighbours, table))
        self.alive[v] = False

    def _detach(self, v: int) -> None:
        for u in list(self.adj[v]):
            del self.adj[u][v]
            self.dirty.append(u)
        self.adj[v].clear()

    def _table(self, neighbours: tuple[int, ...], best: np.ndarray) -> np.ndarray:
        """Index the DP answer by the neighbours' original strategy indices."""
        table = np.full([len(self.graph.node_costs[u]) for u in neighbours], -1, dtype=np.int64)
        table[np.ix_(*[self.live[u] for u in neighbours])] = best
        return table

    def back_substitute(self, core_choice: Mapping[int, int]) -> tuple[int, ...]:
        """Choices of eliminated nodes from their neighbours', last eliminated first."""
        choice = np.full(self.graph.num_nodes, -1, dtype=np.int64)
        for v, s in core_choice.items():
            choice[v] = s
        for step in reversed(self.eliminated):
            choice[step.node] = step.table[tuple(choice[u] for u in step.neighbours)]
        assert (choice >= 0).all(), "back-substitution left a node without a strategy"
        return tuple(int(s) for s in choice)


def _is_decomposable(r: np.ndarray) -> bool:
    """R[i, j] == a_i + b_j: the edge couples nothing and can live in the node costs."""
    if r.shape[0] == 1 or r.shape[1] == 1:
        return True
    if not np.isfinite(r).all():
        return False
    residual = r - r[:, :1] - r[:1, :] + r[0, 0]
    return bool(np.abs(residual).max() <= _DECOMPOSE_RTOL * max(np.abs(r).max(), 1e-300))


def _distinct(r: np.ndarray, axis: int) -> tuple[np.ndarray, np.ndarray]:
    """The distinct rows (axis 0) or columns (axis 1) of r, and the class of each one.

    Resharding matrices repeat rows and columns (strategies with the same output spec, or
    wanting the same input spec), so both the dominance test and the ILP work per class.
    """
    lines = np.ascontiguousarray(r if axis == 0 else r.T) + 0.0  # + 0.0: -0.0 becomes 0.0
    classes: dict[bytes, int] = {}
    representatives: list[int] = []
    inverse = np.empty(len(lines), dtype=np.int64)
    for i, line in enumerate(lines):
        c = classes.setdefault(line.tobytes(), len(representatives))
        if c == len(representatives):
            representatives.append(i)
        inverse[i] = c
    unique = lines[representatives]
    return (unique if axis == 0 else unique.T), inverse


def _switch_penalty(r: np.ndarray) -> np.ndarray:
    """[a, b]: the most that switching from strategy b to a can cost on this edge,
    max_j (R[a, j] - R[b, j]), over the neighbour's strategies j that b can meet."""
    r = _distinct(r, axis=1)[0]  # equal columns (neighbour strategies) say the same
    with np.errstate(invalid="ignore"):
        diff = r[:, None, :] - r[None, :, :]  # [a, b, j]
    # where b cannot meet j at all, that j says nothing against a (also inf - inf)
    diff = np.where(np.isinf(r)[None, :, :], -np.inf, diff)
    return diff.max(axis=2)


def _dominated(cost: np.ndarray, memory: np.ndarray, penalties: list[np.ndarray], memory_aware: bool) -> np.ndarray:
    """Strategies b for which some kept strategy a is never worse, whatever the neighbours pick.

    extra[a, b] = c[a] - c[b] + sum_edges penalty[a, b] <= 0 proves it; the bound is
    subadditive, so dropping one at a time (never both of a tie) stays exact. Under a
    memory budget a must also use no more memory than b.
    """
    k = len(cost)
    if k == 1:
        return np.zeros(1, dtype=bool)
    extra = cost[:, None] - cost[None, :]
    for penalty in penalties:
        extra = extra + penalty
    if memory_aware:
        extra[memory[:, None] > memory[None, :]] = np.inf
    np.fill_diagonal(extra, np.inf)
    beats = extra <= 0
    dropped = np.zeros(k, dtype=bool)
    for b in np.flatnonzero(beats.any(axis=0)):
        if (beats[:, b] & ~dropped).any():
            dropped[b] = True
    return dropped


# ------------------------------------------------------------------------ the ILP (eq. 1)


@dataclass(frozen=True)
class _Model:
    """Eq. 1 for the core nodes, as an LP-format file text ready for CBC."""

    text: str
    node_of_column: np.ndarray  # s-column g -> core node
    strategy_of_column: np.ndarray  # s-column g -> original strategy index
    num_variables: int
    num_constraints: int
    build_seconds: float
    nodes: tuple[int, ...]
    has_budget: bool


def _build_model(work: _WorkGraph, core: list[int], memory_budget: float | None) -> _Model:
    """Write eq. 1 for the core with numpy and string joins (no per-term PuLP objects).

    Variables: binary one-hot s_v per node, and per edge a continuous e over pairs of
    row and column classes of R (strategies whose rows/columns of R are equal share a
    class, so an 84 x 84 edge between ops whose outputs take 9 specs needs 9 x 9). Rows:
    sum_J e[I, J] = sum_{i in I} s_u[i] and sum_I e[I, J] = sum_{j in J} s_v[j]. With s
    integral these force e to the one-hot outer product of the class indicators, so e
    needs no integrality; the paper's sum(e) = 1 follows from them and is left out. The
    LP bound equals that of the per-strategy e (spread e[I, J] over a class in proportion
    to s). An infinite R entry forbids its pair: it gets no e column.
    """
    t0 = time.perf_counter()
    sizes = [len(work.cost[v]) for v in core]
    first_s = dict(zip(core, np.cumsum([0] + sizes[:-1]).tolist()))
    num_s = sum(sizes)
    s_name = np.array([f"s{g}" for g in range(num_s)], dtype=object)
    edges = []
    for u in core:
        for w, r in work.adj[u].items():
            if u < w:
                rows_r, row_class = _distinct(r, axis=0)
                classes_r, col_class = _distinct(rows_r, axis=1)
                edges.append((u, w, classes_r, row_class, col_class))
    # Shift every cost block to start at 0 and scale the largest to _OBJECTIVE_SCALE, so
    # CBC's absolute tolerances act relative to what matters.
    node_obj = [work.cost[v] - work.cost[v].min() for v in core]
    edge_obj = [np.where(np.isinf(r), np.inf, r - r[np.isfinite(r)].min()) for _, _, r, _, _ in edges]
    peak = max([float(c.max()) for c in node_obj] + [float(r[np.isfinite(r)].max()) for r in edge_obj] + [0.0])
    scale = _OBJECTIVE_SCALE / peak if peak > 0 else 1.0

    objective: list[str] = []
    rows: list[str] = []
    for v, c in zip(core, node_obj):
        names = s_name[first_s[v] : first_s[v] + len(c)]
        rows.append(f"o{v}: " + " + ".join(names) + " = 1")
        objective += _terms(c * scale, names)
    num_e = 0
    for t, ((u, w, _, row_class, col_class), r) in enumerate(zip(edges, edge_obj)):
        finite = np.isfinite(r)
        e_name = np.full(r.shape, "", dtype=object)
        e_name[finite] = [f"x{num_e + i}" for i in range(int(finite.sum()))]
        num_e += int(finite.sum())
        objective += _terms(r[finite] * scale, e_name[finite])
        for side, (node, classes, e_lines) in enumerate(((u, row_class, e_name), (w, col_class, e_name.T))):
            members = s_name[first_s[node] : first_s[node] + len(classes)]
            for c, line in enumerate(e_lines):
                rows.append(
                    f"{'ab'[side]}{t}_{c}: " + " + ".join(line[line != ""]) + " - " + " - ".join(members[classes == c]) + " = 0"
                )
    if memory_budget is not None:
        memory = np.concatenate([work.memory[v] for v in core])
        peak_memory = float(memory.max()) if memory.max() > 0 else 1.0
        rows.append(
            "m: " + " + ".join(_terms(memory / peak_memory, s_name) or ["0 s0"]) + f" <= {float(memory_budget) / float(peak_memory)!r}"
        )
    # Each node's one-hot row is also an SOS1 set, so CBC may branch on the set (strategies up to some
    # index or after it) instead of one variable at a time. On a sub-mesh whose two axes cost alike
    # (2x2 inside a host) the LP optimum takes half of a strategy and half of its mirror at many
    # nodes; a set branch separates the two halves where a variable branch removes one strategy.
    sos = [] if not BRANCH_ON_SETS else [
        f"q{v}: S1:: " + " ".join(f"{n}:{i + 1}" for i, n in enumerate(s_name[first_s[v] : first_s[v] + size]))
        for v, size in zip(core, sizes)
        if size > 1
    ]
    text = "\n".join(
        ["Minimize", "obj: " + ("\n + ".join(objective) if objective else "0 s0"), "Subject To", *rows, "Binaries"]
        + [" ".join(s_name[i : i + 50]) for i in range(0, num_s, 50)]
        + (["SOS", *sos] if sos else [])
        + ["End", ""]
    )
    return _Model(
        text=text,
        node_of_column=np.concatenate([np.full(len(work.cost[v]), v) for v in core]),
        strategy_of_column=np.concatenate([work.live[v] for v in core]),
        num_variables=num_s + num_e,
        num_constraints=len(rows),
        build_seconds=time.perf_counter() - t0,
        nodes=tuple(core),
        has_budget=memory_budget is not None,
    )


def _terms(coefficients: np.ndarray, names: np.ndarray) -> list[str]:
    """'coef name' for the nonzero coefficients (repr: shortest exact decimal)."""
    nonzero = np.flatnonzero(coefficients)
    return [f"{c!r} {n}" for c, n in zip(coefficients[nonzero].tolist(), names[nonzero])]


def _incumbent(work: _WorkGraph, core: list[int], memory_budget: float | None) -> dict[int, int] | None:
    """A feasible core choice (original strategy indices) by coordinate descent: the answer
    when CBC runs out of time. Under a budget it starts from the smallest plan and only
    takes moves that fit."""
    if memory_budget is None:
        position = {v: int(np.argmin(work.cost[v])) for v in core}
        spare = np.inf
    else:
        position = {v: int(np.argmin(work.memory[v])) for v in core}
        spare = memory_budget - math.fsum(float(work.memory[v][position[v]]) for v in core)
    for _sweep in range(_INCUMBENT_SWEEPS):
        moved = False
        for v in core:
            total = work.cost[v].copy()
            for u, r in work.adj[v].items():
                total += r[:, position[u]]
            current = position[v]
            if memory_budget is not None:
                total[work.memory[v] - work.memory[v][current] > spare] = np.inf
            best = int(np.argmin(total))
            if total[best] < total[current]:
                spare -= work.memory[v][best] - work.memory[v][current]
                position[v], moved = best, True
        if not moved:
            break
    feasible = all(np.isfinite(r[position[v], position[u]]) for v in core for u, r in work.adj[v].items())
    if not feasible:
        return None
    return {v: int(work.live[v][p]) for v, p in position.items()}


def _cheaper(
    graph: CostGraph, work: _WorkGraph, found: dict[int, int], other: dict[int, int] | None, budget: float | None
) -> dict[int, int]:
    """Of two core choices, the one whose whole plan costs less (``other`` only if it fits the budget)."""
    if other is None or other == found:
        return found
    cost = [evaluate(graph, work.back_substitute(c)) for c in (found, other)]
    fits = budget is None or memory_of(graph, work.back_substitute(other)) <= budget
    return other if fits and cost[1] < cost[0] else found


def _fall_back(fallback: Callable[[], dict[int, int] | None], time_limit: float, why: str) -> dict[int, int]:
    choice = fallback()
    if choice is None:
        raise RuntimeError(f"CBC found no solution within {time_limit} s ({why}), nor did local search")
    return choice


def _run_cbc(
    model: _Model, fallback: Callable[[], dict[int, int] | None], time_limit: float, graph: CostGraph
) -> tuple[dict[int, int], str, float]:
    """Solve with PuLP's bundled CBC binary; return core choices (original strategy
    indices), status and seconds. If CBC runs out of time, ``fallback()`` is the answer."""
    t0 = time.perf_counter()
    cbc_path = pulp.apis.coin_api.pulp_cbc_path  # the binary bundled with PuLP
    if not os.access(cbc_path, os.X_OK):
        raise RuntimeError(f"PuLP's bundled CBC binary is not executable at {cbc_path}")
    with tempfile.TemporaryDirectory(prefix="alpa_ilp_") as tmp:
        lp_path, sol_path = os.path.join(tmp, "model.lp"), os.path.join(tmp, "model.sol")
        with open(lp_path, "w") as f:
            f.write(model.text)
        args = [cbc_path, lp_path, "-sec", repr(float(time_limit)), "-timeMode", "elapsed"]
        # Exact optimum: no gap, and any strictly better incumbent counts. The LP relaxation
        # of eq. 1 is tight or nearly so on these graphs, so CBC's preprocessing, cuts and
        # feasibility pump cost more than they save; its dual simplex solves the root LP
        # several times faster than its default; full strong branching costs more per
        # node than it saves in nodes. No MIP start: CBC re-solves the LP to
        # complete one, which cost more than the whole search on a 24-layer GPT.
        args += ["-ratioGap", "0", "-allowableGap", "0", "-increment", "1e-9"]
        # Pseudo-costs are trusted after one strong-branching look at a variable (``-trust 1``; CBC's
        # default looks more often): on the loose ILPs (a Wide-ResNet stage on 2x2) that, with the SOS
        # sets above, took the search from 168 nodes and 24 s to 22 nodes and 7 s, the same optimum.
        args += ["-preprocess", "off", "-feas", "off", "-strong", "2", "-dualSimplex"] + (["-trust", "1"] if BRANCH_ON_SETS else [])
        if not CBC_HEURISTICS:  # see CBC_HEURISTICS: the dives cost more than the search they would shorten
            args += ["-heuristicsOnOff", "off", "-round", "on"]  # rounding the LP solution costs nothing
        if not model.has_budget:
            args += ["-cuts", "off"]
        args += ["-solve", "-printingOptions", "normal", "-solution", sol_path]
        try:
            # CBC checks its clock only between phases: enforce the limit from outside too
            run = subprocess.run(
                args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                timeout=1.2 * time_limit + 5.0,
            )
        except subprocess.TimeoutExpired:
            return _fall_back(fallback, time_limit, "killed"), "time_limit", time.perf_counter() - t0
        if run.returncode != 0 or not os.path.exists(sol_path):
            tail = run.stdout.decode(errors="replace")[-2000:]
            raise RuntimeError(f"CBC failed (exit {run.returncode}):\n{tail}")
        with open(sol_path) as f:
            lines = f.read().splitlines()
    header = lines[0] if lines else ""
    # Run to its limit, CBC's report cannot be trusted: a search cut short without an incumbent was reported as
    # "Problem proven infeasible", and one with an incumbent wrote a file headed "Optimal" with the LP bound (a
    # 100-node mirror-symmetric graph, ``synthetic_mirrored_graph``). So past the limit it is a time-limited run:
    # its values are read if they choose a strategy for every node, and ``solve`` keeps the cheaper of them and
    # the fallback's.
    if time.perf_counter() - t0 >= time_limit:
        status = "time_limit"
    elif header.startswith(("Infeasible", "Integer infeasible")):
        raise InfeasibleError(
            "no choice satisfies the memory budget and the finite-cost pairs together", model.nodes
        )
    elif header.startswith("Optimal"):
        status = "optimal"
    elif header.startswith("Stopped") and "objective value" in header and "no integer" not in header:
        status = "time_limit"
    else:
        return _fall_back(fallback, time_limit, header), "time_limit", time.perf_counter() - t0
    choice: dict[int, int] = {}
    for line in lines[1:]:
        fields = line.split()
        if fields and fields[0] == "**":
            fields = fields[1:]
        if len(fields) >= 3 and fields[1].startswith("s") and float(fields[2]) > 0.5:
            g = int(fields[1][1:])
            choice[int(model.node_of_column[g])] = int(model.strategy_of_column[g])
    if any(v not in choice for v in model.nodes):  # e.g. "Stopped on iterations": LP trouble
        return _fall_back(fallback, time_limit, header), "time_limit", time.perf_counter() - t0
    return choice, status, time.perf_counter() - t0


# --------------------------------------------------------------------- synthetic workload

# One transformer layer: forward ops and the forward ops whose outputs each one reads
# (negative: the layer input); matmuls with a weight carry its name.
_LAYER_OPS: tuple[tuple[str, tuple[int, ...], str], ...] = (
    ("ln1", (-1,), ""),
    ("qkv", (0,), "w_qkv"),
    ("scores", (1, 1), ""),  # q and k: parallel edges
    ("softmax", (2,), ""),
    ("context", (3, 1), ""),  # and v
    ("proj", (4,), "w_o"),
    ("add1", (5, -1), ""),  # residual
    ("ln2", (6,), ""),
    ("fc1", (7,), "w_fc1"),
    ("gelu", (8,), ""),
    ("fc2", (9,), "w_fc2"),
    ("add2", (10, 6), ""),  # residual
)


_DIM_SHARDINGS = {"R": (), "S0": (0,), "S1": (1,), "S01": (0, 1)}  # mesh axes a tensor dim splits over


def _spec_prices(shape: tuple[int, int]) -> tuple[list[tuple[str, str]], np.ndarray, np.ndarray]:
    """Specs of a 2-D tensor on a 2-D mesh (each dim: R, S0, S1 or S01; no mesh axis twice)
    and the latency (s) and inverse bandwidth (s/byte) of resharding between them: slicing
    is free, gathering a sharded dim or moving it to other axes costs a collective."""
    axes = _DIM_SHARDINGS
    specs = [(a, b) for a in axes for b in axes if not set(axes[a]) & set(axes[b])]
    latency = np.zeros((len(specs), len(specs)))
    per_byte = np.zeros((len(specs), len(specs)))
    for i, src in enumerate(specs):
        for j, dst in enumerate(specs):
            for s_dim, d_dim in zip(src, dst):
                if s_dim != d_dim and axes[s_dim] and not set(axes[s_dim]) <= set(axes[d_dim]):
                    devices = _devices(shape, (s_dim,))
                    latency[i, j] += 1e-5
                    per_byte[i, j] += 1e-11 * (devices - 1) / devices
    return specs, latency, per_byte


def _devices(shape: tuple[int, int], spec: Sequence[str]) -> int:
    """Devices a spec splits a tensor over."""
    return math.prod(shape[a] for dim in spec for a in _DIM_SHARDINGS[dim])


def synthetic_gpt_graph(
    num_nodes: int, num_strategies: int | tuple[int, int] = 16, seed: int = 0
) -> CostGraph:
    """A cost graph shaped like a GPT train step, for tests and benchmarks without JAX.

    Per layer (40 nodes): a forward chain with residual skips and attention fan-out, the
    mirrored backward chain, the inputs of each matmul saved for its backward op,
    and per weight: the parameter (read forward and backward), its gradient, its optimizer
    state and its update. A strategy is an output spec of a 2-D tensor on a 2 x 4 mesh
    (9 specs; more strategies repeat specs with other costs, as matmul variants do), an
    operand wants a spec derived from it (transposed for weights), and resharding prices
    follow ``_spec_prices``. A (lo, hi) pair draws k per node. About ``num_nodes`` nodes.
    """
    rng = np.random.default_rng(seed)
    lo, hi = (num_strategies, num_strategies) if isinstance(num_strategies, int) else num_strategies
    mesh_shape = (2, 4)
    specs, latency, per_byte = _spec_prices(mesh_shape)
    transposed = np.array([specs.index((b, a)) for a, b in specs])
    shards = np.array([_devices(mesh_shape, spec) for spec in specs])

    out_spec: list[np.ndarray] = []
    costs: list[np.ndarray] = []
    memory: list[np.ndarray] = []
    sizes: list[float] = []
    edges: list[tuple[int, int, np.ndarray]] = []

    def node(flops: float, size: float) -> int:
        k = int(rng.integers(lo, hi + 1))
        spec = np.arange(k) % len(specs)
        partial = np.arange(k) >= len(specs)  # variants that leave a partial sum to all-reduce
        out_spec.append(spec)
        sizes.append(size)
        costs.append(flops / 1e14 / shards[spec] + partial * (1e-5 + size * 2e-11) + rng.uniform(0, 1e-7, k))
        memory.append(np.round(size / shards[spec]))
        return len(out_spec) - 1

    def edge(producer: int, consumer: int, weight_operand: bool = False) -> None:
        wanted = transposed[out_spec[consumer]] if weight_operand else out_spec[consumer]
        pairs = np.ix_(out_spec[producer], wanted)
        edges.append((producer, consumer, latency[pairs] + sizes[producer] * per_byte[pairs]))

    layer_input = node(0.0, 5e7)
    for _layer in range(max(1, (num_nodes - 1) // 40)):
        fwd = [node(rng.uniform(1e9, 1e11), rng.uniform(1e7, 1e8)) for _ in _LAYER_OPS]
        bwd = [node(rng.uniform(1e9, 2e11), rng.uniform(1e7, 1e8)) for _ in _LAYER_OPS]
        out_of = lambda i: fwd[i] if i >= 0 else layer_input  # noqa: E731
        for c, (name, reads, weight) in enumerate(_LAYER_OPS):
            for p in reads:
                edge(out_of(p), fwd[c])  # forward dataflow
                if weight or name in ("scores", "context"):
                    edge(out_of(p), bwd[c])  # a matmul's backward reads its saved inputs
                if p >= 0:
                    edge(bwd[c], bwd[p])  # gradient flows back
            if weight:
                w = node(0.0, rng.uniform(1e7, 5e7))
                grad, state, update = (node(rng.uniform(1e9, 1e11), sizes[w]) for _ in range(3))
                edge(w, fwd[c], weight_operand=True)
                edge(w, bwd[c], weight_operand=True)
                edge(out_of(reads[0]), grad)
                edge(bwd[c], grad)
                for source in (w, grad, state):
                    edge(source, update)
        layer_input = fwd[-1]
    return CostGraph(tuple(costs), tuple(memory), tuple(edges), tuple(f"n{v}" for v in range(len(costs))))


def synthetic_mirrored_graph(num_nodes: int, *, seed: int = 0, degree: float = 4.0, max_pairs: int = 2) -> CostGraph:
    """A cost graph that does not change when a 2x2 mesh's two axes swap places, as a stage's on 2x2 devices inside
    one host: strategies come in mirror pairs (2i, 2i + 1), and each edge prefers its ends in the same orientation or
    in opposite ones. Cycles with an odd number of 'opposite' edges make the LP bound loose (half of each mirror
    everywhere pays nothing), so CBC must branch: the test and benchmark case for ``BRANCH_ON_SETS``."""
    rng = np.random.default_rng(seed)
    pairs = rng.integers(1, max_pairs + 1, size=num_nodes)
    costs = tuple(np.repeat(rng.random(p), 2) for p in pairs)
    memory = tuple(np.ones(2 * p) for p in pairs)
    probability = min(1.0, degree / max(num_nodes - 1, 1))
    edges = []
    for u in range(num_nodes):
        for v in range(u + 1, num_nodes):
            if rng.random() < probability:
                base = np.repeat(np.repeat(rng.random((pairs[u], pairs[v])), 2, 0), 2, 1)
                aligned = (np.arange(2 * pairs[u])[:, None] % 2) == (np.arange(2 * pairs[v])[None, :] % 2)
                preferred = ~aligned if rng.random() < 0.5 else aligned
                edges.append((u, v, np.where(preferred, base, base + rng.random())))
    return CostGraph(costs, memory, tuple(edges), tuple(f"n{v}" for v in range(num_nodes)))
