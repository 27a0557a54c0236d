"""Training runs, their live dashboard, profiles and re-planning with measured costs (issue 10), in-process.

Oracles: the schedule's instruction lists for the bars, the monitor's own step records for
throughput (samples / median step time, recomputed here), the final state's shards for the
memory lower bound, the plan's eq. 5 figures, and for the fit a profile synthesised from
known factors. ``recalibrated`` is compared with planning from scratch on the fitted cluster.
The Ray half (link bytes against the unit tasks, several runs on one cluster, stop, a mesh
worker killed mid-run) is in ``test_ray_runtime.py``.
"""

from __future__ import annotations

import dataclasses
import threading
import time
import tracemalloc
from types import MappingProxyType

import jax
import numpy as np
import pytest

import alpa_lab as al
from alpa_lab.cost.profile import CostParts, Profile, ProfileError, ProfileRow
from alpa_lab.models import tiny_example
from alpa_lab.notebook import render, views
from alpa_lab.notebook.dashboard import Dashboard, dashboard_state
from alpa_lab.notebook.workbench import Workbench
from alpa_lab.passes.schedule import make_schedule
from alpa_lab.plan import memory_per_mesh
from alpa_lab.runtime.mesh_worker import Event
from alpa_lab.runtime.monitor import RunMonitor, pipeline_parts
from alpa_lab.runtime.training import batch_stream

LOCAL = al.ClusterSpec.local(hosts=1, devices_per_host=8)


@pytest.fixture(scope="module")
def mlp():
    ex = tiny_example("mlp")
    step = al.parallelize(ex.train_step, cluster=LOCAL, microbatches=4, layers=4)
    plan = step.plan(ex.state, ex.batch)
    plan = plan.pin_stages([[0, 1], [2, 3]], submeshes=[(1, 4), (1, 4)])
    step.current_plan = plan
    return ex, step, plan


def test_launch_runs_in_the_background_and_the_dashboard_shows_the_run(mlp):
    ex, step, plan = mlp
    wb = Workbench(plan, step)
    gate = threading.Event()  # the first batch waits for it: the run cannot train before the test lets it

    def batches(i: int):
        gate.wait(120)
        return ex.batch

    try:
        run = wb.launch(ex.state, batches, steps=6)
        # launch returned while the run waits for its first batch: the kernel is free while it trains
        assert run.running and run.monitor.steps_done == 0 and run.status in ("starting", "running")
        assert wb.dashboard is wb.dashboards[0] and wb.dashboard_box.children == (wb.dashboard,)
    finally:
        gate.set()
    wb.wait()
    assert run.status == "finished" and run.error == "" and run.monitor.steps_done == 6
    s = wb.dashboard.state
    steps = run.monitor.steps()
    # throughput and FLOP/s: samples and FLOPs per step over the median steady step, recomputed here
    median = float(np.median([r.seconds for r in steps[1:]]))
    assert s.step_time == pytest.approx(median, rel=1e-12)
    assert s.samples_per_second == pytest.approx(ex.batch["x"].shape[0] / median, rel=1e-12)
    graph = step.trace(ex.state, ex.batch)
    assert s.tflops == pytest.approx(steps[-1].flops / median / 1e12) and steps[-1].flops > graph.total_flops
    assert s.loss == pytest.approx(float(run.result[1]))
    # the measured bars are the schedule's RUNs of the window's steps
    sched = make_schedule(plan.schedule, plan.num_stages, plan.num_microbatches)
    runs = {(i.stage, i.phase, i.microbatch) for prog in sched.instructions for i in prog if i.kind == "RUN"}
    window = run.monitor.window_steps
    got = [(b.stage, b.phase, b.microbatch) for b in s.bars if b.kind == "RUN"]
    assert set(got) == runs and len(got) == len(runs) * window
    assert len([b for b in s.bars if b.kind == "UPDATE"]) == plan.num_stages * window
    # memory: every plan device, predicted = eq. 5 of its mesh, measured >= the final state's bytes there
    predicted = {d: b for devs, b in memory_per_mesh(plan.stages).items() for d in devs}
    held: dict[int, int] = {}
    for leaf in jax.tree_util.tree_leaves(run.state):
        for sh in leaf.addressable_shards:
            held[sh.device.id] = held.get(sh.device.id, 0) + sh.data.nbytes
    rows = {m.device_id: m for m in s.memory}
    assert set(predicted) <= set(rows)
    for d, b in predicted.items():
        assert rows[d].predicted == b and rows[d].measured >= held.get(d, 0) and rows[d].source == "live buffers"
    # links: the plan's unit tasks per mesh pair, and what the last step counted landing there (the same bytes)
    tr = views.traffic(plan)
    assert {(ln.sender, ln.receiver): ln.predicted for ln in s.links} == {c: tr.mesh_bytes[c[0]][c[1]] for c in tr.cells}
    assert {(ln.sender, ln.receiver): ln.measured for ln in s.links} == dict(steps[-1].link_bytes)
    assert all(ln.measured == ln.predicted > 0 for ln in s.links)
    # transfers: each tensor a mesh got from the other, every micro-batch, timed from its send to its arrival (as a
    # mesh worker's RECV); oracle: the plan's cross-mesh transfers (passes.transfers) of the micro-batch phases
    window_recvs = [b for b in s.bars if b.kind == "TRANSFER"]
    per_microbatch = {c: {t.var for t in ts if t.phase in ("forward", "backward")} for c, ts in tr.transfers.items()}
    expected = {(b, mb) for (a, b), vs in per_microbatch.items() if vs for mb in range(plan.num_microbatches)}
    assert {(b.mesh, b.microbatch) for b in window_recvs} == expected and len(expected) == 2 * plan.num_microbatches
    recvs = [e for e in run.monitor.snapshot().events if e.kind == "recv"]
    got_vars: dict[tuple[int, int], set] = {}
    for e in recvs:
        got_vars.setdefault((e.peer, e.mesh), set()).add(e.var)
        assert e.end > e.start and e.nbytes == plan.problem.graph.vars[e.var].nbytes
    assert got_vars == {c: vs for c, vs in per_microbatch.items() if vs}
    # measured against predicted per stage phase: the profile's rows, medians of the monitor's durations
    costs = {(c.stage, c.kind, c.phase): c for c in s.costs}
    for mesh in (0, 1):  # a transfer is priced per message: one sample each, every message of the steady steps
        assert costs[(mesh, "TRANSFER", "")].count >= plan.num_microbatches * (6 - 1)
    for st in plan.stages:
        c = costs[(st.index, "RUN", "forward")]
        spans = [b.end - b.start for b in s.bars if (b.stage, b.kind, b.phase) == (st.index, "RUN", "forward")]
        assert c.predicted == pytest.approx(st.forward_time, rel=1e-9) and c.count == plan.num_microbatches * (6 - 1)
        # the window's bars are all but the first steady step's spans: the median of all lies between their order statistics
        lo, hi = median_bounds(spans, c.count)
        assert lo * (1 - 1e-9) <= c.measured <= hi * (1 + 1e-9), (lo, c.measured, hi)
        update = costs[(st.index, "UPDATE", "apply")]  # one sample per steady step: a whole update each
        assert update.count == 6 - 1 and update.predicted == pytest.approx(st.apply_time, rel=1e-9)
    html = wb.dashboard.to_html()
    assert "finished" in html and "<script" not in html and "samples/s" in html and "plan (eq. 5)" in html
    # the workbench's timeline and measured table follow the run
    assert len(wb.measured_steps) == 6 and "measured against predicted" in wb.measured_html.value
    # a run in this process ran one unit task at a time: its step is set beside the plan's step so
    assert "one unit task at a time (this process)" in wb.measured_html.value
    assert render._ms(plan.serial_step_time) in wb.measured_html.value
    assert "one unit task at a time, as this process runs them" in html


def median_bounds(window: list[float], n: int) -> tuple[float, float]:
    """Bounds on the median of ``n`` samples from ``window``, ``len(window)`` of them (the others unknown).

    With k samples unseen, at least ceil(n/2) - k of the window lie at or below the median and
    as many at or above it, so it lies between those order statistics of the window.
    """
    w, k, j = sorted(window), n - len(window), (n + 1) // 2
    assert 0 <= k < j, (n, len(window))
    return w[j - k - 1], w[len(w) - (j - k)]


def test_a_profile_before_the_first_step_says_so(mlp):
    """``run.profile()`` asked before a step has finished (the README's training example did, by stopping its run
    at once): a ProfileError that says nothing was measured yet, not an empty profile or a division by zero."""
    ex, step, plan = mlp
    gate = threading.Event()  # the first batch waits for it: no step can finish before the test lets it

    def batches(i: int):
        gate.wait(120)
        return ex.batch

    run = step.train(ex.state, batches, steps=2)
    try:
        with pytest.raises(ProfileError, match="has not finished a step yet"):
            run.profile()
    finally:
        run.stop()
        gate.set()
        run.wait(120)


def test_stop_and_failures_keep_the_plan_and_the_last_state(mlp):
    ex, step, plan = mlp
    wb = Workbench(plan, step)
    run = wb.launch(ex.state, ex.batch, steps=100_000)
    deadline = time.monotonic() + 60
    while run.monitor.steps_done < 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    with pytest.raises(ValueError, match="already in progress"):
        wb.launch(ex.state, ex.batch, steps=2)
    wb.stop()
    wb.wait(60)
    assert run.status == "stopped" and 3 <= run.monitor.steps_done < 100_000
    assert wb.dashboard.stop_button.disabled
    good = run.state
    # a failing run (a batch the micro-batches do not divide): shown in its own dashboard; state and plan kept
    bad = jax.tree_util.tree_map(lambda x: x[:3], ex.batch)
    run2 = wb.launch(good, bad, steps=5)
    wb.wait(60)
    assert run2.status == "failed" and run2.state is good and wb.plan is plan
    assert "failed" in wb.dashboards[1].header.value and run2.error.split(":")[0] in wb.dashboards[1].header.value
    assert "run 1 failed" in wb.run_status.value and len(wb.dashboards) == 2 and wb.dashboards[0].run is run


def test_batches_as_list_iterator_and_function(mlp):
    ex, step, plan = mlp
    xs = [jax.tree_util.tree_map(lambda x, k=k: x * (1 + 0.1 * k), ex.batch) for k in range(3)]
    losses = {}
    for name, batches in (("list", xs), ("iterator", iter(xs * 2)), ("function", lambda i: xs[i % 3])):
        run = step.train(ex.state, batches, steps=5).wait()
        assert run.status == "finished", run.error
        losses[name] = [r.loss for r in run.monitor.steps()]
    assert losses["list"] == losses["iterator"] == losses["function"]
    short = step.train(ex.state, iter(xs[:2]), steps=5).wait()
    assert short.status == "failed" and "ran out after 2 steps" in short.error and short.monitor.steps_done == 2
    # a batch of another shape mid-run is refused (the run's program is compiled for the first), the state kept
    half = jax.tree_util.tree_map(lambda x: x[: x.shape[0] // 2], ex.batch)
    other = step.train(ex.state, lambda i: half if i == 2 else ex.batch, steps=5).wait()
    assert other.status == "failed" and "step 2's arguments differ" in other.error
    assert other.monitor.steps_done == 2 and other.state_step == 2
    ref = step.train(ex.state, ex.batch, steps=2).wait()
    for a, b in zip(jax.tree_util.tree_leaves(other.state), jax.tree_util.tree_leaves(ref.state)):
        np.testing.assert_array_equal(a, b)


def test_a_mapping_is_one_batch():
    """A dict-like batch (not a dict: a read-only view, Flax's FrozenDict) is the step's batch, not an iterable of keys."""
    from flax.core import FrozenDict

    batch = {"x": np.ones((4, 2)), "y": np.zeros(4)}
    for mapping in (batch, MappingProxyType(batch), FrozenDict(batch)):
        args = batch_stream(mapping, 1)
        assert args(0) == (mapping,) and args(7)[0] is mapping
    assert batch_stream((batch, 3), 2)(1) == (batch, 3)  # a tuple: the step's arguments after the state


def _drawn(widget) -> list[tuple]:
    """What a timeline figure widget shows: per trace, its phase and its bars (lanes, lengths, starts)."""
    return [(t.name, tuple(t.y), tuple(t.x), tuple(t.base)) for t in widget.data]


def test_the_timeline_tab_is_redrawn_live_only_while_shown(mlp):
    """The Timeline tab's figures are a plotly render for the browser on each redraw: while the run
    goes they are redrawn only while that tab is shown (the measured table still follows), when the
    tab is shown, and when the run ends. Oracle: a figure made afresh from the bars at that moment."""
    ex, step, plan = mlp
    wb = Workbench(plan, step)
    wb.tabs.selected_index = 0  # the Overview

    def batches(i: int):
        time.sleep(0.01)
        return ex.batch

    def measured_figure() -> list[tuple]:
        return _drawn(render.timeline_figure([b for b in wb.timeline_bars() if b.source == "measured"]))

    before = wb.timeline_box.children
    run = wb.launch(ex.state, batches, steps=100_000)
    try:
        t0 = time.monotonic()
        # redraws came due (every TIMELINE_EVERY s) with the tab hidden: the table follows the run, the figures wait
        while not (wb._timeline_stale and "measured against predicted" in wb.overview_measured.value):
            assert time.monotonic() - t0 < 120 and run.running, run.error
            time.sleep(0.05)
        assert wb.timeline_box.children == before
        wb.tabs.selected_index = 2  # shown: drawn now, with the run's measurements
        assert wb.timeline_box.children[0] is before[0] and not wb._timeline_stale  # the same prediction: kept
        predicted, measured = wb.timeline_box.children
        shown = _drawn(measured)
        assert shown == measured_figure() and shown
        wb.tabs.selected_index = 0
    finally:
        run.stop()
        wb.wait(120)
    # the end is drawn, shown or not: in place, into the figure the browser already has
    assert run.status == "stopped" and wb.timeline_box.children == (predicted, measured)
    assert _drawn(measured) == measured_figure() != shown


def test_a_run_keeps_the_plan_it_was_launched_with(mlp):
    """Re-planning while a run trains (step.use, the workbench's edits) changes the next run, not this one.

    The switch happens inside the run, in its batch function before step 2, so the test is
    deterministic. Oracle: the run's numbers equal the launch plan's alone, bit for bit, and
    the other plan's (checked to differ) are not what it trained.
    """
    ex, step, plan = mlp
    other = plan.pin_stages([[0, 3]], submeshes=[(1, 8)])  # one stage on all 8 devices: other sums, other last bits

    def switching(i: int):
        if i == 2:
            step.use(other)
        return ex.batch

    def leaves(state) -> list[np.ndarray]:
        return [np.asarray(x) for x in jax.tree_util.tree_leaves(state)]

    try:
        run = step.train(ex.state, switching, steps=4).wait(300)
        assert run.status == "finished", run.error
        assert step.current_plan is other and run.plan is plan
        step.use(plan)
        alone = step.train(ex.state, ex.batch, steps=4).wait(300)
        two = step.train(ex.state, ex.batch, steps=2).wait(300)
        step.use(other)  # what training the edited plan from step 2 on gives
        then = step.train(two.state, ex.batch, steps=2).wait(300)
        assert then.status == "finished" and then.plan is other
    finally:
        step.use(plan)
    assert [r.loss for r in run.monitor.steps()] == [r.loss for r in alone.monitor.steps()]
    assert all(np.array_equal(a, b) for a, b in zip(leaves(run.state), leaves(alone.state)))
    assert not all(np.array_equal(a, b) for a, b in zip(leaves(then.state), leaves(alone.state)))
    # the run's spans are the launch plan's two stages to the end
    assert {e.stage for e in run.monitor.snapshot().events if e.kind == "run"} == {0, 1}


def test_an_update_in_pieces_is_one_sample_per_step():
    """A stage's update run as several programs counts as one duration per step and worker (their sum)."""
    mon = RunMonitor()

    def ev(worker: int, phase: str, mb: int, step: int, start: float, end: float, kind: str = "run", stage: int = 0) -> Event:
        return Event(worker, 0, stage, kind, phase, mb, step, start, end, 8 if kind == "recv" else 0)

    mon.add_events([ev(0, "apply", -1, 0, 0.0, 5.0)])  # the compiling step: left out
    mon.add_events([
        ev(0, "forward", 0, 1, 0.0, 0.5), ev(0, "forward", 1, 1, 0.5, 1.25),
        ev(0, "apply", -1, 1, 2.0, 2.25), ev(0, "apply", -1, 1, 2.25, 2.75), ev(0, "apply", -1, 1, 3.0, 3.125),
        ev(1, "apply", -1, 1, 2.0, 2.5),  # the same mesh's worker on the other host: its own sample
        ev(0, "", 0, 1, 1.0, 1.5, kind="recv", stage=-1), ev(0, "", 0, 1, 1.5, 1.75, kind="recv", stage=-1),
    ])
    mon.add_events([ev(0, "apply", -1, 2, 4.0, 4.5), ev(0, "apply", -1, 2, 4.5, 4.75)])
    d = mon.snapshot().durations
    assert d[(0, "UPDATE", "apply")] == (0.875, 0.5, 0.75)
    assert d[(0, "RUN", "forward")] == (0.5, 0.75)  # one per micro-batch
    assert d[(0, "TRANSFER", "")] == (0.5, 0.25) and mon.snapshot().transfer_bytes[0] == (8, 8)  # one per message


def _synthetic(plan, a: float, b: float, c: float) -> Profile:
    """A profile whose measurements are exactly a x compute + b x communication + c per launch."""
    parts = pipeline_parts(plan)
    cluster = al.ClusterSpec(**plan.cluster)
    rows = []
    for (stage, kind, phase), p in sorted(parts.items()):
        if phase not in ("forward", "backward", "apply") or not (p.compute or p.communication):
            continue
        measured = a * p.compute + b * p.communication + c * p.launches
        rows.append(ProfileRow(stage, kind, phase, p, p.seconds(cluster), measured, 10))
    return Profile(plan.fingerprint, dict(plan.cluster), tuple(rows), 10, plan.estimated_step_time, 0.0)


def test_fit_recovers_known_factors_and_the_plan_predicts_what_was_measured():
    ex = tiny_example("gpt")
    step = al.parallelize(ex.train_step, cluster=al.ClusterSpec.local(1, 8), microbatches=4, layers=4)
    plan = step.plan(ex.state, ex.batch).pin_stages([[0, 1], [2, 3]], submeshes=[(1, 4), (1, 4)])
    a, b, c = 40.0, 7.0, 3e-4
    prof = _synthetic(plan, a, b, c)
    fit = prof.fit()
    # within 5%: the launches now vary per phase (a phase that makes gradient sums launches their program too), and
    # on this tiny model a phase's compute is a small share beside its launches (a quarter of a device's since its
    # matmuls are split over the 4), so the fit's weak pull toward the cluster's own numbers shows at about 4%
    # (a 10x weaker pull recovers the factors within 0.5%, checked below)
    assert fit.compute_scale == pytest.approx(a, rel=0.05) and fit.communication_scale == pytest.approx(b, rel=0.05)
    assert fit.task_overhead == pytest.approx(c, rel=0.03) and fit.residual < 0.01
    weak = prof.fit(prior_weight=1e-4)
    assert weak.compute_scale == pytest.approx(a, rel=0.005) and weak.task_overhead == pytest.approx(c, rel=0.005)
    assert Profile.from_json(prof.to_json()) == prof
    # the same stages and strategies priced with the fitted cluster predict the measurements (the model is linear
    # in the factors); left free, each stage's ILP finds strategies no worse under the measured costs
    fresh = plan.recalibrated(prof)
    pins = {o.name: o.strategy for st in plan.stages for o in st.plan.ops if o.merged_into == o.name}
    same = fresh._replan(plan._current_stages(), pins, True)
    free = fresh.pin_stages([[0, 1], [2, 3]], submeshes=[(1, 4), (1, 4)])
    by = {(r.stage, r.phase): r.measured for r in prof.rows}
    for st, st_free in zip(same.stages, free.stages):
        assert st.forward_time == pytest.approx(by[(st.index, "forward")], rel=0.01)
        assert st.backward_time == pytest.approx(by[(st.index, "backward")], rel=0.01)
        assert st_free.plan.objective <= st.plan.objective * (1 + 1e-9)  # the ILP optimum under the measured costs


def test_recalibrated_equals_planning_from_scratch_with_the_measured_costs(mlp):
    ex, step, plan = mlp
    run = step.train(ex.state, ex.batch, steps=6).wait()
    prof = run.profile()
    assert {(r.stage, r.kind, r.phase) for r in prof.rows} >= {(s, "RUN", p) for s in range(2) for p in ("forward", "backward")}
    assert "measured" in str(prof) and prof.step_measured > 0
    unpinned = dataclasses.replace(plan, stage_pins=False)  # the DP chooses the stages, as from scratch
    again = unpinned.recalibrated(prof)
    scratch = al.parallelize(ex.train_step, cluster=prof.cluster(), microbatches=4, layers=4).plan(ex.state, ex.batch)
    assert again.cluster == scratch.cluster == prof.cluster().to_dict()
    assert again._current_stages() == scratch._current_stages()
    assert [st.plan for st in again.stages] == [st.plan for st in scratch.stages]
    assert again.estimated_step_time == pytest.approx(scratch.estimated_step_time, rel=1e-12)
    # pinned stages stay pinned; the prediction changes with the measurements
    kept = plan.recalibrated(prof)
    assert kept._current_stages() == plan._current_stages() and kept.stage_pins
    assert kept.estimated_step_time != plan.estimated_step_time
    # the workbench's button: a change note with the measured and re-predicted step times
    wb = Workbench(plan, step)
    wb.runs.append(run)
    assert wb.recalibrate(run) and "measured step" in wb.changes[-1] and wb.plan is not plan
    assert step.current_plan is wb.plan and step.cluster.to_dict() == prof.cluster().to_dict()
    step.cluster, step.current_plan = LOCAL, plan


def test_bad_profiles_are_refused_with_what_to_do(mlp):
    ex, step, plan = mlp
    empty = Profile(plan.fingerprint, dict(plan.cluster), (), 0, 0.0, 0.0)
    with pytest.raises(ProfileError, match="no measurements"):
        empty.fit()
    other = dataclasses.replace(_synthetic(plan, 2, 2, 0), cluster_spec=al.ClusterSpec.local(2, 4).to_dict())
    with pytest.raises(ProfileError, match="2x4 devices but this plan is for 1x8"):
        plan.recalibrated(other)
    with pytest.raises(ProfileError, match="not a profile"):
        Profile.from_json('{"format": "something else"}')
    not_run = al.parallelize(ex.train_step, cluster=LOCAL, microbatches=4, layers=4)
    with pytest.raises(ValueError, match="no plan yet"):
        not_run.train(ex.state, ex.batch, steps=2)
    wb = Workbench(plan, step)
    assert not wb.recalibrate() and "launch one first" in wb.last_error and wb.plan is plan


def test_single_mesh_run_profile_and_recalibrate():
    ex = tiny_example("mlp")
    cluster = dataclasses.replace(al.ClusterSpec.local(1, 4), task_overhead=2e-4)  # charged only to pipeline stages
    step = al.parallelize(ex.train_step, cluster=cluster)
    plan = step.plan(ex.state, ex.batch)
    run = step.train(ex.state, ex.batch, steps=5).wait()
    prof = run.profile()
    assert [(r.kind, r.count) for r in prof.rows] == [("STEP", 4)]
    assert prof.rows[0].measured == pytest.approx(float(np.median([r.seconds for r in run.monitor.steps()[1:]])))
    # predicted as the planner did: compute + communication, no launch; so the fit leaves the launch overhead alone
    assert prof.rows[0].parts.launches == 0.0 and prof.rows[0].predicted == pytest.approx(plan.estimated_step_time, rel=1e-12)
    assert prof.fit().task_overhead == pytest.approx(cluster.task_overhead, rel=1e-9)
    new = step.recalibrate(prof)
    assert new.cluster == prof.cluster().to_dict() and step.current_plan is new
    scratch = al.parallelize(ex.train_step, cluster=prof.cluster()).plan(ex.state, ex.batch)
    assert new == scratch


def test_once_a_browser_shows_the_dashboard_one_redraw_at_a_time_is_in_flight(mlp, monkeypatch):
    """Back-pressure: a redraw is sent only when the browser drew the last one (or a cell runs, or
    it has not answered for ``max_wait``); the run's end is drawn regardless.

    The browser's side (``_Pacer``'s script acknowledging each redraw once drawn) runs in
    test_live_dashboard; here the acknowledgements are set as the kernel would receive them.
    """
    from alpa_lab.notebook import dashboard as dmod

    ex, step, plan = mlp
    monkeypatch.setattr(dmod, "_watch_cells", lambda: None)  # an IPython app another test started must not say
    monkeypatch.setattr(dmod, "_cell_running", False)

    def batches(i: int):
        time.sleep(0.005)
        return ex.batch

    def wait_for(cond, what: str, timeout: float = 60.0) -> None:
        t0 = time.monotonic()
        while not cond():
            assert time.monotonic() - t0 < timeout, f"{what} within {timeout} s"
            time.sleep(0.01)

    run = step.train(ex.state, batches, steps=100_000, start=False)
    dash = Dashboard(run, interval=0.02, max_wait=60)
    pacer = dash._pacer
    try:
        run.start()
        wait_for(lambda: run.monitor.steps_done >= 3, "3 steps")
        u = dash.updates  # no browser yet (seen = -1): every change is drawn
        wait_for(lambda: dash.updates >= u + 5, "5 redraws without a browser")
        assert dash.waits == 0
        # a browser drew all it was sent: one more redraw goes, then none until it acknowledges that one
        pacer.seen = pacer.sent
        wait_for(lambda: pacer.sent == pacer.seen + 1, "the next redraw")
        held, steps = dash.updates, run.monitor.steps_done
        wait_for(lambda: run.monitor.steps_done >= steps + 10 and dash.waits >= 5, "10 steps not drawn")
        assert dash.updates == held and pacer.sent == pacer.seen + 1
        pacer.seen = pacer.sent  # acknowledged: the next redraw shows the newest state
        wait_for(lambda: dash.updates > held, "a redraw after the acknowledgement")
        assert dash.state.steps_done >= steps + 10
        # while a cell runs, acknowledgements wait behind it in the shell: the clock paces the redraws
        monkeypatch.setattr(dmod, "_cell_running", True)
        held = dash.updates
        wait_for(lambda: dash.updates >= held + 5, "5 redraws while a cell runs")
        monkeypatch.setattr(dmod, "_cell_running", False)
        # a browser that stopped answering (its tab closed): one redraw per max_wait at most
        dash.max_wait = 0.25
        held, t0 = dash.updates, time.monotonic()
        time.sleep(2.0)
        sent, took = dash.updates - held, time.monotonic() - t0
        assert 1 <= sent <= took / 0.25 + 1, (sent, took)
        # the end of the run is drawn, acknowledged or not
        dash.max_wait = 60
        wait_for(lambda: pacer.sent > pacer.seen, "a redraw in flight")
        run.stop()
        run.wait(60)
        dash.wait(60)
        assert dash.state.status == "stopped" and dash.state.steps_done == run.monitor.steps_done
    finally:
        run.stop()
        run.wait(60)
        dash.close()


def test_a_thousand_steps_keep_the_kernel_memory_bounded():
    """1,000 short steps with the dashboard following: the monitor keeps a window, so memory stays flat.

    Bound stated: after the first 300 steps, the next 700 add less than 1 MiB of Python
    allocations (tracemalloc), and the monitor holds at most its window of events.
    """
    ex = tiny_example("mlp")
    step = al.parallelize(ex.train_step, cluster=al.ClusterSpec.local(1, 2))
    step.plan(ex.state, ex.batch)
    run = step.train(ex.state, ex.batch, steps=1000, start=False)
    dash = Dashboard(run, interval=0.1)
    tracemalloc.start()
    try:
        run.start()
        while run.monitor.steps_done < 300 and run.running:
            time.sleep(0.01)
        mid, _ = tracemalloc.get_traced_memory()
        run.wait(300)
        dash.wait(60)
        end, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert run.status == "finished" and run.monitor.steps_done == 1000
    snap = run.monitor.snapshot()
    assert len(snap.events) <= run.monitor.window_steps and dash.updates >= 3
    assert end - mid < 2**20, f"{(end - mid) / 2**10:.0f} KiB more after 700 more steps"
    assert dashboard_state(run).steps_done == 1000
    assert CostParts(1, 2, 3) + CostParts(1, 1, 1) == CostParts(2, 3, 4)


def test_a_saved_notebook_keeps_the_last_dashboard_state(mlp):
    """Shown in a notebook, the dashboard's output is replaced with its final static state when the run ends."""
    from IPython.testing import globalipapp

    ex, step, plan = mlp
    ip = globalipapp.start_ipython() or globalipapp.get_ipython()  # one IPython app per process: another test module may have started it
    published = []
    real = ip.display_pub.publish
    ip.display_pub.publish = lambda data, metadata=None, **kw: published.append((data, kw))  # records what a kernel would send
    try:
        run = step.train(ex.state, ex.batch, steps=4, start=False)
        dash = Dashboard(run)
        dash._ipython_display_()
        run.start()
        run.wait(60)
        dash.wait(60)
    finally:
        ip.display_pub.publish = real
    (first, shown), (last, updated) = published[0], published[-1]
    assert "application/vnd.jupyter.widget-view+json" in first and not shown.get("update")
    assert updated.get("update") and updated["transient"]["display_id"] == shown["transient"]["display_id"]
    assert "finished" in last["text/html"] and "step 4/4" in last["text/html"] and "<script" not in last["text/html"]
    assert "finished" not in first["text/html"]
