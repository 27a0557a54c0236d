"""Command line: ``alpa-lab demo`` plans and runs an example on the local simulated cluster."""

from __future__ import annotations

import argparse
import sys
import time

import alpa_lab as al  # sets up simulated CPU devices before JAX loads


def parse_cluster(text: str) -> al.ClusterSpec:
    """``--cluster``'s value (``ClusterSpec.parse``); a bad one ends the command with what to write."""
    try:
        return al.ClusterSpec.parse(text)
    except al.ClusterError as exc:
        raise SystemExit(f"bad --cluster {text!r}: {exc}") from None


def demo(args: argparse.Namespace) -> int:
    import jax
    import numpy as np

    from alpa_lab.models import EXAMPLES

    cluster = parse_cluster(args.cluster)
    if cluster.num_devices > len(jax.devices()):
        raise SystemExit(
            f"--cluster {args.cluster} needs {cluster.num_devices} devices, JAX sees {len(jax.devices())}; "
            f"set ALPA_LAB_CPU_DEVICES={cluster.num_devices}"
        )
    names = list(EXAMPLES) if args.model == "all" else [args.model]
    for name in names:
        config_cls, make = EXAMPLES[name]
        ex = make(config_cls())
        pipelined = args.microbatches is not None
        how = f", pipelined: {args.microbatches} micro-batches, {args.schedule}" if pipelined else ""
        print(f"== {name} on {cluster.name} ({cluster.num_devices} simulated devices), method {args.method}{how}")
        if pipelined:
            step = al.parallelize(
                ex.train_step, cluster=cluster, method=args.method, microbatches=args.microbatches,
                schedule=args.schedule, layers=args.layers,
            )
        else:
            step = al.parallelize(ex.train_step, cluster=cluster, method=args.method)
        t0 = time.perf_counter()
        plan = step.plan(*ex.args, progress=lambda msg: print("   ", msg))
        print(f"   planned in {time.perf_counter() - t0:.2f}s")
        print(plan.summary() if pipelined else plan.summary(max_rows=args.rows))
        reference = jax.jit(ex.train_step)
        state, ref_state = ex.state, ex.state
        for i in range(args.steps):
            state, loss = step(state, ex.batch)
            ref_state, ref_loss = reference(ref_state, ex.batch)
            print(f"   step {i}: loss {float(loss):.6f} (unsharded {float(ref_loss):.6f})")
        diffs = [float(np.max(np.abs(np.asarray(a) - np.asarray(b)))) for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(ref_state))]
        print(f"   max |sharded - unsharded| over the state after {args.steps} steps: {max(diffs):.2e}")
        if pipelined:
            if name == "wide_resnet":
                print("   (BatchNorm statistics are per micro-batch, so the pipelined step is not the full-batch step)")
            times = step.compiled(state, ex.batch).last_timings["dispatch_seconds"]
            per_task = ", ".join(f"stage {s} {p} {t * 1e3:.1f} ms" for (s, p), t in times.items())
            print("   last step, host seconds per unit task: " + per_task)
        else:
            print("  ", str(plan.compare_collectives(step.compiled_hlo(state, ex.batch))).replace("\n", "\n   "))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="alpa-lab", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    d = sub.add_parser("demo", help="plan and run an example model on simulated devices, headless")
    d.add_argument("--model", default="all", help="mlp, gpt, bert, moe, wide_resnet or all (default)")
    d.add_argument("--cluster", default="local:1x4", help="local:HxD or PRESET:HOSTS (default local:1x4)")
    d.add_argument("--method", default="alpa", choices=al.METHODS)
    d.add_argument("--steps", type=int, default=3)
    d.add_argument("--rows", type=int, default=12, help="ops shown in each plan summary")
    d.add_argument("--microbatches", type=int, default=None, help="pipeline the step with this many micro-batches")
    d.add_argument("--schedule", default="1f1b", help="pipeline schedule: gpipe, 1f1b, eager_1f1b")
    d.add_argument("--layers", type=int, default=None, help="layers the automatic layering cuts the step into")
    args = parser.parse_args(argv)
    if args.command == "demo":
        return demo(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
