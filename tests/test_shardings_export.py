"""A plan taken to code without alpa_lab's runtime (issue 11 part 6): ``Plan.shardings``, ``Plan.jit``.

A fresh Python process that never imports ``alpa_lab.runtime`` (checked in ``sys.modules``)
loads a saved plan JSON, gets the argument/result ``NamedSharding`` pytrees and runs the
step exported with plain ``jax.jit``. References: the unsharded ``jax.jit(step)`` for the
numbers (rtol 1e-5), and our runtime's ``step.compiled_hlo`` of the same plan for the
collectives XLA compiled (all-reduce, all-gather, reduce-scatter, all-to-all: the same
counts). The step is an SGD step on the example models' losses: Adam divides each gradient
element by its own scale, which turns a summation-order difference in a near-zero
gradient into an update difference of up to the learning rate, so rtol 1e-5 could not hold.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import alpa_lab as al

COLLECTIVES = ("all-reduce(", "all-gather(", "reduce-scatter(", "all-to-all(")

# The step, as a module both processes import (the same function: the same program).
STEP = textwrap.dedent(
    """
    import jax
    from alpa_lab.models import tiny_example

    def example(name):
        ex = tiny_example(name)

        def train_step(params, model_state, batch):
            (loss, model_state), grads = jax.value_and_grad(ex.loss_fn, has_aux=True)(params, model_state, batch)
            return jax.tree_util.tree_map(lambda p, g: p - 0.1 * g, params, grads), model_state, loss

        return train_step, (ex.state.params, ex.state.model_state, ex.batch)
    """
)

# Runs in a fresh process: argv = plan JSON, model name, output prefix.
EXPORTED = textwrap.dedent(
    """
    import json, os, sys
    import jax
    import numpy as np
    from alpa_lab.plan import Plan

    plan_path, name, out = sys.argv[1:]
    sys.path.insert(0, os.path.dirname(plan_path))
    from sgd_step import example

    train_step, args = example(name)
    plan = Plan.load(plan_path)
    in_s, out_s = plan.shardings(*args, results=jax.eval_shape(train_step, *args))
    step = plan.jit(train_step)
    result = step(*args)
    hlo = step.lower(*args).compile().as_text()
    # the shardings alone, with the ops left to XLA: the state lands where the plan keeps it
    plain = jax.jit(train_step, in_shardings=in_s, out_shardings=out_s)(*args)
    leaves = jax.tree_util.tree_leaves(result)
    np.savez(out + ".npz", *[np.asarray(x) for x in leaves], *[np.asarray(x) for x in jax.tree_util.tree_leaves(plain)])
    same = jax.tree_util.tree_leaves(jax.tree_util.tree_map(lambda a, b: a == b, step.shardings(*args), (in_s, out_s)))
    placed = [x.sharding.is_equivalent_to(s, x.ndim) for x, s in zip(leaves, jax.tree_util.tree_leaves(out_s))]
    placed += [x.sharding.is_equivalent_to(s, x.ndim) for x, s in zip(jax.tree_util.tree_leaves(plain), jax.tree_util.tree_leaves(out_s))]
    json.dump({
        "hlo": hlo,
        "leaves": len(leaves),
        "runtime_modules": sorted(m for m in sys.modules if m.startswith("alpa_lab.runtime") or m == "alpa_lab.api"),
        "same_shardings": all(same),
        "placed": all(placed),
    }, open(out + ".json", "w"))
    """
)


def collectives(hlo: str) -> dict[str, int]:
    return {c: hlo.count(c) for c in COLLECTIVES}


@pytest.fixture(scope="module")
def planned(tmp_path_factory):
    """Per model: (directory with the step module, step, args, our parallelized step, its 2x4 plan)."""
    where = tmp_path_factory.mktemp("export")
    (where / "sgd_step.py").write_text(STEP)
    spec = importlib.util.spec_from_file_location("sgd_step_under_test", where / "sgd_step.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out = {}
    for name in ("mlp", "gpt"):
        fn, args = module.example(name)
        step = al.parallelize(fn, cluster=al.ClusterSpec.local(hosts=2, devices_per_host=4), mesh_shape=(2, 4))
        out[name] = (where, fn, args, step, step.plan(*args))
    return out


@pytest.mark.parametrize("name", ["mlp", "gpt"])
def test_exported_step_runs_without_the_runtime(name, planned):
    where, fn, args, step, plan = planned[name]
    path = where / f"{name}.json"
    plan.save(path)
    script = where / "exported.py"
    script.write_text(EXPORTED)
    out = where / f"{name}_out"
    done = subprocess.run([sys.executable, str(script), str(path), name, str(out)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-4000:]
    report = json.loads(out.with_suffix(".json").read_text())
    assert report["runtime_modules"] == []
    assert report["same_shardings"] and report["placed"]
    # the numbers of the unsharded step, and of our runtime (the same program)
    want = jax.tree_util.tree_leaves(jax.jit(fn)(*args))
    ours = jax.tree_util.tree_leaves(step(*args))
    got = np.load(out.with_suffix(".npz"))
    n = report["leaves"]
    assert n == len(want) and len(got.files) == 2 * n
    for k, w in enumerate(want):
        for route, i in (("exported", k), ("shardings only", n + k)):
            np.testing.assert_allclose(got[f"arr_{i}"], np.asarray(w), rtol=1e-5, atol=1e-6, err_msg=f"{route} leaf {k}")
        np.testing.assert_allclose(got[f"arr_{k}"], np.asarray(ours[k]), rtol=1e-6, atol=1e-7, err_msg=f"leaf {k} vs runtime")
    # the collectives our runtime compiles for the same plan
    counts = collectives(step.compiled_hlo(*args))
    assert sum(counts.values()) > 0  # a plan that communicates: the comparison means something
    assert collectives(report["hlo"]) == counts


def test_shardings_follow_the_plan(planned):
    _, fn, args, _, plan = planned["mlp"]
    in_s, out_s = plan.shardings(*args)
    assert jax.tree_util.tree_structure(in_s) == jax.tree_util.tree_structure(args)
    assert isinstance(out_s, tuple) and len(out_s) == len(plan.outputs)  # no results given: flat, in order
    mesh = plan.mesh()
    assert mesh.devices.shape == plan.mesh_shape and mesh.axis_names == ("x", "y")
    assert [d.id for d in mesh.devices.flat] == list(plan.device_ids)
    for s, t in zip(jax.tree_util.tree_leaves(in_s), plan.inputs):
        assert s.mesh == mesh
        assert s.spec == al.ShardingSpec.parse(t.spec).to_partition_spec()
    # on given devices (the same logical mesh, other physical order)
    devices = jax.devices()[::-1]
    in_r, _ = plan.shardings(*args, devices=devices)
    assert [d.id for d in jax.tree_util.tree_leaves(in_r)[0].mesh.devices.flat] == [devices[i].id for i in plan.device_ids]
    # ShapeDtypeStructs do as well as arrays
    shapes = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), args)
    assert plan.shardings(*shapes)[0] == in_s
    # with the results, the result shardings take their structure
    results = jax.eval_shape(fn, *args)
    _, out_tree = plan.shardings(*args, results=results)
    assert jax.tree_util.tree_structure(out_tree) == jax.tree_util.tree_structure(results)


def test_bad_input_is_refused_clearly(planned):
    _, fn, args, _, plan = planned["mlp"]
    params, model_state, batch = args
    with pytest.raises(ValueError, match=r"arrays but \d+ were given"):
        plan.shardings(params, model_state)
    bigger = jax.tree_util.tree_map(lambda x: jnp.concatenate([x, x]), batch)
    with pytest.raises(ValueError, match=r"has shape \[16, .*but the plan was made for \[8,"):
        plan.shardings(params, model_state, bigger)
    with pytest.raises(ValueError, match="result arrays"):
        plan.shardings(*args, results=(1.0,))
    with pytest.raises(ValueError, match="belongs to another program"):
        plan.jit(fn)(params, model_state, bigger)
    few = jax.devices()[:4]
    with pytest.raises(al.DeviceError, match="JAX sees 4"):
        plan.shardings(*args, devices=few)


def test_a_pipeline_plan_gives_each_leaf_its_stage_sharding():
    """Where the pipeline runtime leaves each result (checked on its output), and arguments with them."""
    from alpa_lab.models import tiny_example

    ex = tiny_example("mlp")
    step = al.parallelize(ex.train_step, cluster=al.ClusterSpec.local(hosts=2, devices_per_host=4), microbatches=4, layers=4)
    plan = step.use(step.plan(*ex.args).pin_stages([[0, 1], [2, 3]]))
    results = jax.eval_shape(ex.train_step, *ex.args)
    in_s, out_s = plan.shardings(*ex.args, results=results)
    assert jax.tree_util.tree_structure(in_s) == jax.tree_util.tree_structure(ex.args)
    got = step(*ex.args)
    for (path, x), s in zip(jax.tree_util.tree_flatten_with_path(got)[0], jax.tree_util.tree_leaves(out_s)):
        assert x.sharding.is_equivalent_to(s, x.ndim), jax.tree_util.keystr(path)
    # the state goes back in where it came out: each weight on its stage's sub-mesh
    meshes = {tuple(d.id for d in s.mesh.devices.flat) for s in jax.tree_util.tree_leaves(in_s[0].params)}
    assert meshes == {st.device_ids for st in plan.stages}
    for a, b in zip(jax.tree_util.tree_leaves(in_s[0]), jax.tree_util.tree_leaves(out_s[0])):
        assert a.mesh == b.mesh
    # without results: by result path
    _, by_path = plan.shardings(*ex.args)
    assert set(by_path) == {jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(results)[0]}
    with pytest.raises(ValueError, match="no stage of this pipeline plan computes a result"):
        plan.shardings(*ex.args, results={"other": 1.0})
    with pytest.raises(ValueError, match="none of the arguments given is one this pipeline plan's stages read"):
        plan.shardings({"other": jnp.ones(3)})
