"""The live dashboard's latency and cost to the run, and calibration time, measured in one run.

For the tiny MLP pipeline (2 stages on 1x4 sub-meshes, 4 micro-batches, 1F1B) it trains
rounds of ``--steps`` steps alternately without and with a dashboard following the run (the
same plan, the same process: the baseline is measured in the same run), and prints:

- update latency: from the newest instruction's end on the device (the event's own clock) to
  the dashboard redraw that showed it, median and p95 (target: under 500 ms);
- the dashboard's cost to the run: median step time with it against without it, as the median of
  the per-round ratios (target: under 3%; this 2-core machine swings more than that between
  rounds, so also the share of the run's wall time the dashboard spent redrawing, an upper
  bound of what it can take from the run);
- redraws per second while the run trains (target: at least 2; a round must last several of
  the dashboard's 0.4 s intervals for the rate to mean anything, hence 150 steps a round);
- ``ClusterSpec.calibrate`` time on this machine's devices (target: under 60 s).

``--ray`` runs the same on a local Ray cluster (2 hosts x 4 devices) of mesh workers.

    python benchmarks/dashboard.py [--steps 150] [--rounds 6] [--ray] [--no-calibrate]
"""

from __future__ import annotations

import argparse
import statistics
import time

import alpa_lab as al  # first: it gives this process simulated CPU devices  # isort: skip
import numpy as np
from alpa_lab.models import tiny_example
from alpa_lab.notebook.dashboard import Dashboard


def one_run(step, ex, steps: int, dashboard: bool) -> tuple[list[float], Dashboard | None, float]:
    run = step.train(ex.state, ex.batch, steps=steps, start=False)
    dash = Dashboard(run, interval=0.4) if dashboard else None
    t0 = time.perf_counter()
    run.start()
    run.wait()
    wall = time.perf_counter() - t0
    if dash is not None:
        dash.wait(30)
    assert run.status == "finished", run.error
    return [r.seconds for r in run.monitor.steps()[1:]], dash, wall


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--ray", action="store_true", help="on a local Ray cluster of mesh workers (2 x 4)")
    ap.add_argument("--no-calibrate", action="store_true")
    args = ap.parse_args()

    cluster = al.RayCluster.local(2, 4) if args.ray else None
    spec = cluster.spec if cluster else al.ClusterSpec.local(1, 8)
    try:
        ex = tiny_example("mlp")
        step = al.parallelize(ex.train_step, cluster=spec, microbatches=4, layers=4)
        plan = step.plan(ex.state, ex.batch).pin_stages([[0, 1], [2, 3]], submeshes=[(1, 4), (1, 4)])
        step.use(plan)
        if cluster:
            step.on_ray(cluster)
        one_run(step, ex, 3, False)  # compile once, outside the timings
        without, with_dash, latencies, rates, ratios, busy = [], [], [], [], [], []
        for _ in range(args.rounds):  # alternate, so drift on this noisy machine hits both alike
            plain, _, _ = one_run(step, ex, args.steps, False)
            without += plain
            times, dash, wall = one_run(step, ex, args.steps, True)
            with_dash += times
            ratios.append(statistics.median(times) / statistics.median(plain))
            busy.append(dash.busy_seconds / wall)
            steps = dash.run.monitor.steps()  # redraws while it trained (a Ray run launches first)
            first, last = steps[0].start, steps[-1].start + steps[-1].seconds
            rates.append(sum(first <= t <= last for t in dash.update_times) / (last - first))
            latencies += list(dash.latencies)
        backend = "Ray 2x4" if cluster else "in-process"
        base, dashed = statistics.median(without), statistics.median(with_dash)
        print(f"tiny MLP, 2 stages x 1x4, 4 micro-batches, 1F1B, {backend}; {args.rounds} rounds x {args.steps} steps each way")
        print(f"  step time without dashboard   {base * 1e3:8.2f} ms (median of {len(without)})")
        print(f"  step time with dashboard      {dashed * 1e3:8.2f} ms (median of {len(with_dash)})")
        print(f"  dashboard overhead            {(statistics.median(ratios) - 1) * 100:+8.1f} %   (median of per-round ratios "
              f"{', '.join(f'{r:.2f}' for r in ratios)}; target < 3%)")
        print(f"  time spent redrawing          {statistics.median(busy) * 100:8.2f} % of the run's wall time")
        lat = np.asarray(latencies) * 1e3
        print(f"  update latency                {np.median(lat):8.1f} ms median, {np.percentile(lat, 95):.1f} ms p95 "
              f"over {len(lat)} redraws (target < 500 ms)")
        print(f"  redraws per second            {statistics.median(rates):8.2f}        (target >= 2 while running)")
    finally:
        if cluster:
            step.on_ray(None)
            cluster.shutdown()
    if not args.no_calibrate:
        t0 = time.perf_counter()
        al.ClusterSpec.calibrate(1, 4, save=False)
        print(f"  calibration (1 host x 4 devices) {time.perf_counter() - t0:8.1f} s (target < 60 s)")


if __name__ == "__main__":
    main()
