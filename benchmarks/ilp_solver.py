"""How fast the intra-op ILP solves GPT-like cost graphs, with and without the reductions.

Builds ``synthetic_gpt_graph`` of increasing size and prints, as medians of a few runs:
nodes, edges, nodes left after the exact reductions, ILP variables, build and solve
seconds; and, as the same-run baseline, the same graph with ``reduce=False`` (the plain
eq. 1 ILP), skipped once a smaller graph took longer than the baseline limit.

    python benchmarks/ilp_solver.py [--sizes 100 500 1000 2000 4000] [--strategies 16]
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass

from alpa_lab.passes.ilp import CostGraph, ILPSolution, solve, synthetic_gpt_graph


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
    args = parser.parse_args()

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


if __name__ == "__main__":
    main()
