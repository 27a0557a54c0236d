"""How quickly the workbench answers an edit: from a pin to an updated plan and redrawn views.

A 24-layer GPT pipelined on 2 hosts x 4 simulated devices (4 micro-batches, 1F1B). In one
run it measures, each as a median over several edits:

* **pin inside a stage**: ``Workbench.pin`` of a dot to another strategy (only that stage's
  ILP is re-solved; the other stages' plans are reused), then every view redrawn;
* **boundary move**: ``Workbench.pin_stages`` shifting the boundary by one layer (the two
  stages are re-planned; equal stages come from the cache), then every view redrawn;
* **baseline**: a full re-plan from scratch of the same step (a new ``ParallelizedStep``:
  trace, layer costs, stage DP, stage plans), as a user without the workbench would.

Targets (issue 4): under 1 s median for a pin inside a stage, under 3 s for a boundary move.

    python benchmarks/interactive.py [--layers 24] [--plan-layers 8] [--edits 5]
"""

from __future__ import annotations

import argparse
import statistics
import time

import alpa_lab as al  # first: it gives this process simulated CPU devices  # isort: skip
from alpa_lab.models import EXAMPLES
from alpa_lab.notebook import Workbench


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=24, help="transformer blocks in the GPT")
    parser.add_argument("--plan-layers", type=int, default=8, help="layers the automatic layering cuts it into")
    parser.add_argument("--edits", type=int, default=5, help="edits of each kind (medians)")
    parser.add_argument("--baselines", type=int, default=2, help="full re-plans from scratch (median)")
    args = parser.parse_args()

    config_cls, make = EXAMPLES["gpt"]
    ex = make(config_cls(layers=args.layers))
    cluster = al.ClusterSpec.local(2, 4)

    def fresh_plan():
        step = al.parallelize(ex.train_step, cluster=cluster, microbatches=4, layers=args.plan_layers)
        return step, step.plan(ex.state, ex.batch)

    baseline = []
    for _ in range(args.baselines):
        t0 = time.perf_counter()
        step, plan = fresh_plan()
        baseline.append(time.perf_counter() - t0)
    # two stages of equal halves, so every edit below has room on both sides
    half = plan.num_layers // 2
    plan = plan.pin_stages([[0, half - 1], [half, plan.num_layers - 1]], submeshes=[(1, 4), (1, 4)])
    t0 = time.perf_counter()
    wb = Workbench(plan, step)
    first_draw = time.perf_counter() - t0

    # pins inside one stage: dots of the last stage, each to its cheapest other strategy
    last = plan.stages[-1].plan
    dots = [o for o in last.ops if o.kind == "op" and o.primitive == "dot_general" and o.num_strategies > 2][: args.edits]
    pin_times, pin_views = [], []
    for op in dots:
        other = min((a for a in last.explain(op.name).alternatives if not a.chosen), key=lambda a: a.total).strategy
        t0 = time.perf_counter()
        ok = wb.pin(op.name, other)
        pin_times.append(time.perf_counter() - t0)
        pin_views.append(wb.refresh_seconds)
        if not ok:
            print(f"  pin {op.name}={other!r} refused: {wb.last_error}")
        wb.undo()

    # boundary moves: the boundary one layer left or right of the middle, alternately
    move_times, move_views = [], []
    for k in range(args.edits):
        b = half + (1 if k % 2 else -1) * (1 + k // 2)
        b = min(max(b, 1), plan.num_layers - 1)
        t0 = time.perf_counter()
        ok = wb.pin_stages([[0, b - 1], [b, plan.num_layers - 1]], [(1, 4), (1, 4)])
        move_times.append(time.perf_counter() - t0)
        move_views.append(wb.refresh_seconds)
        if not ok:
            print(f"  boundary at {b} refused: {wb.last_error}")
        wb.undo()

    med = statistics.median
    print(f"GPT {args.layers} blocks, {plan.num_layers} layers, 2 stages on 2x4 simulated devices, 4 micro-batches, 1f1b")
    print(f"{'edit':<28} {'median s':>9} {'of which views s':>17} {'vs full re-plan':>16} {'target':>7}")
    print(f"{'full re-plan (baseline)':<28} {med(baseline):9.3f} {'':>17} {1.0:15.1f}x {'':>7}")
    print(f"{'first draw of the widget':<28} {first_draw:9.3f}")
    print(f"{'pin inside a stage':<28} {med(pin_times):9.3f} {med(pin_views):17.3f} {med(baseline) / med(pin_times):15.1f}x {'< 1 s':>7}")
    print(f"{'boundary move':<28} {med(move_times):9.3f} {med(move_views):17.3f} {med(baseline) / med(move_times):15.1f}x {'< 3 s':>7}")
    print(f"(ratios: full re-plan seconds / edit seconds, same run; {len(pin_times)} pins, {len(move_times)} moves, "
          f"{len(baseline)} re-plans)")


if __name__ == "__main__":
    main()
