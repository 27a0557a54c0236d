"""Alpa's ``AutoShardingOption(allow_all_gather=False, allow_all_to_all=False)``: plans without those collectives.

Alpa's MoE tests (``test_moe_layer_2d``) and its OPT serving code set them; the mesh then prices the forbidden
kinds infinitely (``LogicalMesh.forbidden``), so the ILP picks strategies and reshardings without them, or says
none exist. Oracles: the collectives XLA compiled (``count_hlo_collectives``), the same step planned without the
options (which does use them, so each check can fail), ``jax.jit`` of the unparallelized step for numerics, and
the plan's own saved JSON.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

import alpa_lab as al
from alpa_lab.cost.cluster import ClusterSpec
from alpa_lab.models import tiny_example
from alpa_lab.plan import PinError, count_hlo_collectives


def _shard_parallel(**flags) -> al.ShardParallel:
    return al.ShardParallel(devices=jax.devices()[:4], auto_sharding_option=al.AutoShardingOption(**flags))


def _kinds(plan) -> set[str]:
    return {k for k, n in plan.predicted_collectives().items() if n}


def test_the_moe_plans_and_compiles_without_all_gathers_or_all_to_alls():
    ex = tiny_example("moe")
    plans, hlo = {}, {}
    for key, flags in (("free", {}), ("no all-gather", {"allow_all_gather": False}),
                       ("neither", {"allow_all_gather": False, "allow_all_to_all": False})):
        step = al.parallelize(ex.train_step, method=_shard_parallel(**flags))
        hlo[key] = count_hlo_collectives(step.get_executable(*ex.args).get_hlo_text())
        plans[key] = step.current_plan
        if key == "neither":  # numerics: the restricted plan still computes the step (float32 sums in another order)
            state, loss = step(ex.state, ex.batch)
            want_state, want_loss = jax.jit(ex.train_step)(ex.state, ex.batch)
            np.testing.assert_allclose(float(loss), float(want_loss), rtol=1e-5)
            for a, b in zip(jax.tree_util.tree_leaves(state), jax.tree_util.tree_leaves(want_state)):
                np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=5e-5)
    # unrestricted, the ILP's cheapest plan gathers (so the checks below can fail)
    assert "all-gather" in _kinds(plans["free"]) and hlo["free"].get("all-gather", 0) > 0, (plans["free"], hlo["free"])
    assert plans["free"].forbidden_collectives == ()
    assert "all-gather" not in _kinds(plans["no all-gather"]) and not hlo["no all-gather"].get("all-gather")
    assert plans["no all-gather"].forbidden_collectives == ("all-gather",)
    assert _kinds(plans["neither"]) <= {"all-reduce", "reduce-scatter"}
    assert {k for k, n in hlo["neither"].items() if n} <= {"all-reduce", "reduce-scatter"}, hlo["neither"]
    # a restriction cannot make the optimum cheaper
    assert plans["free"].objective <= plans["no all-gather"].objective * (1 + 1e-9)
    assert plans["no all-gather"].objective <= plans["neither"].objective * (1 + 1e-9)


def test_a_loaded_plan_is_re_solved_with_its_restriction():
    """The restriction is saved with the plan: a step without the option that uses it re-solves (a pin) without
    all-gathers too, and a pin that would need one is refused, saying why."""
    ex = tiny_example("moe")
    step = al.parallelize(ex.train_step, method=_shard_parallel(allow_all_gather=False))
    plan = step.plan(*ex.args)
    loaded = al.Plan.from_json(plan.to_json())
    assert loaded.forbidden_collectives == ("all-gather",) and loaded == plan
    plain = al.parallelize(ex.train_step, cluster=ClusterSpec.local(1, 4))
    plain.use(loaded, *ex.args)
    op = next(o for o in loaded.ops if o.kind == "op" and o.name.startswith("dot_general"))
    repinned = plain.pin(op.name, op.strategy)
    assert repinned.forbidden_collectives == ("all-gather",) and "all-gather" not in _kinds(repinned)
    assert repinned.objective == pytest.approx(plan.objective, rel=1e-9)
    # the explanation of an op names the alternatives that would need an all-gather, not an infinite cost
    text = next(str(e) for e in (repinned.explain(o.name) for o in repinned.ops if o.kind == "op")
                if any(not np.isfinite(a.total) for a in e.alternatives))
    assert "forbidden" in text and "inf" not in text.replace("info", ""), text


def test_pins_and_programs_that_need_a_forbidden_collective_are_refused_by_name():
    def matmul(x, w):
        return jax.numpy.tanh(x @ w)

    x, w = np.ones((16, 32), np.float32), np.ones((32, 64), np.float32)
    step = al.parallelize(matmul, method=_shard_parallel(allow_all_gather=False))
    plan = step.plan(x, w)
    # rows of x split, then a matmul that reads x whole: only an all-gather joins them
    with pytest.raises(PinError, match=r"cannot hold together without all-gather .*AutoShardingOption forbids it"):
        plan.pin("[0]", "S1R").pin("dot_general_0", "RS1 = RR x RS1")
    assert step.current_plan == plan  # the failed re-solve kept the plan

    def sort_rows(w, x):  # a sort along the batch, which stays split over mesh axis 0
        return w, jax.numpy.sum(jax.numpy.sort(x @ w, axis=0)[:2])

    option = al.AutoShardingOption(force_batch_dim_to_mesh_dim=0, allow_all_gather=False, allow_all_to_all=False)
    forced = al.parallelize(sort_rows, method=al.ShardParallel(devices=jax.devices()[:4], auto_sharding_option=option),
                            batch_argnums=(1,))
    with pytest.raises(al.MethodError, match=r"no plan avoids all-gather and all-to-all.*allow_all_gather=True"):
        forced.plan(np.ones((8, 8), np.float32), np.ones((16, 8), np.float32))


def test_options_that_forbid_collectives():
    assert al.AutoShardingOption(allow_all_gather=False).forbidden_collectives() == ("all-gather",)
    assert al.AutoShardingOption(allow_all_to_all=False, allow_all_gather=False).forbidden_collectives() == (
        "all-gather", "all-to-all")
    # Alpa's force_data_parallel lifts both: the data-parallel layout needs none of them anyway
    assert al.AutoShardingOption(allow_all_gather=False, force_data_parallel=True).forbidden_collectives() == ()
    assert "forbidden" not in al.ShardParallel().options()
    assert al.ShardParallel(auto_sharding_option=al.AutoShardingOption(allow_all_to_all=False)).options()["forbidden"] == (
        "all-to-all",)
    with pytest.raises(ValueError, match="cannot forbid"):
        ClusterSpec.local(1, 4).logical_mesh().__class__((1, 4), (0, 1, 2, 3), (0, 0), (0, 0), forbidden=("broadcast",))


def test_every_stage_of_a_pipeline_is_planned_without_them():
    """``PipeshardParallel(default_auto_sharding_option=...)``, as Alpa's OPT serving sets it: each stage's plan (the
    DP's pricing included) avoids the forbidden collectives, and the saved plan keeps them forbidden per stage."""
    ex = tiny_example("moe")

    def pipelined(**flags):
        method = al.PipeshardParallel(
            num_micro_batches=2, layer_option=al.AutoLayerOption(layer_num=2),
            default_auto_sharding_option=al.AutoShardingOption(**flags))
        step = al.parallelize(ex.train_step, method=method)
        return step, step.plan(*ex.args)

    _, free = pipelined()
    step, plan = pipelined(allow_all_gather=False, allow_all_to_all=False)
    assert all(st.plan.forbidden_collectives == ("all-gather", "all-to-all") for st in plan.stages)
    assert all(_kinds(st.plan) <= {"all-reduce", "reduce-scatter"} for st in plan.stages), [_kinds(st.plan) for st in plan.stages]
    assert all(st.plan.forbidden_collectives == () for st in free.stages)
    assert any("all-gather" in _kinds(st.plan) for st in free.stages)  # unrestricted, a stage gathers
    loaded = al.Plan.from_json(plan.to_json())
    assert [st.plan.forbidden_collectives for st in loaded.stages] == [st.plan.forbidden_collectives for st in plan.stages]
    state, loss = step(ex.state, ex.batch)
    _, want = jax.jit(ex.train_step)(ex.state, ex.batch)
    np.testing.assert_allclose(float(loss), float(want), rtol=1e-5)
