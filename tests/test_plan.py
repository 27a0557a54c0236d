"""Plans as data: pins, diffs, explanations, JSON, and every bad-input path.

Each error path checks two things: the message says what was wrong and what to do, and
nothing is lost (the plan that worked is still current and still runs).
"""

import dataclasses
import json

import jax
import numpy as np
import pytest

import alpa_lab as al
from alpa_lab.models import MLPConfig, make_mlp, tiny_example

CFG = MLPConfig(batch=16, in_dim=32, hidden=64, layers=2, out_dim=16)


@pytest.fixture(scope="module")
def example():
    return make_mlp(CFG)


@pytest.fixture()
def step_and_plan(example):
    step = al.parallelize(example.train_step, cluster=al.ClusterSpec.local(1, 4), mesh_shape=(2, 2))
    plan = step.plan(*example.args)
    return step, plan


def first_dot(plan):
    return next(o for o in plan.ops if o.primitive == "dot_general")


def other_strategy(plan, name):
    chosen = plan.op(name).strategy
    alts = [a.strategy for a in plan.explain(name).alternatives]
    return next(s for s in alts if s != chosen)


def test_pin_resolves_and_diff_lists_the_change(step_and_plan):
    step, plan = step_and_plan
    dot = first_dot(plan).name
    target = other_strategy(plan, dot)
    plan2 = plan.pin(op=dot, strategy=target)
    assert plan2.op(dot).strategy == target
    assert dict(plan2.pins) == {dot: target}
    assert plan.op(dot).strategy != target  # the old plan is untouched
    d = plan2.diff(plan)
    assert any(c.name == dot and c.after == target for c in d.changes)
    assert d.time_after >= d.time_before - 1e-12  # the unpinned plan was optimal
    assert dot in str(d) and "pinned" in str(d)
    back = plan2.unpin(dot)
    assert back.objective == pytest.approx(plan.objective, rel=1e-9)


def test_pinned_plan_runs_and_matches_unsharded(step_and_plan, example):
    step, plan = step_and_plan
    dot = first_dot(plan).name
    step.use(plan.pin(dot, other_strategy(plan, dot)))
    state, loss = step(*example.args)
    ref_state, ref_loss = jax.jit(example.train_step)(*example.args)
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=2e-4)
    for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(ref_state)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-4, atol=2e-5)


def test_pin_by_operand_specs_alone(step_and_plan):
    _, plan = step_and_plan
    dot = first_dot(plan).name
    full = other_strategy(plan, dot)
    if " = " not in full:
        pytest.skip("not a dot strategy name")
    short = full.split(" = ")[1]
    assert plan.pin(dot, short).op(dot).strategy == full


def test_explain_lists_every_alternative_with_costs(step_and_plan):
    _, plan = step_and_plan
    dot = first_dot(plan).name
    exp = plan.explain(dot)
    assert len(exp.alternatives) == plan.op(dot).num_strategies
    chosen = [a for a in exp.alternatives if a.chosen]
    assert len(chosen) == 1 and chosen[0].strategy == plan.op(dot).strategy
    # with its neighbours fixed, the chosen strategy is the cheapest (the ILP's optimum is
    # a local optimum too, unless the op is merged with others that it must move with)
    if exp.merged_into == dot:
        assert chosen[0].total <= min(a.total for a in exp.alternatives) + 1e-12
    assert "chose" in str(exp)


def test_save_and_load_round_trip(step_and_plan, tmp_path, example):
    step, plan = step_and_plan
    path = tmp_path / "p.json"
    plan.save(path)
    loaded = al.Plan.load(path)
    assert loaded == plan  # equality ignores the attached planner state
    assert loaded.problem is None
    with pytest.raises(al.PlanFormatError, match="step.use"):
        loaded.pin(first_dot(plan).name, "RR = RR x RR")
    attached = step.use(loaded, *example.args)
    assert attached.problem is not None
    state, loss = step(*example.args)
    assert np.isfinite(float(loss))


def test_unknown_op_in_pin_is_clear_and_keeps_plan(step_and_plan):
    step, plan = step_and_plan
    with pytest.raises(al.PinError, match="no op or argument named 'dot_general_999'.*did you mean"):
        step.pin("dot_general_999", "RR = RR x RR")
    assert step.current_plan is plan


def test_strategy_that_does_not_apply_is_clear_and_keeps_plan(step_and_plan):
    step, plan = step_and_plan
    dot = first_dot(plan).name
    with pytest.raises(al.PinError, match=f"op '{dot}' has no strategy 'S0S0 = nonsense'; its strategies are"):
        step.pin(dot, "S0S0 = nonsense")
    assert step.current_plan is plan


def test_conflicting_pins_name_the_conflict_and_keep_plan(step_and_plan, example):
    step, plan = step_and_plan
    # a follower op and its leader pinned in incompatible ways: find a merged op
    merged = next(o for o in plan.ops if o.merged_into != o.name and o.num_strategies > 1)
    leader = merged.merged_into
    sg = plan.problem
    n, lead = sg.node_index(merged.name), sg.node_index(leader)
    # leader strategy r forces the follower's strategy member_map[n][r]; pick a clash
    r = 0
    forced = int(sg.member_map[n][r])
    clash = next(s.name for j, s in enumerate(sg.nodes[n].strategies) if j != forced and j in set(map(int, sg.member_map[n])))
    with pytest.raises(al.PinError, match="cannot hold together") as info:
        step.pin(leader, sg.nodes[lead].strategies[int(sg.member_map[lead][r])].name)
        step.pin(merged.name, clash)
    assert set(info.value.pins) == {leader, merged.name}
    # the first pin succeeded and became current; the failed one changed nothing
    assert dict(step.current_plan.pins) == {leader: sg.nodes[lead].strategies[int(sg.member_map[lead][r])].name}
    state, loss = step(*example.args)
    assert np.isfinite(float(loss))


def test_memory_budget_is_honoured_and_conflicting_pins_are_named():
    ex = make_mlp(MLPConfig(batch=64, in_dim=256, hidden=512, layers=2, out_dim=256), abstract=True)
    cluster = al.ClusterSpec.local(1, 4)
    free = al.parallelize(ex.train_step, cluster=cluster, mesh_shape=(1, 4)).plan(*ex.args)
    state = [t for t in free.inputs if not t.path.startswith("[1]")]
    sg = free.problem
    floor = sum(float(m.min()) for m in sg.cost_graph.node_memory)  # every group at its smallest
    extra = sum(np.prod(t.shape, dtype=np.int64) * 4 * (1 - 1 / 4) for t in state if t.shape)
    budget = floor + 0.5 * extra  # feasible, but not with the whole state on every device
    step = al.parallelize(ex.train_step, cluster=cluster, mesh_shape=(1, 4), memory_budget=budget)
    plan = step.plan(*ex.args)
    assert plan.memory_per_device <= budget
    pins = {t.path: "R" * len(t.shape) for t in state if t.shape}
    with pytest.raises(al.PinError, match="cannot hold together within the memory budget") as info:
        step.current_plan.pin(pins=pins)
    assert info.value.pins and set(info.value.pins) <= set(pins)
    # the named pins alone really are infeasible, and dropping any one of them is feasible
    named = {k: pins[k] for k in info.value.pins}
    with pytest.raises(al.PinError):
        plan.pin(pins=named)
    drop = next(iter(named))
    plan.pin(pins={k: v for k, v in named.items() if k != drop})
    assert step.current_plan is plan
    with pytest.raises(al.InfeasibleError, match="memory"):
        al.parallelize(ex.train_step, cluster=cluster, mesh_shape=(1, 4), memory_budget=1.0).plan(*ex.args)


def test_primitive_without_rule_is_planned_replicated_and_reported():
    def step_fn(w, x):
        def body(c):
            i, y = c
            return i + 1, y @ w

        _, y = jax.lax.while_loop(lambda c: c[0] < 3, body, (0, x))
        return w - 0.01 * jax.numpy.mean(y), jax.numpy.sum(y)

    w, x = jax.numpy.eye(8), jax.numpy.ones((16, 8))
    step = al.parallelize(step_fn, cluster=al.ClusterSpec.local(1, 4), mesh_shape=(1, 4))
    plan = step.plan(w, x)
    assert plan.unplanned_primitives == ("while",)
    assert "no sharding rule (planned replicated): while" in plan.summary()
    loop = next(o for o in plan.ops if o.primitive == "while")
    assert loop.strategy == "replicated (no rule for while)"
    new_w, total = step(w, x)
    ref_w, ref_total = step_fn(w, x)
    np.testing.assert_allclose(np.asarray(new_w), np.asarray(ref_w), rtol=1e-6)
    np.testing.assert_allclose(float(total), float(ref_total), rtol=1e-6)


def test_corrupt_and_foreign_plan_json(step_and_plan, tmp_path, example):
    step, plan = step_and_plan
    bad = tmp_path / "bad.json"
    bad.write_text(plan.to_json()[: len(plan.to_json()) // 2])
    with pytest.raises(al.PlanFormatError, match="not valid JSON"):
        al.Plan.load(bad)
    bad.write_text(json.dumps({"hello": 1}))
    with pytest.raises(al.PlanFormatError, match="not an alpa_lab plan"):
        al.Plan.load(bad)
    data = json.loads(plan.to_json())
    data["schema_version"] = 999
    bad.write_text(json.dumps(data))
    with pytest.raises(al.PlanFormatError, match="schema version 999"):
        al.Plan.load(bad)
    data = json.loads(plan.to_json())
    del data["ops"]
    bad.write_text(json.dumps(data))
    with pytest.raises(al.PlanFormatError, match="missing or has malformed"):
        al.Plan.load(bad)
    data = json.loads(plan.to_json())
    data["batch_mesh_axis"] = 2  # force_batch_dim_to_mesh_dim names a mesh axis, 0 or 1
    bad.write_text(json.dumps(data))
    with pytest.raises(al.PlanFormatError, match="batch_mesh_axis must be 0 or 1, got 2"):
        al.Plan.load(bad)
    with pytest.raises(al.PlanFormatError, match="cannot read plan file"):
        al.Plan.load(tmp_path / "missing.json")
    # a plan of another program (other shapes) is refused, and the current plan stays
    other = make_mlp(MLPConfig(batch=16, in_dim=32, hidden=128, layers=2, out_dim=16))
    other_plan = al.parallelize(other.train_step, cluster=al.ClusterSpec.local(1, 4), mesh_shape=(2, 2)).plan(*other.args)
    with pytest.raises(al.PlanFormatError, match="belongs to another program"):
        step.use(other_plan, *example.args)
    assert step.current_plan is plan


def test_a_cluster_given_as_text_plans_as_its_spec(example):
    """``cluster="local:1x4"`` (the text ``alpa-lab demo --cluster`` and ``%%parallelize`` take) plans as
    ``ClusterSpec.local(1, 4)``, pipelined too; anything else that is not a cluster is refused by name."""
    by_text = al.parallelize(example.train_step, cluster="local:1x4").plan(*example.args)
    by_spec = al.parallelize(example.train_step, cluster=al.ClusterSpec.local(1, 4)).plan(*example.args)
    assert by_text.cluster == by_spec.cluster and by_text.mesh_shape == by_spec.mesh_shape
    assert [(o.name, o.strategy) for o in by_text.ops] == [(o.name, o.strategy) for o in by_spec.ops]
    piped = al.parallelize(example.train_step, cluster="local:2x4", microbatches=2, layers=2).plan(*example.args)
    assert (piped.cluster["hosts"], piped.cluster["devices_per_host"]) == (2, 4)
    assert al.parallelize(example.train_step, cluster="p3.16xlarge:2").plan(*example.args).cluster["name"] == "p3.16xlarge:2"
    with pytest.raises(al.ClusterError, match="unknown cluster 'tpu:8'.*local:HOSTSxDEVICES"):
        al.parallelize(example.train_step, cluster="tpu:8")
    with pytest.raises(al.ClusterError, match="cluster= takes a ClusterSpec .* got int 8"):
        al.parallelize(example.train_step, cluster=8)


def test_a_memory_budget_may_be_written_as_a_size(example):
    """``memory_budget="40KB"`` is 40e3 bytes per device and ``"512KiB"`` 512 * 2**10 (as people write sizes);
    what is not a positive size is refused by name, before any planning."""
    from alpa_lab.cost.cluster import parse_bytes

    assert (parse_bytes("16GB"), parse_bytes(" 512 MiB "), parse_bytes("1.5e3kb"), parse_bytes(7)) == (16e9, 512 * 2**20, 1.5e6, 7.0)
    cluster = al.ClusterSpec.local(1, 4)
    as_text = al.parallelize(example.train_step, cluster=cluster, memory_budget="2MB")
    as_number = al.parallelize(example.train_step, cluster=cluster, memory_budget=2e6)
    assert as_text.memory_budget == 2e6
    a, b = as_text.plan(*example.args), as_number.plan(*example.args)
    assert [(o.name, o.strategy) for o in a.ops] == [(o.name, o.strategy) for o in b.ops] and a.memory_per_device <= 2e6
    for bad, why in (("lots", "got 'lots'"), ("16 parsecs", "got '16 parsecs'"), (-1, "must be a positive"), ("0GB", "must be a positive"),
                     (True, "got bool True"), ([16], "got list")):
        with pytest.raises(ValueError, match=why):
            al.parallelize(example.train_step, cluster=cluster, memory_budget=bad)


def test_bad_cluster_and_mesh_are_clear(example):
    with pytest.raises(al.ClusterError, match="does not hold 4 devices"):
        al.parallelize(example.train_step, cluster=al.ClusterSpec.local(1, 4), mesh_shape=(3, 2))
    # a grid smaller than the devices: say how to plan for that many
    with pytest.raises(al.ClusterError, match=r"does not hold 8 devices.*or plan for 4 of them: cluster='local:1x4'"):
        al.parallelize(example.train_step, cluster=al.ClusterSpec.local(2, 4), mesh_shape=(2, 2))
    with pytest.raises(al.ClusterError, match=r"does not hold 16 devices.*part\(hosts, devices_per_host\)"):
        al.parallelize(example.train_step, cluster="p3.8xlarge:4", mesh_shape=(2, 2))
    with pytest.raises(al.ClusterError, match="unknown cluster preset"):
        al.ClusterSpec.preset("p9.mega")
    with pytest.raises(al.MethodError, match="unknown planning method"):
        al.parallelize(example.train_step, method="magic")
    step = al.parallelize(example.train_step, cluster=al.ClusterSpec.local(4, 4))
    plan = step.plan(*example.args)
    from alpa_lab.runtime.apply import DeviceError

    with pytest.raises(DeviceError, match="JAX sees 8"):
        step(*example.args)
    assert step.current_plan is plan


def test_untraceable_function_is_clear():
    def broken(x):
        return float(x) * 2  # concretises a tracer

    step = al.parallelize(broken, cluster=al.ClusterSpec.local(1, 4))
    with pytest.raises(al.TraceError, match="could not trace 'broken'"):
        step.plan(jax.numpy.ones(4))
    assert step.current_plan is None


def test_an_argument_jax_cannot_take_is_named_and_nothing_is_planned(example):
    step = al.parallelize(example.train_step, cluster=al.ClusterSpec.local(1, 4))
    with pytest.raises(al.TraceError, match=r"argument \[1\]\['tag'\]: a str \('train'\) is not an array, number or bool"):
        step(example.state, {**example.batch, "tag": "train"})
    assert step.current_plan is None


def test_calling_with_other_shapes_plans_them_unless_the_plan_is_the_users(step_and_plan, example):
    """As ``jax.jit`` traces again: a plan the step made itself (``step.plan``, a first call) is re-made for
    other shapes (the last, smaller batch of an epoch), kept per shapes; a plan the user edited, pinned or
    loaded belongs to its program, so other shapes are refused and it stays current."""
    step, plan = step_and_plan
    step(*example.args)
    small = make_mlp(dataclasses.replace(CFG, batch=CFG.batch // 2))  # the same model, a smaller batch
    state, loss = step(small.state, small.batch)
    ref_state, ref_loss = jax.jit(small.train_step)(small.state, small.batch)
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=2e-4, atol=2e-5)
    smaller = step.current_plan
    assert smaller is not plan and smaller.fingerprint == step.trace(small.state, small.batch).fingerprint
    step(*example.args)  # back to the first shapes: their plan again, not planned anew
    assert step.current_plan is plan
    step(small.state, small.batch)
    assert step.current_plan is smaller
    # a run takes the step's kept plan for its shapes (the full batch after the smaller one), plans none anew
    run = step.train(*example.args, steps=1).wait(120)
    assert run.status == "finished" and step.current_plan is plan and run.plan is plan
    step(small.state, small.batch)
    other_batch = make_mlp(dataclasses.replace(CFG, batch=CFG.batch // 4))  # shapes never called: no plan kept
    run = step.train(other_batch.state, other_batch.batch, steps=1).wait(120)
    assert run.status == "failed" and "belongs to another program" in str(run.error) and step.current_plan is smaller
    edited = step.use(plan.pin(first_dot(plan).name, other_strategy(plan, first_dot(plan).name)))
    other = make_mlp(MLPConfig(batch=32, in_dim=32, hidden=64, layers=2, out_dim=16))
    with pytest.raises(al.PlanFormatError, match="belongs to another program"):
        step(*other.args)
    assert step.current_plan is edited
    state, loss = step(*example.args)
    assert np.isfinite(float(loss))


def test_alternating_shapes_compile_once_each(example):
    """As ``jax.jit`` caches per shapes: an epoch's full and last, smaller batch alternate without compiling
    again (the same compiled program comes back)."""
    for kw in ({"mesh_shape": (2, 2)}, {"microbatches": 2, "layers": 2}):
        step = al.parallelize(example.train_step, cluster=al.ClusterSpec.local(1, 4), **kw)
        small = make_mlp(dataclasses.replace(CFG, batch=CFG.batch // 2))
        step(*example.args)
        big_program = step.compiled(*example.args)
        step(small.state, small.batch)
        small_program = step.compiled(small.state, small.batch)
        assert small_program is not big_program
        for _ in range(2):
            _, loss = step(*example.args)
            assert step.compiled(*example.args) is big_program, kw  # not compiled again
            _, small_loss = step(small.state, small.batch)
            assert step.compiled(small.state, small.batch) is small_program, kw
        ref = [float(jax.jit(e.train_step)(*e.args)[1]) for e in (example, small)]
        np.testing.assert_allclose([float(loss), float(small_loss)], ref, rtol=2e-4, atol=2e-5)


@pytest.mark.slow  # plans and compiles 2 x (TRACES_KEPT + 3) shapes: about 40 s here
def test_a_step_called_with_many_shapes_keeps_a_bounded_number_of_them(example):
    """A step called with many shapes keeps the newest ``TRACES_KEPT`` of their traces, planner states and
    programs, not all of them; the oldest comes back traced, planned and compiled again."""
    from alpa_lab.api import TRACES_KEPT
    from alpa_lab.graph.trace import args_signature

    for kw in ({"mesh_shape": (2, 2)}, {"microbatches": 2, "layers": 2}):
        step = al.parallelize(example.train_step, cluster=al.ClusterSpec.local(1, 4), **kw)
        first = make_mlp(dataclasses.replace(CFG, batch=4))
        for batch in range(4, 4 + 4 * (TRACES_KEPT + 2), 4):
            step(*make_mlp(dataclasses.replace(CFG, batch=batch)).args)
        assert len(step._graphs) == len(step._compiled) == TRACES_KEPT and len(step._own_plans) == TRACES_KEPT
        assert len(step._splits) <= TRACES_KEPT and len(step._problems) <= TRACES_KEPT
        oldest = (args_signature(first.args), ())  # the traces' key: shapes, and no static arguments
        assert oldest not in step._graphs  # the least recently used shapes went first
        _, loss = step(*first.args)  # and come back: traced, planned and compiled again
        assert oldest in step._graphs and len(step._graphs) == TRACES_KEPT
        np.testing.assert_allclose(float(loss), float(jax.jit(first.train_step)(*first.args)[1]), rtol=2e-4, atol=2e-5)


def test_pins_survive_saving_and_retracing(step_and_plan, tmp_path, example):
    _, plan = step_and_plan
    dot = first_dot(plan).name
    target = other_strategy(plan, dot)
    pinned = plan.pin(dot, target)
    pinned.save(tmp_path / "pinned.json")
    # a new step traces the program again; op names are stable, so the pin still applies
    fresh = al.parallelize(example.train_step, cluster=al.ClusterSpec.local(1, 4), mesh_shape=(2, 2))
    loaded = fresh.use(al.Plan.load(tmp_path / "pinned.json"), *example.args)
    assert dict(loaded.pins) == {dot: target} and loaded.op(dot).strategy == target
    resolved = loaded.unpin(dot).pin(dot, target)  # the reattached plan can be edited
    assert resolved.op(dot).strategy == target
    assert resolved.objective == pytest.approx(pinned.objective, rel=1e-9)
    state, loss = fresh(*example.args)
    assert np.isfinite(float(loss))


def test_megatron_with_one_tensor_parallel_device_says_it_is_data_parallel():
    ex = tiny_example("mlp")
    step = al.parallelize(ex.train_step, cluster=al.ClusterSpec.local(1, 4), method="megatron", mesh_shape=(4, 1))
    assert "this Megatron plan is data parallelism" in step.plan(ex.state, ex.batch).summary()
    wide = al.parallelize(ex.train_step, cluster=al.ClusterSpec.local(1, 4), method="megatron", mesh_shape=(1, 4))
    assert "data parallelism" not in wide.plan(ex.state, ex.batch).summary()
