"""Saving and loading a ``PipelinePlan`` as JSON, and running and editing a loaded one.

The oracle for a loaded plan is the plan it was saved from: loaded into a fresh step of
the same function, it must compute the same numbers (the same stage programs on the same
devices, so rtol 1e-6 is float noise at most) and edit to the same plans (the same ILPs
on the same strategy graphs, solved again).
"""

from __future__ import annotations

import dataclasses
import json

import jax
import numpy as np
import pytest

import alpa_lab as al
from alpa_lab.models import MLPConfig, make_mlp, tiny_example
from alpa_lab import PipelinePlan, Plan, PlanFormatError
from alpa_lab.plan import SCHEMA_VERSION

LOCAL = al.ClusterSpec.local(2, 4)
MICROBATCHES = 4
LAYERS = 4
STEPS = 2


def pipelined(ex, **kw) -> al.ParallelizedStep:
    return al.parallelize(ex.train_step, cluster=LOCAL, microbatches=MICROBATCHES, layers=LAYERS, **kw)


def run(step, ex, steps: int = STEPS):
    state, losses = ex.state, []
    for _ in range(steps):
        state, loss = step(state, ex.batch)
        losses.append(loss)
    return state, losses


def assert_same_numbers(a, b, what: str) -> None:
    (sa, la), (sb, lb) = a, b
    np.testing.assert_allclose(np.asarray(la), np.asarray(lb), rtol=1e-6, err_msg=f"{what}: losses")
    for (path, x), y in zip(jax.tree_util.tree_flatten_with_path(sa)[0], jax.tree_util.tree_leaves(sb), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-6, err_msg=f"{what}: {jax.tree_util.keystr(path)}")


def strict_json(text: str):
    """Parse as plain JSON: NaN and Infinity (which Python's json writes by default) are refused."""

    def refuse(name):
        raise AssertionError(f"not plain JSON: {name}")

    return json.loads(text, parse_constant=refuse)


@pytest.fixture(scope="module")
def edited(tmp_path_factory):
    """A planned MLP step, a plan edited three ways (stages, an op pin, the schedule), saved."""
    ex = tiny_example("mlp")
    step = pipelined(ex)
    base = step.plan(*ex.args)
    staged = base.pin_stages([[0, 1], [2, 3]], submeshes=[(1, 4), (1, 4)])
    st1 = staged.stages[1].plan
    op = next(o for o in st1.ops if o.primitive == "dot_general" and o.num_strategies > 1)
    other = next(a.strategy for a in st1.explain(op.name).alternatives if a.strategy != op.strategy)
    plan = staged.pin(op.name, other).with_schedule("gpipe")
    assert plan.stages[1].plan.op(op.name).strategy == other and plan.stage_pins and plan.schedule == "gpipe"
    path = tmp_path_factory.mktemp("plans") / "pipeline.json"
    plan.save(path)
    step.use(plan)
    reference = run(step, ex)
    return {"ex": ex, "step": step, "plan": plan, "op": op.name, "strategy": other, "path": path, "reference": reference}


# ----- round trip ------------------------------------------------------------------------------
def test_round_trip_is_equal_and_plain_json(edited):
    plan, path = edited["plan"], edited["path"]
    data = strict_json(path.read_text())
    assert data["plan_type"] == "pipeline" and data["schema_version"] == SCHEMA_VERSION
    assert "problem" not in data and all("problem" not in st["plan"] for st in data["stages"])
    loaded = PipelinePlan.load(path)
    assert loaded == plan
    assert PipelinePlan.from_json(plan.to_json()) == plan
    assert loaded.to_json() == plan.to_json()
    assert loaded.problem is None and all(st.plan.problem is None for st in loaded.stages)
    # every field, one by one (equality ignores only the planner state)
    for f in dataclasses.fields(PipelinePlan):
        if f.name != "problem":
            assert getattr(loaded, f.name) == getattr(plan, f.name), f.name
    assert loaded.timeline.records == plan.timeline.records and len(loaded.timeline.records) > 0
    assert loaded.split_inputs == plan.split_inputs and loaded.split_inputs
    assert loaded.stage_pins is True and loaded.schedule == "gpipe"
    assert loaded.pins == plan.pins == ((edited["op"], edited["strategy"]),)
    assert loaded.planning_seconds == plan.planning_seconds and "trace" in loaded.planning_seconds
    assert loaded.estimated_step_time == plan.estimated_step_time and loaded.memory_per_device == plan.memory_per_device
    assert loaded.summary() == plan.summary()
    # equality is not vacuous; and a Plan's planner state is outside equality too
    assert dataclasses.replace(loaded, schedule="1f1b") != plan
    assert dataclasses.replace(loaded, timeline=dataclasses.replace(loaded.timeline, makespan=1.0)) != plan
    assert dataclasses.replace(plan.stages[0].plan, problem=None) == plan.stages[0].plan


def test_a_loaded_plan_cannot_be_edited_before_use(edited):
    loaded = PipelinePlan.load(edited["path"])
    with pytest.raises(PlanFormatError, match=r"step\.use\(plan"):
        loaded.with_schedule("1f1b")
    with pytest.raises(PlanFormatError, match=r"step\.use"):
        loaded.stages[0].plan.pin(edited["op"], edited["strategy"])


# ----- running and editing a loaded plan ---------------------------------------------------------
def test_a_loaded_plan_runs_and_edits_like_the_original(edited):
    ex, plan, op, strategy = edited["ex"], edited["plan"], edited["op"], edited["strategy"]
    fresh = pipelined(ex)
    attached = fresh.use(PipelinePlan.load(edited["path"]), ex.state, ex.batch)
    assert fresh.current_plan is attached and attached == plan
    assert attached.problem is not None and all(st.plan.problem is not None for st in attached.stages)
    assert_same_numbers(run(fresh, ex), edited["reference"], "loaded plan on a fresh step")

    # edits: the same plans as the same edits of the original (a plan's equality leaves out
    # the solver's wall-clock seconds, which differ between two solves)
    assert attached.with_schedule("1f1b") == plan.with_schedule("1f1b")  # no stage re-solved
    assert attached.unpin(op) == plan.unpin(op)
    assert attached.unpin(op).pin(op, strategy) == plan
    assert attached.pin_stages([[0, 2], [3, 3]]) == plan.pin_stages([[0, 2], [3, 3]])
    # unpinned, the stages go where the DP puts them; the op pinned on a 1x4 mesh may have no such strategy there
    assert attached.unpin(op).unpin_stages() == plan.unpin(op).unpin_stages()
    with pytest.raises(al.PinError, match=rf"stage 1 \(layers 2-3\) on a 4x1 logical mesh: op '{op}' has no strategy .*pin_stages"):
        attached.pin_stages([[0, 1], [2, 3]], submeshes=[(1, 4), (1, 4)], logical_shapes=[(1, 4), (4, 1)])
    # an edit re-solves only the stage it touches, as on the original plan
    assert attached.unpin(op).stages[0].plan is attached.stages[0].plan
    # each stage plan has its strategy graph back: explain works and agrees
    assert attached.stages[1].plan.explain(op) == plan.stages[1].plan.explain(op)
    # the step's own edit goes through its current (attached) plan
    assert fresh.pin(op, strategy) == plan


def test_use_without_arguments_attaches_at_the_next_call(edited):
    ex, op = edited["ex"], edited["op"]
    fresh = pipelined(ex)
    loaded = PipelinePlan.load(edited["path"])
    assert fresh.use(loaded) is loaded and fresh.current_plan is loaded
    assert_same_numbers(run(fresh, ex), edited["reference"], "loaded plan attached at the first call")
    current = fresh.current_plan
    assert current == loaded and current.problem is not None
    assert current.unpin(op) == edited["plan"].unpin(op)


# ----- bad input -------------------------------------------------------------------------------
def write(tmp_path, data) -> object:
    path = tmp_path / "bad.json"
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return path


def test_corrupt_and_foreign_json_are_refused(edited, tmp_path):
    text = edited["path"].read_text()
    cases = [
        (text[: len(text) // 2], "not valid JSON"),
        ({"hello": 1}, "not an alpa_lab plan"),
        ({**json.loads(text), "schema_version": 999}, "schema version 999 is not supported"),
        ({**json.loads(text), "plan_type": "tree"}, "not a pipeline plan"),
    ]
    for data, match in cases:
        with pytest.raises(PlanFormatError, match=match):
            PipelinePlan.load(write(tmp_path, data))
    with pytest.raises(PlanFormatError, match="cannot read plan file"):
        PipelinePlan.load(tmp_path / "missing.json")


@pytest.mark.parametrize(
    "edit, match",
    [
        (lambda d: d.pop("timeline"), r"missing or has malformed fields: no 'timeline'"),
        (lambda d: d["stages"][1]["plan"].pop("ops"), r"no 'stages\[1\]\.plan\.ops'"),
        (lambda d: d["timeline"]["records"][3].pop("start"), r"no 'timeline\.records\[3\]\.start'"),
        (lambda d: d["stages"][0].update(forward_time="fast"), r"stages\[0\]\.forward_time: expected a number"),
        (lambda d: d.update(stages=[]), r"stages: expected a non-empty list"),
        (lambda d: d.update(stages=d["stages"][:1]), r"cover layers 0\.\.1 but the plan has 4"),
        (lambda d: d["cluster"].update(hosts="two"), r"cluster"),
        (lambda d: d.update(schedule="pipedream"), r"unknown pipeline schedule"),
    ],
)
def test_missing_and_malformed_fields_are_named(edited, tmp_path, edit, match):
    data = json.loads(edited["path"].read_text())
    edit(data)
    with pytest.raises(PlanFormatError, match=match):
        PipelinePlan.load(write(tmp_path, data))


def test_plan_load_loads_any_plan_and_pipeline_plan_load_names_plan_load_for_a_single_one(edited, tmp_path):
    single = tmp_path / "single.json"
    edited["plan"].stages[0].plan.save(single)  # a stage's plan is a single-mesh Plan
    assert Plan.load(single) == edited["plan"].stages[0].plan
    with pytest.raises(PlanFormatError, match=r"single-mesh Plan, not a pipeline plan: load it with alpa_lab\.Plan\.load"):
        PipelinePlan.load(single)
    loaded = Plan.load(edited["path"])  # al.Plan.load("plan.json"), whatever kind of plan the file holds
    assert isinstance(loaded, PipelinePlan) and loaded == edited["plan"] == PipelinePlan.load(edited["path"])
    assert Plan.from_json(edited["plan"].to_json()) == edited["plan"]


def test_a_pipeline_plan_lists_finds_and_explains_its_ops_as_a_single_plan_does(edited):
    plan, name = edited["plan"], edited["op"]
    assert plan.ops == tuple(o for st in plan.stages for o in st.plan.ops)
    assert {o.name for o in plan.ops if o.kind == "op"} == {o.name for st in plan.stages for o in st.plan.ops if o.kind == "op"}
    stage = plan.stages[plan.stage_of(name)]
    assert plan.op(name) == stage.plan.op(name) and plan.op(name).strategy == edited["strategy"]
    assert plan.explain(name) == stage.plan.explain(name)
    assert any(a.chosen and a.strategy == edited["strategy"] for a in plan.explain(name).alternatives)
    with pytest.raises(al.PinError, match="no op or argument named 'dot_generall_0'"):
        plan.explain("dot_generall_0")
    with pytest.raises(PlanFormatError, match="pipeline plan .* is not one jax.jit program"):
        plan.jit(edited["ex"].train_step)


def test_a_plan_that_does_not_fit_the_step_is_refused_and_the_previous_plan_stays(edited):
    ex, step = edited["ex"], edited["step"]
    previous = step.current_plan
    loaded = PipelinePlan.load(edited["path"])
    other = make_mlp(MLPConfig(batch=16))  # another program: another batch size
    with pytest.raises(PlanFormatError, match="made for another program"):
        step.use(loaded, other.state, other.batch)
    assert step.current_plan is previous
    with pytest.raises(PlanFormatError, match="made for another program"):
        step.use(previous, other.state, other.batch)  # an attached plan is checked the same way
    assert step.current_plan is previous
    with pytest.raises(PlanFormatError, match="4 micro-batches but the step into 2"):
        al.parallelize(ex.train_step, cluster=LOCAL, microbatches=2, layers=LAYERS).use(loaded, *ex.args)
    # a file whose stages do not match the program's (edited by hand)
    data = json.loads(edited["path"].read_text())
    data["stages"][1]["plan"]["fingerprint"] = "0123456789abcdef"
    with pytest.raises(PlanFormatError, match=r"stage 1's plan \(layers 2\.\.3\) belongs to another program"):
        step.use(PipelinePlan.from_json(json.dumps(data)), *ex.args)
    data = json.loads(edited["path"].read_text())
    data["stages"][0]["plan"]["ops"][-1]["strategy"] = "S01 = magic"
    with pytest.raises(PlanFormatError, match=r"stage 0's plan gives .* the strategy 'S01 = magic'"):
        step.use(PipelinePlan.from_json(json.dumps(data)), *ex.args)
    assert step.current_plan is previous
    single_mesh = al.parallelize(ex.train_step, cluster=LOCAL)
    with pytest.raises(PlanFormatError, match="not pipelined"):
        single_mesh.use(loaded)
    assert single_mesh.current_plan is None
    # a single-mesh plan on a pipelined step: refused at use(), not at the next call
    single_plan = single_mesh.plan(*ex.args)
    with pytest.raises(PlanFormatError, match=r"this step is pipelined \(microbatches=4\), so it runs pipeline plans"):
        step.use(single_plan)
    with pytest.raises(TypeError, match="use\\(\\) takes a Plan or a PipelinePlan .* got str"):
        step.use(str(edited["path"]))
    assert step.current_plan is previous
    # diffs across kinds say so (AttributeError once)
    with pytest.raises(PlanFormatError, match="cannot diff a pipeline plan with a Plan"):
        previous.diff(single_plan)
    with pytest.raises(PlanFormatError, match="cannot diff a single-mesh plan with a PipelinePlan"):
        single_plan.diff(previous)
    assert previous.diff(previous).startswith("no changes: the same stages, schedule and op strategies")
    with pytest.raises(ValueError, match="max_stages must be a positive integer"):
        pipelined(ex, max_stages=0)
    # made current without arguments, then called with another program: refused at the call
    fresh = pipelined(ex)
    fresh.use(loaded)
    with pytest.raises(PlanFormatError, match="made for another program"):
        fresh(other.state, other.batch)
    assert fresh.current_plan is loaded
    state, loss = step(ex.state, ex.batch)  # the step still runs its plan
    assert step.current_plan is previous and np.isfinite(float(loss))
