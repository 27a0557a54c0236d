"""The workbench's views and widget (issue 4), checked for content, without a browser.

Oracles: JAX's own ``devices_indices_map`` for the heatmap tiles, the schedule's instruction
lists for the timeline bars, the cross-mesh unit tasks for the traffic matrix, and the plan's
own ``pin``/``with_schedule``/``pin_stages`` for edits made through the widget's controls.
"""

from __future__ import annotations

import dataclasses
import html
import json
import threading

import ipywidgets.widgets.widget as widget_registry
import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding

import alpa_lab as al
from alpa_lab.cost.profile import Profile
from alpa_lab.models import tiny_example
from alpa_lab.notebook import render, views
from alpa_lab.notebook.workbench import Workbench
from alpa_lab.passes.schedule import make_schedule
from alpa_lab.passes.transfers import pipeline_transfers
from alpa_lab.sharding.spec import ShardingSpec
from test_recalibrate import synthetic  # a profile with known factors, shared with the recalibration tests

LOCAL = al.ClusterSpec.local(hosts=2, devices_per_host=4)


@pytest.fixture(scope="module")
def gpt():
    ex = tiny_example("gpt")
    step = al.parallelize(ex.train_step, cluster=LOCAL, microbatches=4, layers=4)
    plan = step.plan(ex.state, ex.batch)
    plan = plan.pin_stages([[0, 1], [2, 3]], submeshes=[(1, 4), (1, 4)])
    step.current_plan = plan
    return ex, step, plan


@pytest.fixture(scope="module")
def mlp_single():
    ex = tiny_example("mlp")
    step = al.parallelize(ex.train_step, cluster=al.ClusterSpec.local(1, 4))
    return ex, step, step.plan(ex.state, ex.batch)


# ----- views: content against independent oracles ---------------------------------------------


def test_heatmap_tiles_match_jax_shards(gpt):
    _, _, plan = gpt
    names = views.tensors(plan)
    assert any(not n.startswith("[") for n in names), "op outputs are listed, not only arguments"
    devices = jax.devices()
    checked = 0
    for name in names:
        info = views.tensor_info(plan, name, names)
        assert info.stage == names[name]
        if not info.shape or ShardingSpec.parse(info.spec).replication(info.mesh_shape) == np.prod(info.mesh_shape):
            continue
        mesh = Mesh(np.array([devices[d] for d in info.device_ids]).reshape(info.mesh_shape), ("x", "y"))
        sharding = NamedSharding(mesh, ShardingSpec.parse(info.spec).to_partition_spec())
        shards = sharding.devices_indices_map(info.shape)
        expected = {d.id: tuple(s.indices(n)[:2] for s, n in zip(idx, info.shape)) for d, idx in shards.items()}
        tiles = views.sharding_tiles(info)
        assert {t.device: t.region for t in tiles} == expected, info.name
        # copies of one tile are numbered 0, 1, ...; devices holding equal regions share a tile index
        by_index: dict = {}
        for t in tiles:
            by_index.setdefault(t.tile_index, []).append(t)
        for group in by_index.values():
            assert sorted(t.replica for t in group) == list(range(len(group)))
            assert len({t.region for t in group}) == 1
        checked += 1
        if checked >= 40:
            break
    assert checked >= 5


def test_timeline_bars_match_the_schedule(gpt):
    _, _, plan = gpt
    bars = views.timeline_bars(plan)
    sched = make_schedule(plan.schedule, plan.num_stages, plan.num_microbatches)
    for mesh, program in enumerate(sched.instructions):
        runs = [(i.stage, i.phase, i.microbatch) for i in program if i.kind == "RUN"]
        mine = sorted((b for b in bars if b.kind == "RUN" and b.mesh == mesh), key=lambda b: b.start)
        assert [(b.stage, b.phase, b.microbatch) for b in mine] == runs
        for b in mine:
            st = plan.stages[b.stage]
            want = st.forward_time if b.phase == "forward" else st.backward_time
            assert b.end - b.start == pytest.approx(want, rel=1e-9)
        recvs = [(i.stage, i.phase, i.microbatch) for i in program if i.kind == "RECV"]
        transfers = [(b.stage, b.phase, b.microbatch) for b in bars if b.kind == "TRANSFER" and b.mesh == mesh]
        assert sorted(transfers) == sorted(recvs)
    assert {b.stage for b in bars if b.kind == "UPDATE"} == {st.index for st in plan.stages if st.apply_time > 0}


def test_chrome_trace_has_one_event_per_bar(gpt, tmp_path):
    _, step, plan = gpt
    wb = Workbench(plan, step)
    path = wb.export_chrome_trace(tmp_path / "trace.json")
    trace = json.loads(path.read_text())
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    bars = wb.timeline_bars()
    assert len(spans) == len(bars)
    for e, b in zip(spans, bars):
        assert e["ts"] == pytest.approx(b.start * 1e6) and e["dur"] == pytest.approx((b.end - b.start) * 1e6)
    assert {e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"} >= {"mesh 0", "mesh 1"}


def test_traffic_matrix_sums_to_the_unit_tasks(gpt):
    _, _, plan = gpt
    tr = views.traffic(plan)
    moves = pipeline_transfers(plan)
    M = plan.num_microbatches
    # independent sum: every unit task's bytes, once per receiver that does not already hold it
    expected = np.zeros((plan.num_stages, plan.num_stages))
    for t in moves:
        times = 1 if t.phase in ("apply", "state") else M  # the update's inputs and new state move once per step
        for u in t.resharding.tasks:
            expected[t.src_stage, t.dst_stage] += times * u.nbytes * sum(1 for s, r in u.assignment if s != r)
    assert np.array_equal(np.array(tr.mesh_bytes), expected)
    assert expected.sum() > 0 and expected[0, 1] > 0 and expected[1, 0] > 0  # activations forward, gradients back
    assert np.array(tr.host_bytes).sum() == expected.sum()
    assert set(tr.cells) == {(t.src_stage, t.dst_stage) for t in moves}


def test_overview_adds_up(gpt):
    _, _, plan = gpt
    ov = views.overview(plan)
    for st, row in zip(plan.stages, ov.stages):
        assert row.compute + row.communication + row.bubble == pytest.approx(plan.timeline.makespan, rel=1e-9)
        assert row.memory == st.memory_per_device and row.capacity == LOCAL.device_memory
        for d in st.device_ids:
            assert ov.device_stage[d // LOCAL.devices_per_host][d % LOCAL.devices_per_host] == st.index
    assert ov.step_time == plan.estimated_step_time


def test_strategy_rows_and_collapsed_blocks(gpt):
    _, _, plan = gpt
    rows = views.strategy_rows(plan)
    assert [(r.stage, r.name) for r in rows] == [(st.index, o.name) for st in plan.stages for o in st.plan.ops]
    layer = {op.name: plan.problem.slicing.layer[op.index] for op in plan.problem.graph.ops}
    assert all(r.layer == layer[r.name] for r in rows if r.kind == "op")
    assert views.block_of("transpose(jvp(TransformerLM/Block_3/Attention_0/_where))") == "TransformerLM/Block_3"
    assert views.block_of("jvp(MLP/Dense_1)") == "MLP/Dense_1" and views.block_of("jvp()") == ""
    groups = views.collapse_repeated(rows)
    sig = {}
    for r in rows:
        sig.setdefault((r.stage, r.block), []).append((r.primitive, r.strategy))
    shown = sum(len(g.rows) for g in groups)
    hidden = sum(len(sig[(g.stage, b)]) for g in groups for b in g.repeats)
    assert shown + hidden == len(rows)
    for g in groups:
        for b in g.repeats:
            assert sig[(g.stage, b)] == [(r.primitive, r.strategy) for r in g.rows]


# ----- the widget: edits through its controls are the plan's own edits ------------------------------


def _strategies(plan):
    return [(o.name, o.strategy) for sp in views.stage_plans(plan) for o in sp.ops]


def test_pin_through_the_widget_equals_plan_pin(gpt):
    _, step, plan = gpt
    wb = Workbench(plan, step)
    op = next(o for o in plan.stages[1].plan.ops if o.kind == "op" and o.primitive == "dot_general" and o.num_strategies > 2)
    other = next(a.strategy for a in plan.stages[1].plan.explain(op.name).alternatives if not a.chosen)
    wb.op_select.value = op.name
    assert wb.strategy_select.value == op.strategy  # the current choice is preselected
    wb.strategy_select.value = other
    wb.pin_button.click()
    expected = plan.pin(op.name, other)
    assert wb.last_error == ""
    assert _strategies(wb.plan) == _strategies(expected)
    assert wb.plan.estimated_step_time == pytest.approx(expected.estimated_step_time)
    assert step.current_plan is wb.plan and wb.history == [plan]
    assert op.name in wb.changes[-1] and "stage 1" in wb.changes[-1]
    assert f"{op.name}: {op.strategy} -> {other}" in wb.changes[-1]
    wb.unpin_button.click()
    assert _strategies(wb.plan) == _strategies(plan)
    assert wb.undo() and wb.undo() and wb.plan is plan
    step.current_plan = plan


def test_conflicting_edits_keep_the_last_good_plan(gpt):
    _, step, plan = gpt
    bound = []
    wb = Workbench(plan, step, on_change=bound.append)
    # a merged op (it follows its leader's layout) and its leader, pinned in ways that clash (a tied repeat may
    # not: the planner then unties the repeats, so the first merged op whose pins cannot hold together is taken)
    sp = plan.stages[0].plan
    sg = sp.problem

    def clash_of(o):
        n, lead = sg.node_index(o.name), sg.node_index(o.merged_into)
        leader_strategy = sg.nodes[lead].strategies[int(sg.member_map[lead][0])].name
        forced = int(sg.member_map[n][0])
        clash = next(sg.nodes[n].strategies[j].name for j in set(map(int, sg.member_map[n])) if j != forced)
        try:
            plan.pin(o.merged_into, leader_strategy).pin(o.name, clash)
        except al.PinError:
            return leader_strategy, clash
        return None

    merged, (leader_strategy, clash) = next(
        (o, c) for o in sp.ops
        if o.merged_into != o.name and len(set(map(int, sg.member_map[sg.node_index(o.name)]))) > 1 and (c := clash_of(o))
    )
    assert wb.pin(merged.merged_into, leader_strategy)
    good = wb.plan
    assert not wb.pin(merged.name, clash)
    assert wb.plan is good and "cannot hold together" in wb.last_error and merged.name in wb.last_error
    assert "unchanged" in wb.status.value
    for bad in ("0-1, 3-3", "zero-one", ""):
        wb.stage_layers.value, wb.stage_submeshes.value = bad, ""
        wb.stages_button.click()
        assert wb.plan is good and wb.last_error
    assert not wb.pin("no_such_op", "RR") and "no_such_op" in wb.last_error and wb.plan is good
    assert not wb.pin(merged.merged_into, "not a strategy") and wb.plan is good
    assert bound == [good] and step.current_plan is good
    # interleaving keeps the meshes and cuts 2 chunks per mesh; leaving it for a one-stage-per-mesh
    # schedule is refused (the chunks are not contiguous) and the dropdown snaps back
    wb.schedule_select.value = "interleaved_1f1b"
    interleaved = wb.plan
    assert interleaved.num_stages == 4 and interleaved.num_meshes == 2 and bound[-1] is interleaved
    wb.schedule_select.value = "gpipe"
    assert wb.plan is interleaved and wb.schedule_select.value == "interleaved_1f1b" and "share 2 meshes" in wb.last_error
    step.current_plan = plan


def test_boundary_move_and_schedule_switch(gpt):
    _, step, plan = gpt
    wb = Workbench(plan, step)
    wb.stage_layers.value, wb.stage_submeshes.value = "0-2, 3-3", "1x4, 1x4"
    wb.stages_button.click()
    expected = plan.pin_stages([[0, 2], [3, 3]], submeshes=[(1, 4), (1, 4)])
    assert [st.layers for st in wb.plan.stages] == [(0, 3), (3, 4)] and _strategies(wb.plan) == _strategies(expected)
    assert "layers 0..1" in wb.changes[-1] and "layers 0..2" in wb.changes[-1]
    wb.schedule_select.value = "gpipe"
    assert wb.plan.schedule == "gpipe"
    assert wb.plan.estimated_step_time == pytest.approx(expected.with_schedule("gpipe").estimated_step_time)
    assert "schedule 1f1b -> gpipe" in wb.changes[-1]
    step.current_plan = plan


def test_run_streams_measured_times_and_failures_keep_state(gpt):
    ex, step, plan = gpt
    wb = Workbench(plan, step)
    wb.run(ex.state, ex.batch, steps=2, block=True)
    assert wb.last_error == "" and len(wb.measured_steps) == 2
    state, loss = wb.result
    assert np.isfinite(float(loss))
    sched = make_schedule(plan.schedule, plan.num_stages, plan.num_microbatches)
    runs = {(i.stage, i.phase, i.microbatch) for prog in sched.instructions for i in prog if i.kind == "RUN"}
    assert {(b.stage, b.phase, b.microbatch) for b in wb.measured if b.kind == "RUN"} == runs
    assert all(b.end >= b.start >= 0 for b in wb.measured)
    assert "measured against predicted" in wb.measured_html.value
    assert any(b.source == "measured" for b in wb.timeline_bars())
    # per stage and phase: the medians of the measured bars against the stage figures the planner predicted
    costs = {(c.stage, c.kind, c.phase): c for c in views.stage_costs(views.timeline_bars(plan), wb.measured)}
    for st in plan.stages:
        for phase, predicted in (("forward", st.forward_time), ("backward", st.backward_time)):
            c = costs[(st.index, "RUN", phase)]
            spans = [b.end - b.start for b in wb.measured if (b.stage, b.kind, b.phase) == (st.index, "RUN", phase)]
            assert c.count == len(spans) == plan.num_microbatches
            assert c.measured == pytest.approx(float(np.median(spans)), rel=1e-12)
            assert c.predicted == pytest.approx(predicted, rel=1e-9) and c.ratio == pytest.approx(c.measured / predicted)
            assert f"stage {st.index} {phase}" in wb.measured_html.value
    # a failing run (a batch the micro-batches do not divide) keeps the plan and the last result
    bad = jax.tree_util.tree_map(lambda x: x[:3], ex.batch)
    wb.run(state, bad, steps=1, block=True)
    assert wb.plan is plan and "run 1 failed" in wb.run_status.value and wb.result[0] is state
    assert "failed" not in wb.status.value and wb.last_error == ""  # the planning status is the edits' own
    with pytest.raises(ValueError, match="no step"):
        Workbench(plan).run(ex.state, ex.batch)


def test_static_html_for_saved_notebooks(gpt):
    _, step, plan = gpt
    wb = Workbench(plan, step)
    bundle = wb._repr_mimebundle_()
    assert "application/vnd.jupyter.widget-view+json" in bundle
    page = bundle["text/html"]
    assert "<script" not in page
    assert page.count("<rect") == len(wb.timeline_bars())
    for st in plan.stages:
        assert f"{st.submesh_shape[0]}x{st.submesh_shape[1]}" in page
    assert "resharding traffic" in page and "Pipeline plan" in bundle["text/plain"]


def test_single_mesh_plan(mlp_single):
    ex, step, plan = mlp_single
    wb = Workbench(plan, step)
    op = next(o for o in plan.ops if o.kind == "op" and o.num_strategies > 1)
    other = next(a.strategy for a in plan.explain(op.name).alternatives if not a.chosen)
    wb.op_select.value = op.name
    wb.strategy_select.value = other
    wb.pin_button.click()
    assert _strategies(wb.plan) == _strategies(plan.pin(op.name, other))
    assert f"{op.name}: {op.strategy} -> {other}" in wb.changes[-1]
    assert not wb.pin_stages([[0, 0]]) and "single-mesh" in wb.last_error
    assert views.overview(plan).stages[0].bubble == 0 and "<svg" not in wb.to_html()
    wb.undo()
    wb.run(ex.state, ex.batch, steps=3, block=True)
    assert wb.last_error == "" and [b.microbatch for b in wb.measured] == [0, 1, 2]
    assert all(b.phase == "step" and b.source == "measured" for b in wb.measured)
    assert "median of 2" in wb.measured_html.value and "<svg" in wb.to_html()  # the measured steps are drawn
    step.current_plan = plan


def test_unpin_stages_lets_the_dp_choose_again(gpt):
    ex, step, plan = gpt
    wb = Workbench(plan, step)
    assert wb.plan.stage_pins
    wb.unpin_stages_button.click()
    assert wb.last_error == "" and not wb.plan.stage_pins
    dp = step.plan(ex.state, ex.batch)  # the DP's own choice, as planned without the workbench
    assert [(st.layers, st.submesh_shape, st.logical_shape) for st in wb.plan.stages] == [
        (st.layers, st.submesh_shape, st.logical_shape) for st in dp.stages
    ]
    assert _strategies(wb.plan) == _strategies(dp)
    step.current_plan = plan


def test_filter_narrows_the_picker_and_the_table(gpt):
    _, step, plan = gpt
    wb = Workbench(plan, step)
    wb.op_filter.value = "dot_general"
    names = [v for _, v in wb.op_select.options]
    assert names and all("dot_general" in n for n in names)
    assert f"{len(names)} of {len(views.strategy_rows(plan))}" in wb.table_html.value
    wb.op_filter.value = "no op has this"
    assert wb.op_select.options == () and wb.op_select.value is None


def test_save_button_writes_the_current_plan(gpt, tmp_path):
    ex, step, plan = gpt
    wb = Workbench(plan, step)
    wb.save_path.value = str(tmp_path / "edited.plan.json")
    wb.save_button.click()
    assert wb.last_error == "" and al.PipelinePlan.load(tmp_path / "edited.plan.json") == plan
    wb.save_path.value = str(tmp_path / "no" / "such" / "dir" / "p.json")
    wb.save_button.click()
    assert "No such file or directory" in wb.last_error and wb.plan is plan  # reported; nothing is lost


def test_traffic_tab_opens_on_the_busiest_link_with_its_unit_tasks(gpt):
    _, step, plan = gpt
    wb = Workbench(plan, step)
    tr = views.traffic(plan)
    a, b = wb.traffic_cell.value
    assert tr.mesh_bytes[a][b] == max(max(row) for row in tr.mesh_bytes)
    shown = wb.traffic_tasks.value
    for t in tr.transfers[(a, b)]:
        assert html.escape(t.name) in shown
    assert "senders" in shown and "receivers" in shown
    # the op picker opens on the costliest op, and the heatmap follows it
    heaviest = max(views.strategy_rows(plan), key=lambda r: r.cost)
    assert wb.op_select.value == heaviest.name


def test_overview_of_an_interleaved_plan_shares_each_mesh(gpt):
    _, _, plan = gpt
    inter = plan.with_schedule("interleaved_1f1b")
    ov = views.overview(inter)
    for mesh in range(2):
        on_mesh = [row for row in ov.stages if row.device_ids == inter.stages[mesh].device_ids]
        assert len(on_mesh) == 2
        total = sum(r.compute + r.communication + r.bubble for r in on_mesh)
        assert total == pytest.approx(inter.timeline.makespan, rel=1e-9)
        d = inter.stages[mesh].device_ids[0]
        assert ov.device_labels[d // 4][d % 4] == f"stages {mesh},{mesh + 2}"
    assert "stages 0,2" in Workbench(inter).to_html()


def test_unpin_stages_keeps_interleaving_or_says_why_not(gpt):
    _, step, plan = gpt
    wb = Workbench(plan.with_schedule("interleaved_1f1b"), step)
    inter = wb.plan
    # the DP's own stages for this 4-layer step are 4, too many to cut into 2 chunks each: refused, plan kept
    assert not wb.unpin_stages() and "needs at least 8 layers" in wb.last_error and wb.plan is inter
    step.current_plan = plan


# ----- the run sync, figure widgets and undo of a re-plan ----------------------------------------


def test_run_sync_leaves_planning_status_and_other_plans_alone(gpt):
    ex, step, plan = gpt
    wb = Workbench(plan, step)
    assert not wb.pin("no_such_op", "RR")
    refusal, error = wb.status.value, wb.last_error
    run = wb.run(ex.state, ex.batch, steps=2, block=True)
    # the run's progress has its own line; the planning status and the refusal stay as the edit left them
    assert wb.status.value == refusal and wb.last_error == error
    assert "run 0 finished: step 2/2" in wb.run_status.value and len(wb.measured_steps) == 2
    # a redraw after the plan changed (the dashboard's thread runs late): the old plan's
    # measurements are not drawn against the new plan, and the edit's status stays
    assert wb.set_schedule("gpipe")
    edited = wb.status.value
    wb._sync_run(run)
    assert wb.measured == () and wb.measured_steps == [] and "measured against predicted" not in wb.measured_html.value
    assert wb.status.value == edited and "earlier plan" in wb.run_status.value
    # back on the run's plan, its measurements are its own again
    assert wb.undo() and wb.plan is run.plan
    wb._sync_run(run)
    assert len(wb.measured_steps) == 2 and "measured against predicted" in wb.measured_html.value
    # the sync waits for an edit in progress (the lock) instead of writing under it
    wb.measured_steps = []
    with wb._lock:
        sync = threading.Thread(target=wb._sync_run, args=(run,))
        sync.start()
        sync.join(0.5)
        assert sync.is_alive() and wb.measured_steps == []
    sync.join(10)
    assert not sync.is_alive() and len(wb.measured_steps) == 2
    step.current_plan = plan


def test_redraws_close_the_figure_widgets_they_replace(gpt):
    _, step, plan = gpt
    wb = Workbench(plan, step)
    wb.refresh()
    live = len(widget_registry._instances)
    graph, timeline = wb._graph_widget, wb.timeline_box.children[0]
    for _ in range(3):
        wb._draw_timeline()
        wb._draw_graph()
        wb.refresh()
    assert len(widget_registry._instances) == live
    assert graph.comm is None  # closed: gone from the kernel
    assert wb.timeline_box.children == (timeline,) and timeline.comm is not None  # the same timeline: kept as it is
    assert wb._graph_widget.comm is not None and all(w.comm is not None for w in wb.timeline_box.children)
    assert wb.overview_measured in wb.overview_box.children and wb.overview_measured.comm is not None


def _drawn(widget) -> list[tuple]:
    return [(t.name, tuple(t.y), tuple(t.x), tuple(t.base), tuple(t.text)) for t in widget.data]


def test_new_measurements_update_the_timeline_figure_in_place(gpt):
    """A run's new measurements go into the measured figure the browser already has (no new widget);
    the figure then shows what a figure made afresh from the same bars shows. Bars of other phases
    than the figure has need a new figure, and the old one is closed."""
    _, step, plan = gpt
    wb = Workbench(plan, step)
    predicted = views.timeline_bars(plan)
    wb.measured = tuple(dataclasses.replace(b, source="measured") for b in predicted)
    wb._draw_timeline()
    first, figure = wb.timeline_box.children
    live = len(widget_registry._instances)
    for k in (2.0, 3.0):  # a later step: other times, one microbatch fewer
        wb.measured = tuple(dataclasses.replace(b, source="measured", start=b.start * k, end=b.end * k)
                            for b in predicted if b.microbatch != 0)
        wb._draw_timeline()
        assert wb.timeline_box.children == (first, figure) and len(widget_registry._instances) == live
        fresh = render.timeline_figure(list(wb.measured), "")
        assert _drawn(figure) == _drawn(fresh) and figure.layout.height == fresh.layout.height
    wb.measured = tuple(b for b in wb.measured if b.kind == "RUN" and b.phase == "forward")  # fewer traces
    wb._draw_timeline()
    first_now, figure_now = wb.timeline_box.children
    assert first_now is first and figure_now is not figure and figure.comm is None
    assert _drawn(figure_now) == _drawn(render.timeline_figure(list(wb.measured), ""))
    assert len(widget_registry._instances) == live


class _MeasuredRun:
    """A run that measured ``profile`` (what ``Workbench.recalibrate`` reads of a run)."""

    def __init__(self, profile: Profile):
        self._profile = profile

    def profile(self) -> Profile:
        return self._profile


def test_undo_of_a_replan_gives_the_step_back_its_cluster_and_planner_state(gpt):
    ex, step, plan = gpt
    before = step.plan(ex.state, ex.batch)  # the DP's plan on the step's own cluster
    cluster, problem = step.cluster, step._problems[plan.fingerprint]
    step.current_plan = plan
    wb = Workbench(plan, step)
    prof = synthetic(plan, 5.0, 1.0, 0.0)
    try:
        assert wb.recalibrate(_MeasuredRun(prof)), wb.last_error
        assert step.cluster.to_dict() == prof.cluster().to_dict() and step._problems[plan.fingerprint] is wb.plan.problem
        assert wb.undo() and wb.plan is plan and step.current_plan is plan
        assert step.cluster is cluster and step._problems[plan.fingerprint] is problem
        again = step.plan(ex.state, ex.batch)  # plans as before the re-plan
        assert again._current_stages() == before._current_stages() and again.cluster == before.cluster
        assert [st.plan for st in again.stages] == [st.plan for st in before.stages] and again.problem is problem
        step.current_plan = plan
        state, loss = step(ex.state, ex.batch)  # and compiles and runs the plan undo gave back
        assert np.isfinite(float(loss))
        # a re-plan that fails leaves the step as it was
        other = synthetic(plan, 5.0, 1.0, 0.0)
        other = Profile(other.fingerprint, al.ClusterSpec.local(1, 8).to_dict(), other.rows, 10, 0.0, 0.0)
        assert not wb.recalibrate(_MeasuredRun(other)) and wb.plan is plan and step.cluster is cluster
    finally:
        step.cluster, step._problems[plan.fingerprint], step.current_plan = cluster, problem, plan
