"""Runtime overhead of applying a plan, on the local simulated devices.

For each example model it measures, in one run: compile time and median step time of the
planned program (every op constrained to its planned sharding, on a 2x2 mesh of simulated
CPU devices) against the baseline of ``jax.jit(train_step)`` on one device. Simulated
devices share this machine's cores, so the step-time ratio shows the cost of the sharded
program's extra work (collectives, constraints), not a real speed-up; on a real cluster the
devices run in parallel.

With ``--pipeline`` it also runs each model pipelined on 2 hosts x 4 simulated devices
(2 stages on 1x4 sub-meshes, 4 micro-batches, each schedule; interleaved: 2 chunks per mesh) against, in the same run, the
single-mesh plan on all 8 devices and ``jax.jit`` on one device.

With ``--inference`` it also runs each model's loss without gradients (an evaluation) as an inference
pipeline (``schedule="inference"``: the same 2 stages on 1x4 sub-meshes, 4 micro-batches) against, in the
same run, the single-mesh plan of the evaluation on all 8 devices and ``jax.jit`` on one device (results
checked equal).

With ``--data-loader`` it also trains each model data-parallel on all 8 devices for ``steps`` steps on distinct
batches, fed as host arrays (the baseline) and through ``al.DataLoader`` (2 batches put on the devices ahead),
in the same run (the same final parameters checked).

    python benchmarks/runtime.py [--models mlp,gpt,moe] [--steps 10] [--mesh 2x2] [--pipeline] [--inference] [--data-loader]
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
    parser.add_argument("--pipeline", action="store_true", help="also run the pipelined rows (needs 8 devices)")
    parser.add_argument("--inference", action="store_true", help="also run the inference pipeline rows (needs 8 devices)")
    parser.add_argument("--data-loader", action="store_true", help="also time steps fed by al.DataLoader against host batches")
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
    if args.pipeline:
        pipeline_rows(args.models.split(","), args.steps)
    if args.inference:
        inference_rows(args.models.split(","), args.steps)
    if args.data_loader:
        data_loader_rows(args.models.split(","), args.steps)


def pipeline_rows(models: list[str], steps: int) -> None:
    cluster = al.ClusterSpec.local(2, 4)
    print(f"\npipelined on {cluster.name}: 2 stages (1x4 sub-meshes), 4 micro-batches; baselines: the single-mesh plan "
          f"on the same 8 devices and jax.jit on one device; medians of {steps} steps")
    print(f"{'model':<12} {'schedule':<16} {'plan s':>7} {'compile s':>9} | {'step ms':>8} {'1 mesh':>8} {'jit':>8} | "
          f"{'vs 1 mesh':>9} {'vs jit':>7}")
    for name in models:
        config_cls, make = EXAMPLES[name]
        ex = make(config_cls())
        flat = al.parallelize(ex.train_step, cluster=cluster, mesh_shape=(2, 4))
        flat.plan(*ex.args)
        _, flat_s = timed_steps(flat, ex.state, ex.batch, steps)
        _, jit_s = timed_steps(jax.jit(ex.train_step), ex.state, ex.batch, steps)
        step = al.parallelize(ex.train_step, cluster=cluster, microbatches=4, layers=4)
        t0 = time.perf_counter()
        base = step.plan(*ex.args).pin_stages([[0, 1], [2, 3]])
        plan_s = time.perf_counter() - t0
        for schedule in ("gpipe", "1f1b", "eager_1f1b", "zb_h1", "interleaved_1f1b"):  # interleaved: 2 chunks per mesh
            step.use(base.with_schedule(schedule))
            first, step_s = timed_steps(step, ex.state, ex.batch, steps)
            print(f"{name:<12} {schedule:<16} {plan_s:>7.2f} {first:>9.2f} | {step_s * 1e3:>8.2f} {flat_s * 1e3:>8.2f} "
                  f"{jit_s * 1e3:>8.2f} | {step_s / flat_s:>9.2f} {step_s / jit_s:>7.2f}", flush=True)


def timed_calls(fn, args: tuple, steps: int) -> tuple[float, float, object]:
    """(seconds of the first call, which compiles; median seconds of the next ``steps``; the result)."""
    t0 = time.perf_counter()
    out = jax.block_until_ready(fn(*args))
    first = time.perf_counter() - t0
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        out = jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return first, statistics.median(times), out


def inference_rows(models: list[str], steps: int) -> None:
    cluster = al.ClusterSpec.local(2, 4)
    print(f"\ninference pipeline on {cluster.name}: each model's loss without gradients, 2 stages (1x4 sub-meshes), "
          f"4 micro-batches; baselines: the single-mesh plan on the same 8 devices and jax.jit on one device; medians "
          f"of {steps} calls")
    print(f"{'model':<12} {'plan s':>7} {'compile s':>9} | {'call ms':>8} {'1 mesh':>8} {'jit':>8} | {'vs 1 mesh':>9} {'vs jit':>7}")
    for name in models:
        config_cls, make = EXAMPLES[name]
        ex = make(config_cls())
        model_state = ex.state.model_state

        def evaluate(params, batch, ex=ex, model_state=model_state):
            return ex.loss_fn(params, model_state, batch)[0]

        args = (ex.state.params, ex.batch)
        flat = al.parallelize(evaluate, cluster=cluster, mesh_shape=(2, 4))
        flat.plan(*args)
        _, flat_s, flat_out = timed_calls(flat, args, steps)
        _, jit_s, jit_out = timed_calls(jax.jit(evaluate), args, steps)
        step = al.parallelize(evaluate, cluster=cluster, microbatches=4, layers=4, schedule="inference", batch_argnums=(1,))
        t0 = time.perf_counter()
        step.use(step.plan(*args).pin_stages([[0, 1], [2, 3]], submeshes=[(1, 4), (1, 4)]))
        plan_s = time.perf_counter() - t0
        first, step_s, out = timed_calls(step, args, steps)
        # BatchNorm in training mode normalises each micro-batch by its own statistics: not the full batch's
        check = "" if name == "wide_resnet" else f"  (|pipeline - jit| {abs(float(out) - float(jit_out)):.1e})"
        print(f"{name:<12} {plan_s:>7.2f} {first:>9.2f} | {step_s * 1e3:>8.2f} {flat_s * 1e3:>8.2f} {jit_s * 1e3:>8.2f} | "
              f"{step_s / flat_s:>9.2f} {step_s / jit_s:>7.2f}{check}", flush=True)
        del flat_out


def data_loader_rows(models: list[str], steps: int) -> None:
    import numpy as np

    print(f"\nsteps fed by al.DataLoader (prefetch 2) vs host batches, DataParallel on 8 devices, {steps} distinct batches; "
          "medians of 3 rounds of the whole loop")
    print(f"{'model':<12} {'loader ms/step':>14} {'host ms/step':>12} {'ratio':>6}")
    for name in models:
        config_cls, make = EXAMPLES[name]
        ex = make(config_cls())
        rng = np.random.default_rng(0)
        batches = []
        for _ in range(steps):  # distinct batches of the example's shapes (integer leaves: its own values)
            batches.append(jax.tree_util.tree_map(
                lambda x: rng.standard_normal(x.shape).astype(x.dtype) if np.issubdtype(x.dtype, np.floating) else np.asarray(x),
                ex.batch))
        step = al.parallelize(ex.train_step, method=al.DataParallel())
        specs = step.get_executable(ex.state, batches[0]).get_input_placement_specs()[1]

        def loop(feed):
            state = ex.state
            t0 = time.perf_counter()
            for batch in feed():
                state, loss = step(state, batch)
            jax.block_until_ready(state)
            return (time.perf_counter() - t0) / steps, state

        loop(lambda: batches)  # compiled, warm
        rounds = [(loop(lambda: al.DataLoader(batches, specs, prefetch_size=2)), loop(lambda: batches)) for _ in range(3)]
        ours = statistics.median(r[0][0] for r in rounds)
        base = statistics.median(r[1][0] for r in rounds)
        same = all(bool(np.array_equal(np.asarray(a), np.asarray(b))) for a, b in zip(
            jax.tree_util.tree_leaves(rounds[0][0][1]), jax.tree_util.tree_leaves(rounds[0][1][1])))
        print(f"{name:<12} {ours * 1e3:>14.2f} {base * 1e3:>12.2f} {ours / base:>6.2f}  (same parameters: {same})", flush=True)


if __name__ == "__main__":
    main()
