"""Runtime overhead of applying a plan, on the local simulated devices.

For each example model it measures, in one run: compile time and median step time of the
planned program (every op constrained to its planned sharding, on a 2x2 mesh of simulated
CPU devices) against the baseline of ``jax.jit(train_step)`` on one device. Simulated
devices share this machine's cores, so the step-time ratio shows the cost of the sharded
program's extra work (collectives, constraints), not a real speed-up; on a real cluster the
devices run in parallel.

    python benchmarks/runtime.py [--models mlp,gpt,moe] [--steps 10] [--mesh 2x2]
"""

from __future__ import annotations

import argparse
import statistics
import time

import alpa_lab as al  # first: it gives this process simulated CPU devices  # isort: skip
import jax
from alpa_lab.models import EXAMPLES


def timed_steps(fn, state, batch, steps: int) -> tuple[float, float]:
    """(seconds of the first call, which compiles; median seconds of the next ``steps``)."""
    t0 = time.perf_counter()
    state, loss = fn(state, batch)
    jax.block_until_ready(loss)
    first = time.perf_counter() - t0
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        state, loss = fn(state, batch)
        jax.block_until_ready((state, loss))
        times.append(time.perf_counter() - t0)
    return first, statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="mlp,gpt,bert,moe,wide_resnet")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--mesh", default="2x2")
    args = parser.parse_args()
    n0, n1 = (int(x) for x in args.mesh.split("x"))
    cluster = al.ClusterSpec.local(1, n0 * n1)
    print(f"planned program on a {n0}x{n1} mesh of simulated CPU devices vs jax.jit on one device; "
          f"medians of {args.steps} steps")
    print(f"{'model':<12} {'plan s':>7} | {'compile s':>9} {'base':>7} {'ratio':>6} | {'step ms':>8} {'base':>8} {'ratio':>6}")
    for name in args.models.split(","):
        config_cls, make = EXAMPLES[name]
        ex = make(config_cls())
        step = al.parallelize(ex.train_step, cluster=cluster, mesh_shape=(n0, n1))
        t0 = time.perf_counter()
        step.plan(*ex.args)
        plan_s = time.perf_counter() - t0
        first, step_s = timed_steps(step, ex.state, ex.batch, args.steps)
        base_first, base_s = timed_steps(jax.jit(ex.train_step), ex.state, ex.batch, args.steps)
        print(f"{name:<12} {plan_s:>7.2f} | {first:>9.2f} {base_first:>7.2f} {first / base_first:>6.2f} | "
              f"{step_s * 1e3:>8.2f} {base_s * 1e3:>8.2f} {step_s / base_s:>6.2f}", flush=True)


if __name__ == "__main__":
    main()
