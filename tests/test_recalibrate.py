"""Re-planning with measured costs searches the space the plan was planned in.

``PipelinePlan.recalibrated`` and ``ParallelizedStep.recalibrate`` keep what the plan was
solved with: ``max_stages``, a profiling cost model's stage timer, pinned stages (an
interleaved plan's chunks too), a single-mesh plan's method. Oracle: planning from scratch
with ``parallelize`` on the fitted cluster with the same options. Profiles are synthesised
from known factors (as in ``test_dashboard``), so no run is needed but for the single-mesh path.
"""

from __future__ import annotations

import alpa_lab as al
import pytest
from alpa_lab.cost.profile import Profile, ProfileRow
from alpa_lab.models import tiny_example
from alpa_lab.runtime.monitor import pipeline_parts

LOCAL = al.ClusterSpec.local(hosts=2, devices_per_host=4)
FACTORS = (5.0, 1.0, 0.0)
"""compute x5: on the fitted cluster the unbounded DP of the 4-layer GPT picks 4 stages"""


def synthetic(plan: al.PipelinePlan, a: float, b: float, c: float) -> Profile:
    """A profile whose measurements are exactly a x compute + b x communication + c per launch."""
    cluster = al.ClusterSpec(**plan.cluster)
    rows = []
    for (stage, kind, phase), p in sorted(pipeline_parts(plan).items()):
        if phase not in ("forward", "backward", "apply") or not (p.compute or p.communication):
            continue
        rows.append(ProfileRow(stage, kind, phase, p, p.seconds(cluster), a * p.compute + b * p.communication + c * p.launches, 10))
    return Profile(plan.fingerprint, dict(plan.cluster), tuple(rows), 10, plan.estimated_step_time, 0.0)


@pytest.fixture(scope="module")
def gpt():
    return tiny_example("gpt")


def _gpt_step(ex, cluster: al.ClusterSpec = LOCAL, **options):
    return al.parallelize(ex.train_step, cluster=cluster, microbatches=4, layers=4, **options)


def test_recalibrated_keeps_max_stages(gpt):
    step = _gpt_step(gpt, max_stages=2)
    plan = step.plan(gpt.state, gpt.batch)
    assert plan.max_stages == 2 and plan.num_stages <= 2
    assert al.PipelinePlan.from_json(plan.to_json()).max_stages == 2  # saved with the plan
    prof = synthetic(plan, *FACTORS)
    assert _gpt_step(gpt, prof.cluster()).plan(gpt.state, gpt.batch).num_stages > 2  # the bound matters here
    scratch = _gpt_step(gpt, prof.cluster(), max_stages=2).plan(gpt.state, gpt.batch)
    again = plan.recalibrated(prof)
    assert again.max_stages == 2 and again._current_stages() == scratch._current_stages()
    assert [st.plan for st in again.stages] == [st.plan for st in scratch.stages]
    assert again.estimated_step_time == pytest.approx(scratch.estimated_step_time, rel=1e-12)
    # the step's own re-plan, and a re-plan of the DP's stages after a pin, keep the bound too
    assert step.recalibrate(prof)._current_stages() == scratch._current_stages()
    assert step.cluster.to_dict() == prof.cluster().to_dict()
    assert plan.pin_stages([[0, 0], [1, 1], [2, 2], [3, 3]], [(1, 2)] * 4).unpin_stages().num_stages <= 2


def test_pinned_interleaved_plan_recalibrates(gpt):
    plan = _gpt_step(gpt).plan(gpt.state, gpt.batch).pin_stages([[0, 1], [2, 3]], [(1, 4), (1, 4)])
    inter = plan.with_schedule("interleaved_1f1b")
    assert inter.stage_pins and inter.num_stages == 4 and inter.num_meshes == 2
    prof = synthetic(inter, *FACTORS)
    fresh = inter.recalibrated(prof)
    assert fresh._current_stages() == inter._current_stages()  # the chunks, on the same two meshes
    assert fresh.schedule == "interleaved_1f1b" and fresh.stage_pins and fresh.cluster == prof.cluster().to_dict()
    # planned from scratch on the fitted cluster: the same stages pinned, then interleaved
    scratch = (
        _gpt_step(gpt, prof.cluster()).plan(gpt.state, gpt.batch)
        .pin_stages([[0, 1], [2, 3]], [(1, 4), (1, 4)], [st.logical_shape for st in plan.stages])
        .with_schedule("interleaved_1f1b")
    )
    assert fresh._current_stages() == scratch._current_stages()
    assert [st.plan for st in fresh.stages] == [st.plan for st in scratch.stages]
    assert fresh.estimated_step_time == pytest.approx(scratch.estimated_step_time, rel=1e-12)
    assert fresh.estimated_step_time != pytest.approx(inter.estimated_step_time)


def _fake_timer(problem, stages, schedule) -> dict:
    """A profiling cost model that 'measures' 1 ms x (stage + 1) for every phase."""
    return {(st.index, phase): 1e-3 * (st.index + 1) for st in stages for phase in ("forward", "backward", "apply")}


@pytest.mark.parametrize("pinned", [pytest.param(False, marks=pytest.mark.slow), True])  # True covers more; each ~45 s here
def test_profile_cost_model_keeps_its_stage_timer(gpt, pinned):
    step = _gpt_step(gpt)
    step._stage_timer = lambda split: _fake_timer  # what cost_model="profile" passes, without timing on devices
    plan = step.plan(gpt.state, gpt.batch)
    if pinned:
        plan = plan.pin_stages([[0, 1], [2, 3]], [(1, 4), (1, 4)])
    assert plan.problem.stage_timer is _fake_timer
    assert [st.forward_time for st in plan.stages] == [1e-3 * (i + 1) for i in range(plan.num_stages)]
    again = plan.recalibrated(synthetic(plan, *FACTORS))
    assert again.problem is not plan.problem and again.problem.stage_timer is _fake_timer
    assert [(st.forward_time, st.backward_time) for st in again.stages] == [
        (1e-3 * (i + 1), 1e-3 * (i + 1)) for i in range(again.num_stages)
    ]


def test_single_mesh_recalibrate_keeps_the_plans_method():
    ex = tiny_example("mlp")
    step = al.parallelize(ex.train_step, cluster=al.ClusterSpec.local(1, 4))
    step.plan(ex.state, ex.batch)
    prof = step.train(ex.state, ex.batch, steps=3).wait().profile()
    megatron = al.parallelize(ex.train_step, cluster=al.ClusterSpec.local(1, 4), method="megatron").plan(ex.state, ex.batch)
    step.use(megatron, ex.state, ex.batch)
    new = step.recalibrate(prof)
    assert new.method == "megatron" and step.current_plan is new
    scratch = al.parallelize(ex.train_step, cluster=prof.cluster(), method="megatron").plan(ex.state, ex.batch)
    assert new == scratch and step.cluster.to_dict() == prof.cluster().to_dict()


def test_a_manually_sharded_plan_recalibrates_on_its_mesh():
    """Manual shardings name the axes of the plan's mesh (hosts x devices): re-planning with measured costs keeps
    that mesh and the pins, as planning from scratch on the fitted cluster with the same option does (the other
    mesh shapes the search would try cannot even hold the pins: a 4 x 1 mesh has no columns to split)."""
    from jax.sharding import PartitionSpec as P

    ex = tiny_example("mlp")
    option = al.ManualShardingOption(("data", "model"), in_axis_resources=(al.UNSPECIFIED, P("model")))
    method = al.ShardParallel(manual_sharding_option=option)
    step = al.parallelize(ex.train_step, cluster=al.ClusterSpec.local(1, 4), method=method)
    plan = step.plan(ex.state, ex.batch)
    prof = step.train(ex.state, ex.batch, steps=3).wait().profile()
    new = step.recalibrate(prof)
    assert new.mesh_shape == plan.mesh_shape == (1, 4) and dict(new.pins) == dict(plan.pins)
    scratch = al.parallelize(ex.train_step, cluster=prof.cluster(), method=method).plan(ex.state, ex.batch)
    assert new == scratch
