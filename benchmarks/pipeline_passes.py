"""How fast the pipeline planning passes run, and what they buy, against same-run baselines.

Prints three tables (medians of ``--repeats`` runs, ratios against a baseline measured in
the same run rather than absolute claims):

1. Stage DP (``stage_dp``, eq. 2-4) on a synthetic GPT-like stage cost model: planning
   seconds, stage_cost calls, stages chosen, eq.-2 latency; baseline (a) the best
   "equal layer" plan (S equal layer groups on S equal sub-meshes, best logical shape),
   baseline (b) ``brute_force_stages`` on the smallest case (time and that it matches).
2. Layering DP (``cluster_layers``, eq. 6) on synthetic GPT-like op chains of K ops,
   against ``brute_force_layers`` on tiny K (the only sizes it can do).
3. Pipeline schedules (gpipe, 1f1b, eager_1f1b, and beyond Alpa interleaved_1f1b with
   v = 2 chunks per mesh and zb_h1): simulated makespan and bubble fraction with forward
   1, backward 2 (zb_h1: split into B 1 and W 1), transfer 0.5 per message, peak
   in-flight micro-batches on mesh 0 (full forward stashes; "unfreed" adds ZB's
   micro-batches waiting for W), and ``check`` seconds; ratios against gpipe. S is the
   number of meshes; interleaved runs 2 S virtual stages at half the times each (the
   same work), its memory counted in whole-stage micro-batches (chunks / v).

    python benchmarks/pipeline_passes.py [--quick | --full] [--repeats 3] [--microbatches 16]
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from alpa_lab.passes.inter_op import (
    InterOpError,
    StageCost,
    brute_force_stages,
    logical_shapes,
    stage_dp,
)
from alpa_lab.graph.layering import brute_force_layers, cluster_layers
from alpa_lab.passes.schedule import check, make_schedule, simulate, warmup_timeline
from alpa_lab.passes.submesh import submesh_shapes

Shape = tuple[int, int]


def median_time(fn: Callable[[], object], repeats: int, budget: float = math.inf) -> tuple[object, float]:
    """(last result, median wall seconds) over ``repeats`` calls; stops repeating once the
    calls so far took more than ``budget`` seconds (a slow case is not worth 3 runs)."""
    times, result = [], None
    for _ in range(repeats):
        t0 = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - t0)
        if sum(times) > budget:
            break
    return result, statistics.median(times)


# --------------------------------------------------------------------------- #
# 1. stage DP
# --------------------------------------------------------------------------- #


@dataclass(frozen=True)
class GPTCostModel:
    """Synthetic per-micro-batch stage cost (forward + backward), in units of one layer on one device.

    * compute: layer FLOPs / devices, divided by an efficiency that drops as the mesh grows
      (1 / (1 + eff_loss * log2 d)); the first layer (embedding) and last (LM head) are heavier;
    * tensor parallelism over the logical mesh's b axis: an all-reduce of activations per
      layer, 2 (b - 1) / b times its cost, 10x dearer when the b axis spans hosts;
    * data parallelism over the a axis: a gradient all-reduce of the stage's (1/b-sharded)
      weights, 2 (a - 1) / a times its cost, 10x dearer across hosts;
    * plus a fixed per-extra-host latency (the cross-host term grows with hosts);
    * memory per device: weights / b + activations / a; None above ``mem_budget``.

    The first (embedding) and last (LM head) layers are heavier in FLOPs and weights, as
    with a large vocabulary, so equal layer groups are not automatically balanced.
    """

    num_layers: int
    devices_per_host: int
    eff_loss: float = 0.04
    tp_comm: float = 0.03  # per layer, intra-host
    dp_comm: float = 0.06  # per layer, intra-host
    cross_host_factor: float = 10.0
    host_latency: float = 0.02
    weight_mem: float = 4.0  # per layer
    act_mem: float = 2.0  # per layer
    mem_budget: float = 10.0

    edge_flops: float = 2.5  # embedding / LM-head layers (large vocabulary)
    edge_weights: float = 2.0  # their weight memory, relative to a block

    def layer_flops(self, i: int) -> float:
        return self.edge_flops if i in (0, self.num_layers - 1) else 1.0

    def layer_weights(self, i: int) -> float:
        return self.weight_mem * (self.edge_weights if i in (0, self.num_layers - 1) else 1.0)

    def __call__(self, start: int, end: int, shape: Shape, logical: Shape) -> StageCost | None:
        n, m = shape
        a, b = logical
        d = n * m
        layers = end - start
        weights = sum(self.layer_weights(i) for i in range(start, end))
        memory = weights / b + layers * self.act_mem / a
        if memory > self.mem_budget:
            return None
        flops = sum(self.layer_flops(i) for i in range(start, end))
        compute = flops / d * (1.0 + self.eff_loss * math.log2(d))
        # which logical axis crosses hosts: b (tensor) if it does not fit in one host, else a
        b_cross = n > 1 and b > m
        a_cross = n > 1 and not b_cross
        tp = layers * self.tp_comm * 2 * (b - 1) / b * (self.cross_host_factor if b_cross else 1.0)
        dp = layers * self.dp_comm / b * 2 * (a - 1) / a * (self.cross_host_factor if a_cross else 1.0)
        return StageCost(compute + tp + dp + self.host_latency * (n - 1), memory)


class Counting:
    """Wraps a stage_cost callable and counts calls."""

    def __init__(self, fn: Callable[..., StageCost | None]):
        self.fn, self.calls = fn, 0

    def __call__(self, *args):
        self.calls += 1
        return self.fn(*args)


def equal_layer_plan(L: int, N: int, M: int, B: int, cost) -> tuple[float, int]:
    """Best eq.-2 latency over S equal layer groups on S equal sub-meshes; (T, S)."""
    D = N * M
    shapes = set(submesh_shapes(N, M))
    best, best_s = math.inf, 0
    for S in range(1, min(L, D) + 1):
        if L % S or D % S:
            continue
        size, per = D // S, L // S
        shape = (1, size) if size <= M else (size // M, M)
        if shape not in shapes or shape[0] * shape[1] != size:
            continue
        times = []
        for i in range(S):
            opts = [cost(i * per, (i + 1) * per, shape, lg) for lg in logical_shapes(shape)]
            opts = [c.time for c in opts if c is not None]
            if not opts:
                break
            times.append(min(opts))
        else:
            T = sum(times) + (B - 1) * max(times)
            if T < best:
                best, best_s = T, S
    return best, best_s


def table_stage_dp(cases, B: int, repeats: int, budget: float) -> None:
    print(f"\n[1] stage DP (stage_dp) vs equal-layer slicing; GPT-like cost model, B = {B} micro-batches")
    header = (
        f"{'layers':>6} {'devices':>9} {'dp s':>8} {'calls':>8} {'stages':>6} {'T (eq.2)':>9} | "
        f"{'equal S':>7} {'equal T':>9} {'speed-up':>8}"
    )
    print(header)
    print("-" * len(header))
    smallest = None
    for L, N, M in cases:
        model = GPTCostModel(L, M)
        counter = Counting(model)

        def run():
            counter.calls = 0  # noqa: B023 (called at once)
            return stage_dp(L, N, M, B, counter)  # noqa: B023 (called at once)

        try:
            plan, secs = median_time(run, repeats, budget)
        except InterOpError as err:
            print(f"{L:>6} {f'{N}x{M}':>9}  infeasible: {err}")
            continue
        eq_T, eq_S = equal_layer_plan(L, N, M, B, model)
        speedup = f"{eq_T / plan.total_time:>7.2f}x" if math.isfinite(eq_T) else f"{'n/a':>8}"
        eq_txt = f"{eq_S:>7} {eq_T:>9.3f}" if math.isfinite(eq_T) else f"{'-':>7} {'none':>9}"
        sizes = "+".join(str(s.submesh_shape[0] * s.submesh_shape[1]) for s in plan.stages)
        print(
            f"{L:>6} {f'{N}x{M}':>9} {secs:>8.3f} {counter.calls:>8} {plan.num_stages:>6} "
            f"{plan.total_time:>9.3f} | {eq_txt} {speedup}   sub-mesh sizes {sizes}"
            + (" (1 run: over --case-budget)" if secs > budget and repeats > 1 else ""),
            flush=True,
        )
        if smallest is None:
            smallest = (L, N, M, plan, secs, model)
    if smallest is not None:
        L, N, M, plan, secs, model = smallest
        try:
            bf, bf_secs = median_time(lambda: brute_force_stages(L, N, M, B, model), repeats)
        except InterOpError as err:
            print(f"  brute_force_stages on ({L}, {N}x{M}): {err}")
            return
        match = "matches" if math.isclose(bf, plan.total_time, rel_tol=1e-9, abs_tol=1e-12) else "DIFFERS"
        print(
            f"  baseline brute_force_stages on ({L}, {N}x{M}): {bf_secs:.3f} s, T = {bf:.3f} "
            f"({match} DP); DP is {bf_secs / secs:.1f}x faster"
        )


# --------------------------------------------------------------------------- #
# 2. layering DP
# --------------------------------------------------------------------------- #


def gpt_op_chain(num_ops: int, seed: int = 0) -> tuple[list[float], list[tuple[int, int, float]]]:
    """A GPT-like op sequence: blocks of 8 ops (ln, qkv, attn, proj, add, ln, mlp, add).

    Chain edges carry activations, residual edges skip to each block's adds, matmuls carry
    the FLOPs; a little noise keeps the optimum unique-ish.
    """
    rng = np.random.default_rng(seed)
    pattern_flops = [0.01, 3.0, 2.0, 1.0, 0.01, 0.01, 8.0, 0.01]
    pattern_bytes = [1.0, 3.0, 1.0, 1.0, 1.0, 1.0, 4.0, 1.0]
    flops, edges = [], []
    for i in range(num_ops):
        p = i % 8
        flops.append(pattern_flops[p] * (1.0 + 0.1 * rng.random()))
        if i + 1 < num_ops:
            edges.append((i, i + 1, pattern_bytes[p] * (1.0 + 0.1 * rng.random())))
        if p == 4 and i >= 4:  # first residual add <- block input
            edges.append((i - 4, i, 1.0))
        if p == 7 and i >= 3:  # second residual add <- first add
            edges.append((i - 3, i, 1.0))
    return flops, edges


def table_layering(sizes, layer_counts, brute_sizes, repeats: int) -> None:
    print("\n[2] layering DP (cluster_layers, eq. 6) vs brute_force_layers; GPT-like op chains, delta 0.5")
    header = f"{'ops K':>6} {'L':>3} {'method':>12} {'seconds':>9} {'max in bytes':>12} {'delta':>5} {'vs brute':>9}"
    print(header)
    print("-" * len(header))
    for K in brute_sizes:
        flops, edges = gpt_op_chain(K)
        for L in [n for n in layer_counts if n <= K]:
            bf, bf_s = median_time(lambda: brute_force_layers(flops, edges, L), repeats)  # noqa: B023 (called at once)
            dp, dp_s = median_time(lambda: cluster_layers(flops, edges, L), repeats)  # noqa: B023 (called at once)
            same = dp.boundaries == bf.boundaries and dp.max_input_bytes == bf.max_input_bytes
            print(
                f"{K:>6} {L:>3} {'brute force':>12} {bf_s:>9.4f} {bf.max_input_bytes:>12.3f} "
                f"{bf.delta:>5.2g} {'1.00x':>9}  (baseline)"
            )
            print(
                f"{K:>6} {L:>3} {'DP':>12} {dp_s:>9.4f} {dp.max_input_bytes:>12.3f} {dp.delta:>5.2g} "
                f"{bf_s / dp_s:>8.1f}x  ({'same' if same else 'DIFFERENT'} boundaries as brute force)"
            )
    base = None
    for K in sizes:
        flops, edges = gpt_op_chain(K)
        for L in layer_counts:
            if L > K:
                continue
            dp, dp_s = median_time(lambda: cluster_layers(flops, edges, L), repeats)  # noqa: B023 (called at once)
            if base is None:
                base = (K, L, dp_s)
            scale = dp_s / base[2]
            print(
                f"{K:>6} {L:>3} {'DP':>12} {dp_s:>9.4f} {dp.max_input_bytes:>12.3f} {dp.delta:>5.2g} "
                f"  ({scale:.1f}x the K={base[0]}, L={base[1]} time)",
                flush=True,
            )


# --------------------------------------------------------------------------- #
# 3. schedules
# --------------------------------------------------------------------------- #


def table_schedules(stage_counts, mb_counts, repeats: int, fwd=1.0, bwd=2.0, xfer=0.5, chunks=2) -> None:
    print(
        f"\n[3] pipeline schedules: simulate(forward {fwd:g}, backward {bwd:g}, transfer {xfer:g}); "
        f"ratios vs gpipe of the same (S, M); interleaved: v = {chunks} chunks per mesh"
    )
    header = (
        f"{'S':>3} {'M':>4} {'schedule':>16} {'makespan':>9} {'/gpipe':>7} {'bubble':>7} "
        f"{'peak st0':>8} {'/gpipe':>7} {'unfreed0':>8} {'check s':>8}"
    )
    print(header)
    print("-" * len(header))
    for S in stage_counts:
        for M in mb_counts:
            ref = None
            for name in ("gpipe", "1f1b", "eager_1f1b", "interleaved_1f1b", "zb_h1"):
                if name == "interleaved_1f1b":
                    if M % S:
                        continue
                    v = chunks
                    sched = make_schedule(name, v * S, M, num_meshes=S)
                else:
                    v = 1
                    sched = make_schedule(name, S, M)
                tl = simulate(sched, fwd / v, bwd / v, xfer)
                _, check_s = median_time(lambda: check(sched), repeats)  # noqa: B023 (called at once)
                if ref is None:
                    ref = tl
                peak = tl.mesh_peak_in_flight[0] / v
                unfreed = tl.mesh_peak_unfreed[0] / v
                print(
                    f"{S:>3} {M:>4} {name:>16} {tl.makespan:>9.1f} {tl.makespan / ref.makespan:>7.3f} "
                    f"{tl.bubble_fraction:>7.3f} {peak:>8g} "
                    f"{peak / ref.peak_in_flight[0]:>7.3f} {unfreed:>8g} {check_s:>8.4f}",
                    flush=True,
                )


def table_warmup_timelines(cases, repeats: int) -> None:
    """The planner's timeline of a warm-up schedule without its lists (``warmup_timeline``) against building,
    compiling and simulating the schedule (the baseline), both with every record, in the same run; equal checked."""
    print("\n[4] warm-up schedule timelines with records: warmup_timeline vs make_schedule + simulate (median s)")
    print(f"{'S':>3} {'M':>5} {'schedule':>10} {'records':>8} {'simulate':>9} {'no lists':>9} {'speed-up':>9}")
    for S, M in cases:
        f = [1.0 + 0.01 * s for s in range(S)]
        b = [2.0 + 0.02 * s for s in range(S)]
        links = [0.1] * (S - 1)
        for name in ("1f1b", "gpipe"):
            base, base_s = median_time(lambda: simulate(make_schedule(name, S, M), f, b, links), repeats)  # noqa: B023
            fast, fast_s = median_time(lambda: warmup_timeline(name, f, b, links, M), repeats)  # noqa: B023
            assert fast == base, (S, M, name)
            print(f"{S:>3} {M:>5} {name:>10} {len(fast.records):>8} {base_s:>9.3f} {fast_s:>9.3f} {base_s / fast_s:>8.1f}x", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="smallest sizes only (smoke test)")
    size.add_argument("--full", action="store_true", help="add (96 layers, 128x8) to table 1")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--microbatches", type=int, default=16, help="B in eq. 2")
    parser.add_argument(
        "--case-budget", type=float, default=10.0,
        help="stop repeating a stage-DP case once its runs took this many seconds",
    )
    args = parser.parse_args()

    stage_cases = [(8, 1, 8), (16, 2, 8), (24, 8, 8), (48, 16, 8)]
    op_sizes, layer_counts, brute_sizes = [100, 500, 2000], [8, 16], [12]
    stage_counts, mb_counts = [2, 4, 8], [8, 32]
    if args.quick:
        stage_cases, op_sizes, stage_counts = stage_cases[:2], [100, 500], [2, 4]
    if args.full:
        stage_cases.append((96, 128, 8))

    t0 = time.perf_counter()
    print(f"medians of {args.repeats} runs")
    table_stage_dp(stage_cases, args.microbatches, args.repeats, args.case_budget)
    table_layering(op_sizes, layer_counts, brute_sizes, args.repeats)
    table_schedules(stage_counts, mb_counts, args.repeats)
    table_warmup_timelines([(8, 64), (32, 1024)] if not args.quick else [(8, 64)], args.repeats)
    print(f"\ntotal {time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    main()
