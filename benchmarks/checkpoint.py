"""Saving and restoring a pipelined state where its plan keeps it, against gathering it to the host, in one run.

A GPT (``--layers`` blocks of width ``--hidden``, Adam state) is planned as 2 stages on 1x4 sub-meshes of
this process's 8 simulated devices; its state is placed as the plan places it (``CreateStateParallel``).
Rounds alternate, on the same state:

- ours: ``save_checkpoint`` (each shard written from its device by Orbax) and ``restore_checkpoint``
  with the step's placement specs (each shard read straight onto its stage's devices);
- baseline: every leaf gathered to the host and written with ``numpy.savez``, then read with
  ``numpy.load`` and put back with ``jax.device_put`` on the plan's shardings (what one writes by hand
  without a checkpointer).

It prints the median seconds of each and their ratio (this 2-core machine is noisy: medians of
``--rounds``), and checks that both restore the same values.

    python benchmarks/checkpoint.py [--layers 4] [--hidden 256] [--rounds 5]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import alpa_lab as al  # first: it gives this process simulated CPU devices  # isort: skip
import jax
import numpy as np

from alpa_lab.models import gpt_config, make_gpt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    ex = make_gpt(gpt_config(layers=args.layers, hidden=args.hidden, heads=4, seq_len=32, vocab=512, batch=8))
    step = al.parallelize(ex.train_step, microbatches=4, layers=4)
    step.use(step.plan(*ex.args).pin_stages([[0, 1], [2, 3]], submeshes=[(1, 4), (1, 4)]))
    shardings = step.current_plan.shardings(*ex.args)[0][0]
    state = jax.tree_util.tree_map(jax.device_put, ex.state, shardings)
    specs = step.get_executable(*ex.args).get_input_placement_specs()[0]
    nbytes = sum(x.nbytes for x in jax.tree_util.tree_leaves(state))
    print(f"state: {len(jax.tree_util.tree_leaves(state))} arrays, {nbytes / 2**20:.1f} MiB, on 2 meshes of 4 devices")
    ours, base = [], []
    folder = Path(tempfile.mkdtemp(prefix="alpa_lab_ckpt_"))
    try:
        for r in range(args.rounds):
            t0 = time.perf_counter()
            al.save_checkpoint(folder / "ours", state, r)
            restored = al.restore_checkpoint(folder / "ours", r, specs)
            jax.block_until_ready(restored)
            ours.append(time.perf_counter() - t0)

            t0 = time.perf_counter()
            leaves, tree = jax.tree_util.tree_flatten(state)
            np.savez(folder / f"base{r}.npz", *[np.asarray(x) for x in leaves])
            with np.load(folder / f"base{r}.npz") as f:
                loaded = [f[f"arr_{i}"] for i in range(len(leaves))]
            back = jax.tree_util.tree_unflatten(tree, [jax.device_put(x, s) for x, s in zip(loaded, jax.tree_util.tree_leaves(shardings))])
            jax.block_until_ready(back)
            base.append(time.perf_counter() - t0)
            pairs = zip(jax.tree_util.tree_leaves(restored), jax.tree_util.tree_leaves(back))
            assert all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in pairs), "the two restores differ"
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    mo, mb = statistics.median(ours), statistics.median(base)
    print(f"save + restore, median of {args.rounds}: ours {mo * 1e3:.0f} ms, gather + numpy baseline {mb * 1e3:.0f} ms "
          f"(ours / baseline {mo / mb:.2f}); both restored the same values")


if __name__ == "__main__":
    main()
