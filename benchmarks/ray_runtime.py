"""The Ray runtime against the in-process runtime, on the same plan and simulated devices, in one run.

For the tiny MLP and GPT pipelines (2 stages on 1x4 sub-meshes of a local 2 x 4 cluster,
4 micro-batches, 1F1B) it prints: median step time on Ray and in-process (the in-process
runtime has no process boundary to cross; target: Ray within 1.5x), driver messages per step
(one ``run_step`` per worker), time to launch and its parts (start Ray, compile + export the
stage programs, start and place the workers, load programs and state), and the bytes moved
per step as measured by senders and receivers against the plan's unit tasks.

``--transport`` adds the CPU transport's throughput between two workers (the mesh workers'
path: the sender ``ray.put``s, the receiver gets the object ref in a method call) for 1, 16
and 128 MiB, against a plain ``ray.get`` of a numpy array of the same size put by the other
actor (both timed in the sender, the put included).

    python benchmarks/ray_runtime.py [--models mlp,gpt] [--steps 20] [--transport]
"""

from __future__ import annotations

import argparse
import statistics
import time

import alpa_lab as al  # first: it gives this process simulated CPU devices  # isort: skip
import jax
import numpy as np
from alpa_lab.models import tiny_example


def median_step(fn, steps: int) -> float:
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def bench_model(name: str, cluster: al.RayCluster, steps: int) -> None:
    ex = tiny_example(name)
    step = al.parallelize(ex.train_step, cluster=cluster.spec, microbatches=4, layers=4, schedule="1f1b")
    plan = step.plan(*ex.args).pin_stages([[0, 1], [2, 3]], submeshes=[(1, 4), (1, 4)])
    step.use(plan)
    state = ex.state
    state, _ = step(state, ex.batch)  # compile the in-process runtime first (the launch reuses it)

    def in_process():
        nonlocal state
        state, loss = step(state, ex.batch)
        return loss

    local = median_step(in_process, steps)
    t0 = time.perf_counter()
    run = step.launch(cluster, ex.state, keep_state_every=0)
    launch = time.perf_counter() - t0
    try:
        run.step(ex.batch)  # first step: jit of the deserialised programs on the workers
        on_ray = median_step(lambda: run.step(ex.batch), steps)
        measured = run.bytes_per_step(-1)
        predicted = run.predicted_bytes()
    finally:
        run.close()
    parts = ", ".join(f"{k} {v:.2f}s" for k, v in run.launch_seconds.items() if k != "total")
    print(f"{name:5s} step: Ray {on_ray * 1e3:7.1f} ms | in-process {local * 1e3:7.1f} ms | ratio {on_ray / local:5.2f}x (target <= 1.5x)")
    print(f"      driver messages per step: {len(run.workers)} (one per worker, {len(run.workers)} workers)")
    print(f"      launch {launch:.2f}s ({parts})")
    total_sent = sum(measured["sent"].values())
    total_recv = sum(measured["received"].values())
    print(
        f"      bytes per step: sent {total_sent} / received {total_recv} / predicted {sum(predicted.values())} "
        f"({'equal' if measured['sent'] == predicted == measured['received'] else 'DIFFERENT'}) per pair {predicted}"
    )


def bench_transport(sizes_mib=(1, 16, 128), repeats: int = 5) -> None:
    import ray

    from alpa_lab.runtime.mesh_worker import INLINE_BYTES, MeshWorker

    @ray.remote(num_cpus=0)
    class Peer(MeshWorker):
        def send_to(self, other, nbytes: int, plain: bool) -> float:
            x = np.ones(nbytes // 4, np.float32)
            t0 = time.perf_counter()
            if plain:  # baseline: put the array, the other actor ray.get()s it by reference
                ray.get(other.get.remote([ray.put(x)]))
            else:  # the mesh workers' path: MeshWorker.receive itself, as a send calls it
                parts = [(0, x if x.nbytes <= INLINE_BYTES else ray.put(x))]  # one region, the whole tensor, as a send makes it
                ray.get(other.receive.remote(0, 0, 0, parts, 1, 0.0, 0))
            return time.perf_counter() - t0

        def get(self, refs) -> int:
            return int(ray.get(refs[0]).nbytes)

    a, b = Peer.remote(0, 0, 1), Peer.remote(1, 0, 1)
    ray.get(a.send_to.remote(b, 1 << 20, False))  # first contact between the two
    for mib in sizes_mib:
        n = mib << 20
        ours = statistics.median(ray.get(a.send_to.remote(b, n, False)) for _ in range(repeats))
        plain = statistics.median(ray.get(a.send_to.remote(b, n, True)) for _ in range(repeats))
        print(
            f"transport {mib:4d} MiB: worker->worker {ours * 1e3:7.1f} ms ({mib / 1024 / ours:6.2f} GiB/s) | "
            f"put + plain ray.get {plain * 1e3:7.1f} ms | ratio {ours / plain:5.2f}x"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="mlp,gpt")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--transport", action="store_true")
    args = ap.parse_args()
    t0 = time.perf_counter()
    cluster = al.RayCluster.local(2, 4)
    print(f"start a local Ray (2 hosts x 4 simulated devices): {time.perf_counter() - t0:.2f}s")
    try:
        for name in args.models.split(","):
            bench_model(name, cluster, args.steps)
        if args.transport:
            bench_transport()
    finally:
        cluster.shutdown()


if __name__ == "__main__":
    main()
