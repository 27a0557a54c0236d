"""How fast the intra-op ILP solves GPT-like cost graphs, with and without the reductions.

Builds ``synthetic_gpt_graph`` of increasing size and prints, as medians of a few runs:
nodes, edges, nodes left after the exact reductions, ILP variables, build and solve
seconds; and, as the same-run baseline, the same graph with ``reduce=False`` (the plain
eq. 1 ILP), skipped once a smaller graph took longer than the baseline limit.

    python benchmarks/ilp_solver.py [--sizes 100 500 1000 2000 4000] [--strategies 16]

``--mirrored 40 60 80`` instead times ``synthetic_mirrored_graph`` (a sub-mesh whose two axes cost alike: a
loose LP bound, so CBC branches) with CBC branching on each node's strategy set (``BRANCH_ON_SETS``), against
one variable at a time, its default, in the same run. ``--mirrored ... --heuristics`` compares our setting of
CBC's primal heuristics (off, ``CBC_HEURISTICS``) with CBC's default (on) on the same graphs instead.
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass

from alpa_lab.passes import ilp
from alpa_lab.passes.ilp import CostGraph, ILPSolution, solve, synthetic_gpt_graph, synthetic_mirrored_graph


@dataclass(frozen=True)
class Timing:
    """Medians over the repeats of one configuration."""

    solution: ILPSolution
    build_seconds: float
    solve_seconds: float
    total_seconds: float


def time_solve(graph: CostGraph, *, reduce: bool, repeats: int, time_limit: float) -> Timing:
    """Median timings; stop repeating once one run hits the limit (the rest would too)."""
    runs: list[tuple[ILPSolution, float]] = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        solution = solve(graph, reduce=reduce, time_limit=time_limit)
        runs.append((solution, time.perf_counter() - t0))
        if solution.status != "optimal":
            break
    return Timing(
        solution=runs[-1][0],
        build_seconds=statistics.median(s.build_seconds for s, _ in runs),
        solve_seconds=statistics.median(s.solve_seconds for s, _ in runs),
        total_seconds=statistics.median(t for _, t in runs),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[100, 500, 1000, 2000, 4000])
    parser.add_argument("--strategies", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--time-limit", type=float, default=120.0, help="CBC limit with reductions")
    parser.add_argument("--baseline-limit", type=float, default=60.0, help="CBC limit for reduce=False")
    parser.add_argument("--mirrored", type=int, nargs="*", default=None, help="node counts of mirror-symmetric graphs")
    parser.add_argument("--seeds", type=int, default=3, help="graphs per --mirrored size")
    parser.add_argument("--pairs", type=int, default=6, help="most mirror pairs of strategies per node (--mirrored)")
    parser.add_argument("--heuristics", action="store_true",
                        help="with --mirrored: CBC's heuristics off (ours) against on (its default), not sets against variables")
    args = parser.parse_args()
    if args.mirrored is not None:
        return mirrored(args)

    header = (
        f"{'nodes':>6} {'edges':>6} {'left':>5} {'vars':>8} {'build s':>8} {'solve s':>8} {'total s':>8} "
        f"{'status':>10} | {'plain vars':>10} {'plain total s':>13} {'status':>10}"
    )
    print(f"synthetic GPT-like graphs, {args.strategies} strategies per node, medians of {args.repeats}")
    print(header)
    print("-" * len(header))
    baseline_on = True
    for size in args.sizes:
        graph = synthetic_gpt_graph(size, args.strategies, seed=0)
        reduced = time_solve(graph, reduce=True, repeats=args.repeats, time_limit=args.time_limit)
        sol = reduced.solution
        row = (
            f"{graph.num_nodes:>6} {len(graph.edges):>6} {graph.num_nodes - sol.reduced_nodes:>5} "
            f"{sol.num_variables:>8} {reduced.build_seconds:>8.3f} {reduced.solve_seconds:>8.3f} "
            f"{reduced.total_seconds:>8.3f} {sol.status:>10} | "
        )
        if baseline_on:
            plain = time_solve(graph, reduce=False, repeats=args.repeats, time_limit=args.baseline_limit)
            row += f"{plain.solution.num_variables:>10} {plain.total_seconds:>13.3f} {plain.solution.status:>10}"
            if plain.solution.status != "optimal" or plain.total_seconds > args.baseline_limit:
                baseline_on = False
            gap = (plain.solution.objective - sol.objective) / max(abs(sol.objective), 1e-300)
            if plain.solution.status == "optimal" and sol.status == "optimal" and abs(gap) > 1e-6:
                row += f"  (objectives differ by {gap:.2e})"
        else:
            row += f"{'skipped: a smaller graph took > ' + str(int(args.baseline_limit)) + ' s':>36}"
        print(row, flush=True)


def mirrored(args: argparse.Namespace) -> None:
    """Our CBC setting against the other one on loose ILPs: per size, the median over seeds of each one's seconds.

    The setting compared is set branching (``BRANCH_ON_SETS``), or with ``--heuristics`` CBC's primal heuristics
    (``CBC_HEURISTICS``, ours off); both runs of a graph must reach the same optimum."""
    flag, ours = ("CBC_HEURISTICS", False) if args.heuristics else ("BRANCH_ON_SETS", True)
    labels = ("heur. off s", "heur. on s") if args.heuristics else ("sets s", "variables s")
    print(f"mirror-symmetric graphs (degree 4, 2-{2 * args.pairs} strategies per node), {args.seeds} seeds per size, "
          f"CBC limit {args.time_limit:.0f} s")
    print(f"{'nodes':>6} {'left':>5} {labels[0]:>12} {labels[1]:>12} {'ratio':>6}  statuses")
    for size in args.mirrored or [40, 60, 80]:
        times: dict[bool, list[float]] = {ours: [], not ours: []}
        statuses, left = [], []
        for seed in range(args.seeds):
            graph = synthetic_mirrored_graph(size, seed=seed, max_pairs=args.pairs)
            found = {}
            try:
                for value in (ours, not ours):
                    setattr(ilp, flag, value)
                    t0 = time.perf_counter()
                    found[value] = solve(graph, time_limit=args.time_limit)
                    times[value].append(time.perf_counter() - t0)
                    statuses.append(found[value].status)
            finally:
                setattr(ilp, flag, ours)
            left.append(graph.num_nodes - found[ours].reduced_nodes)
            if all(f.status == "optimal" for f in found.values()):
                assert abs(found[ours].objective - found[not ours].objective) <= 1e-9 * abs(found[not ours].objective), (size, seed)
        a, b = statistics.median(times[ours]), statistics.median(times[not ours])
        shown = ",".join(sorted(set(statuses)))
        print(f"{size:>6} {statistics.median(left):>5.0f} {a:>12.2f} {b:>12.2f} {b / a:>6.2f}  {shown}", flush=True)


if __name__ == "__main__":
    main()
