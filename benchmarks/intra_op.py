"""Intra-op planning time for GPT train steps of 1 to 24 layers (hidden 1024) on a 2x4 mesh.

For each depth it prints where the time goes (trace, strategy enumeration and resharding
tables, ILP build, ILP solve), the sizes (ops, ILP groups after merging, groups left after
the exact reductions, variables), and, measured in the same run on the same traced graph,
the planning time of plain data parallelism as the baseline. Timings are medians of
``--repeats`` runs; this machine is noisy, so compare ratios.

    python benchmarks/intra_op.py [--layers 1,2,4,8,16,24] [--repeats 3] [--mesh 2x4]
"""

from __future__ import annotations

import argparse
import statistics
import time

import alpa_lab as al
from alpa_lab.models import gpt_config, make_gpt
from alpa_lab.passes.intra_op import build_strategy_graph
from alpa_lab.passes.methods import solve_method

TARGET_SECONDS = 5.0


def plan_once(graph, mesh, method: str, reuse: bool = True) -> dict:
    t0 = time.perf_counter()
    sg = build_strategy_graph(graph, mesh, reuse_repeated_blocks=reuse)
    t1 = time.perf_counter()
    solved = solve_method(sg, method)
    t2 = time.perf_counter()
    ilp = solved.solution.ilp
    return {
        "enumerate": t1 - t0,
        "ilp_build": ilp.build_seconds,
        "ilp_solve": ilp.solve_seconds,
        "total": t2 - t0,
        "groups": len(sg.cost_graph.node_costs),
        "core": len(sg.cost_graph.node_costs) - ilp.reduced_nodes,
        "variables": ilp.num_variables,
        "objective": solved.solution.objective,
        "rewrites": len(solved.rewrites),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", default="1,2,4,8,16,24")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--mesh", default="2x4")
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--untied-up-to", type=int, default=4, help="also plan without block reuse up to this depth")
    args = parser.parse_args()
    n0, n1 = (int(x) for x in args.mesh.split("x"))
    cluster = al.ClusterSpec.preset("p3.16xlarge", hosts=1) if n0 * n1 == 8 else al.ClusterSpec.local(1, n0 * n1)
    mesh = cluster.logical_mesh((n0, n1))
    print(f"GPT hidden {args.hidden}, seq {args.seq}, batch {args.batch} on a {n0}x{n1} mesh of {cluster.name}; "
          f"medians of {args.repeats}")
    header = (f"{'layers':>6} {'ops':>6} {'groups':>6} {'core':>5} {'vars':>7} | {'trace':>6} {'enum':>6} "
              f"{'build':>6} {'solve':>6} {'alpa':>7} | {'DP':>6} {'alpa/DP':>7} | {'step ms':>8} {'DP ms':>8} | "
              f"{'untied':>7} {'quality':>7}")
    print(header)
    print("-" * len(header))
    for layers in (int(x) for x in args.layers.split(",")):
        config = gpt_config(layers=layers, hidden=args.hidden, heads=args.hidden // 64, seq_len=args.seq, batch=args.batch)
        ex = make_gpt(config, abstract=True)
        t0 = time.perf_counter()
        graph = al.trace(ex.train_step, *ex.args)
        trace_s = time.perf_counter() - t0
        runs = [plan_once(graph, mesh, "alpa") for _ in range(args.repeats)]
        base = [plan_once(graph, mesh, "data_parallel") for _ in range(args.repeats)]
        med = {k: statistics.median(r[k] for r in runs) for k in ("enumerate", "ilp_build", "ilp_solve", "total")}
        dp = statistics.median(r["total"] for r in base)
        r0 = runs[0]
        untied = ""
        if layers <= args.untied_up_to:  # the same ILP without TAP reuse: time, and plan quality
            u = plan_once(graph, mesh, "alpa", reuse=False)
            untied = f"{u['total']:>7.2f} {r0['objective'] / u['objective']:>7.4f}"
        print(f"{layers:>6} {len(graph.ops):>6} {r0['groups']:>6} {r0['core']:>5} {r0['variables']:>7} | "
              f"{trace_s:>6.2f} {med['enumerate']:>6.2f} {med['ilp_build']:>6.2f} {med['ilp_solve']:>6.2f} "
              f"{med['total']:>7.2f} | {dp:>6.2f} {med['total'] / dp:>7.2f} | "
              f"{r0['objective'] * 1e3:>8.2f} {base[0]['objective'] * 1e3:>8.2f} | {untied}", flush=True)
        if layers == 24:
            total = trace_s + med["total"]
            verdict = "meets" if total < TARGET_SECONDS else "misses"
            print(f"24-layer GPT traced and planned in {total:.2f}s: {verdict} the {TARGET_SECONDS:.0f}s target")
    print("columns: enum = strategies + resharding tables; build/solve = ILP; alpa = enum+build+solve (+rewrite);"
          " DP = same for data parallel; step/DP ms = predicted step time of each plan;\n"
          "untied = planning time without repeated-block reuse; quality = predicted step time with reuse / without"
          " (1.0000: reuse lost nothing)")


if __name__ == "__main__":
    main()
