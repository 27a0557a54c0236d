"""Pipelined execution and the two-level plan (issue 3): slicing, numerics, edits, bad input.

The reference for numerics is plain JAX on one device, written here from the model's own
loss and optimizer: the step as gradient accumulation over the same micro-batches (mean
of the micro-batch losses, gradients and batch statistics, then one optimizer update).
For models whose loss does not couple examples of a batch (MLP, GPT) that is also the
full-batch step, which is checked too; BatchNorm (Wide-ResNet) couples them, so there
micro-batching changes the maths and only the accumulation reference applies.

Tolerance: rtol 1e-4 and atol 1e-5 on losses, atol 5e-5 (``STATE_ATOL``) on every parameter/optimizer
leaf after 3 steps. Sharding and micro-batching sum float32 values in other orders (relative error
~1e-6 per reduction); Adam's update m / sqrt(v) turns that into ~1e-6 absolute per step, and
into up to 3e-5 for a gradient element near zero (lr x sign(g) on its first step): the tiny GPT,
its matmuls split over every device, has one such element of 16384 in a kernel.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import alpa_lab as al
from alpa_lab.graph.markers import auto_layers
from alpa_lab.graph.opgraph import OpGraph
from alpa_lab.models import TrainState, tiny_example
from alpa_lab.passes.inter_op import InterOpError
from alpa_lab.passes.stages import APPLY, BACKWARD, FORWARD, SlicingError, slice_program
from alpa_lab.runtime.pipeline import PipelineRunError

RTOL, ATOL = 1e-4, 1e-5
STATE_ATOL = 5e-5
LOCAL = al.ClusterSpec.local(hosts=2, devices_per_host=4)
MODELS = ["mlp", "gpt", "wide_resnet", "moe"]
SCHEDULES = ["gpipe", "1f1b", "eager_1f1b", "zb_h1"]
MICROBATCHES = 4
STEPS = 3


def split(batch, m: int):
    n = jax.tree_util.tree_leaves(batch)[0].shape[0] // m
    return [jax.tree_util.tree_map(lambda x: x[i * n : (i + 1) * n], batch) for i in range(m)]


def accumulated_step(ex, m: int):
    """The independent reference: one device, plain JAX, gradient accumulation over m."""

    @jax.jit
    def step(state: TrainState, batch):
        vg = jax.value_and_grad(ex.loss_fn, has_aux=True)
        outs = [vg(state.params, state.model_state, mb) for mb in split(batch, m)]
        mean = lambda *xs: sum(xs) / m  # noqa: E731
        loss = mean(*[o[0][0] for o in outs])
        model_state = jax.tree_util.tree_map(mean, *[o[0][1] for o in outs])
        grads = jax.tree_util.tree_map(mean, *[o[1] for o in outs])
        updates, opt_state = ex.optimizer.update(grads, state.opt_state, state.params)
        return TrainState(optax.apply_updates(state.params, updates), opt_state, model_state), loss

    return step


def assert_close(a, b, what: str, atol: float = ATOL) -> None:
    for (path, x), y in zip(jax.tree_util.tree_flatten_with_path(a)[0], jax.tree_util.tree_leaves(b)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=RTOL, atol=atol, err_msg=f"{what}: {jax.tree_util.keystr(path)}")


def trains_like_reference(step, ex, reference, what: str, state_atol: float = STATE_ATOL):
    """Run ``STEPS`` steps; each loss and state equals the reference's (rtol/atol above). The last state."""
    state = ex.state
    for k in range(STEPS):
        state, loss = step(state, ex.batch)
        ref_state, ref_loss = reference[k]
        assert_close(loss, ref_loss, f"{what} step {k} loss")
        assert_close(state, ref_state, f"{what} step {k} state", atol=state_atol)
    return state


def layered_graph(name: str, layers: int = 4) -> OpGraph:
    ex = tiny_example(name)
    with auto_layers(layers):
        return al.trace(ex.train_step, *ex.args)


# ----- slicing ---------------------------------------------------------------------------------
@pytest.mark.parametrize("name", MODELS)
def test_slicing_respects_the_pipeline_dataflow(name):
    """Forward flows to later layers, backward to earlier ones, the update reads only what it may."""
    graph = layered_graph(name)
    sl = slice_program(graph)
    assert sl.num_layers == 4
    assert set(sl.phase) == {FORWARD, BACKWARD, APPLY}
    for phase in (FORWARD, BACKWARD):
        assert {sl.layer[i] for i, p in enumerate(sl.phase) if p == phase} <= set(range(4))
    for op in graph.ops:
        for v in op.inputs:
            p = graph.vars[v].producer
            if p is None:
                continue
            src, dst = (sl.phase[p], sl.layer[p]), (sl.phase[op.index], sl.layer[op.index])
            assert not (src[0] == FORWARD == dst[0] and src[1] > dst[1]), (op.name, src, dst)
            assert not (src[0] == BACKWARD == dst[0] and src[1] < dst[1]), (op.name, src, dst)
            assert not (src[0] == BACKWARD and dst[0] == FORWARD), op.name
            assert not (src[0] == APPLY and dst[0] != APPLY), op.name
    # every gradient is accumulated; the loss (a result) too
    grads = [op for op in graph.ops if op.primitive == "pipeline_marker" and op.params["kind"] == "gradient"]
    for g in grads:
        if sl.phase[g.index] == BACKWARD:  # accumulated over micro-batches where it is computed
            assert g.outputs[0] in sl.accumulated
        else:  # a tied weight: its per-layer contributions are accumulated, then summed once per step
            assert sl.phase[g.index] == APPLY
            add = graph.ops[graph.vars[g.inputs[0]].producer]
            assert add.primitive in ("add_any", "add") and sl.phase[add.index] == APPLY
            assert all(v in sl.accumulated for v in add.inputs)
            assert len({sl.layer[graph.vars[v].producer] for v in add.inputs}) > 1
    if name == "gpt":  # tied embeddings: the one gradient summed in the update
        assert sum(sl.phase[g.index] == APPLY for g in grads) == 1
    loss = graph.outvars[-1]
    assert loss in sl.accumulated


def test_slicing_needs_alpa_value_and_grad():
    def step(w, x):
        loss, g = jax.value_and_grad(lambda w: jnp.mean((x @ w) ** 2))(w)
        return w - 0.1 * g, loss

    graph = al.trace(step, jnp.ones((4, 4)), jnp.ones((8, 4)))
    with pytest.raises(SlicingError, match="alpa_lab.value_and_grad"):
        slice_program(graph)


def test_hand_placed_boundaries_define_the_layers():
    def loss_fn(p, x):
        h = jnp.tanh(x @ p["a"])
        h = al.mark_stage_boundary(h)
        h = jnp.tanh(h @ p["b"])
        h = al.mark_stage_boundary(h)
        return jnp.mean((h @ p["c"]) ** 2)

    def step(p, x):
        loss, g = al.value_and_grad(loss_fn)(p, x)
        return jax.tree_util.tree_map(lambda a, b: a - 0.1 * b, p, g), loss

    p = {k: jnp.ones((8, 8)) * 0.1 for k in "abc"}
    with auto_layers(8):  # hand-placed boundaries win over automatic layering
        graph = al.trace(step, p, jnp.ones((16, 8)))
    sl = slice_program(graph)
    assert sl.num_layers == 3
    dots = [op for op in graph.ops if op.primitive == "dot_general"]
    fwd = [sl.layer[op.index] for op in dots if sl.phase[op.index] == FORWARD]
    assert fwd == [0, 1, 2]
    bwd = sorted(sl.layer[op.index] for op in dots if sl.phase[op.index] == BACKWARD)
    assert bwd == [0, 1, 1, 2, 2]  # dW for each layer, dX for layers 1 and 2 (x needs none)


# ----- numerics --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def pipelined_steps():
    """One planned step per model (4 layers, DP plan); stage pins are applied per test."""
    out = {}
    for name in MODELS:
        ex = tiny_example(name)
        step = al.parallelize(ex.train_step, cluster=LOCAL, microbatches=MICROBATCHES, layers=4)
        step.plan(*ex.args)
        out[name] = step
    return out


STAGINGS = {2: [[0, 1], [2, 3]], 4: [[0, 0], [1, 1], [2, 2], [3, 3]]}


@pytest.mark.parametrize(("name", "stages"), [
    *((name, 2) for name in MODELS),
    ("mlp", 4), ("gpt", 4),  # MoE's and Wide-ResNet's four stages (13-19 s each here) run with `make test-slow`
    *(pytest.param(name, 4, marks=pytest.mark.slow) for name in ("wide_resnet", "moe")),
])
def test_pipelined_training_equals_unpipelined(name, stages, pipelined_steps, references):
    ex = tiny_example(name)
    step = pipelined_steps[name]
    base = step.current_plan.pin_stages(STAGINGS[stages])
    assert base.num_stages == stages
    assert sorted(d for st in base.stages for d in st.device_ids) == list(range(8))  # sub-meshes tile 2x4
    for schedule in SCHEDULES:
        step.use(base.with_schedule(schedule))
        state = trains_like_reference(step, ex, references[name], f"{name} {stages} stages {schedule}")
        # each stage's weights live on its own sub-mesh
        leaves = jax.tree_util.tree_leaves(state.params)
        assert len({frozenset(d.id for d in x.devices()) for x in leaves}) > 1


@pytest.mark.parametrize("name", ["mlp", "gpt"])
def test_microbatching_a_mean_loss_is_the_full_batch_step(name, references):
    """For losses that do not couple examples, accumulation == the plain full-batch step.

    atol 5e-5 on the state: the full batch sums gradients in another order than four
    micro-batches, and Adam normalises each gradient element, so an element near zero can
    move its update by a few percent of the learning rate (1e-3): seen 1.5e-5 on 1 of 16k.
    """
    ex = tiny_example(name)
    state, loss = jax.jit(ex.train_step)(*ex.args)
    assert_close(loss, references[name][0][1], "loss")
    assert_close(state, references[name][0][0], "state", atol=5e-5)


def test_the_planned_pipeline_runs_as_planned(pipelined_steps, references):
    """The DP's own choice (not pinned) also trains correctly."""
    ex = tiny_example("gpt")
    step = al.parallelize(ex.train_step, cluster=LOCAL, microbatches=MICROBATCHES, layers=4)
    plan = step.plan(*ex.args)
    assert plan.num_stages >= 1 and plan.estimated_step_time > 0
    state, loss = step(*ex.args)
    assert_close(loss, references["gpt"][0][1], "loss")
    assert_close(state, references["gpt"][0][0], "state")


# ----- the plan ----------------------------------------------------------------------------------
def test_plan_figures_follow_the_paper(pipelined_steps):
    plan = pipelined_steps["gpt"].current_plan.pin_stages(STAGINGS[2]).with_schedule("1f1b")
    times = [st.forward_time + st.backward_time for st in plan.stages]
    assert plan.latency == pytest.approx(sum(times) + (MICROBATCHES - 1) * max(times))  # eq. 2
    for st in plan.stages:  # eq. 5 with 1F1B's in-flight count S - i
        assert st.in_flight == min(plan.num_stages - st.index, MICROBATCHES)
        assert st.memory_per_device == pytest.approx(st.weight_memory + st.in_flight * st.activation_memory)
    assert plan.memory_per_device == max(st.memory_per_device for st in plan.stages)
    gpipe = plan.with_schedule("gpipe")
    assert all(st.in_flight == MICROBATCHES for st in gpipe.stages)
    assert "stage" in plan.summary() and "1f1b" in plan.summary()


def test_each_boundary_is_simulated_on_its_own_link(pipelined_steps):
    """4 stages of 2 devices on 2 hosts of 4: boundary 1 crosses hosts, 0 and 2 stay inside one.
    Each boundary's transfer is the heavier direction of the tensors the plan moves across it
    per micro-batch (the Traffic view's list; each tensor's own size, once) over that link, and
    the simulation uses it."""
    from alpa_lab.passes.transfers import pipeline_transfers

    plan = pipelined_steps["mlp"].current_plan.pin_stages(STAGINGS[4]).with_schedule("1f1b")
    c = LOCAL
    assert plan.cluster == c.to_dict()
    hosts = [{d // c.devices_per_host for d in st.device_ids} for st in plan.stages]
    assert hosts == [{0}, {0}, {1}, {1}]
    moved = [t for t in pipeline_transfers(plan) if t.per_microbatch]

    def size(t) -> int:
        return int(np.prod(t.shape)) * np.dtype(t.dtype).itemsize
    expect = []
    for b in range(3):
        forward = sum(size(t) for t in moved if t.src_stage == b and t.dst_stage > b)
        backward = sum(size(t) for t in moved if t.dst_stage == b and t.src_stage > b)
        assert forward > 0 and backward > 0
        bandwidth = c.intra_host_bandwidth if hosts[b] == hosts[b + 1] else c.inter_host_bandwidth
        expect.append(max(forward, backward) / bandwidth + c.transfer_overhead)
    assert plan.timeline.transfer_times == pytest.approx(expect, rel=1e-9)
    assert plan.timeline.transfer_times[1] > max(plan.timeline.transfer_times[0], plan.timeline.transfer_times[2])
    assert plan.timeline.transfer_time == max(expect)
    # the simulated 1F1B makes the slow link wait longer than the fast ones
    for r in plan.timeline.records:
        if r.kind == "RECV":
            peer = r.stage - 1 if r.phase == FORWARD else r.stage + 1
            send = next(x for x in plan.timeline.records if x.kind == "SEND" and x.stage == peer
                        and x.phase == r.phase and x.microbatch == r.microbatch)
            assert r.start >= send.start + plan.timeline.link_time(min(peer, r.stage)) - 1e-12
    again = al.PipelinePlan.from_json(plan.to_json())
    assert again.timeline.transfer_times == plan.timeline.transfer_times


def test_pin_in_one_stage_replans_only_that_stage(pipelined_steps):
    plan = pipelined_steps["mlp"].current_plan.pin_stages(STAGINGS[2])
    # a dot in stage 1 pinned to another strategy
    st1 = plan.stages[1].plan
    op = next(o for o in st1.ops if o.primitive == "dot_general" and o.num_strategies > 1)
    other = next(e.strategy for e in st1.explain(op.name).alternatives if e.strategy != op.strategy)
    pinned = plan.pin(op.name, other)
    assert pinned.stages[1].plan.op(op.name).strategy == other
    assert pinned.stages[0].plan is plan.stages[0].plan  # untouched stage: cached, not re-solved
    assert "stage 1" in pinned.diff(plan)
    assert pinned.unpin(op.name).stages[1].plan.op(op.name).strategy == op.strategy


def test_pin_stages_changes_boundaries_and_says_so(pipelined_steps):
    plan = pipelined_steps["mlp"].current_plan
    a = plan.pin_stages([[0, 1], [2, 3]], submeshes=[(1, 4), (1, 4)])
    b = a.pin_stages([[0, 2], [3, 3]])
    assert [st.layers for st in b.stages] == [(0, 3), (3, 4)]
    assert "layers 0..1" in b.diff(a) and "layers 0..2" in b.diff(a)


# ----- bad input -------------------------------------------------------------------------------
def test_microbatches_must_divide_the_batch():
    ex = tiny_example("mlp")
    step = al.parallelize(ex.train_step, cluster=LOCAL, microbatches=3, layers=2)
    with pytest.raises(ValueError, match="does not divide the batch size"):
        step.plan(*ex.args)
    assert step.current_plan is None


@pytest.mark.parametrize(
    "layers, submeshes, match",
    [
        ([[0, 0], [1, 1], [2, 2], [3, 3], [4, 4]], None, "program has 4 layers"),  # more stages than layers
        ([[0, 1], [3, 3]], None, "covering layers 0..3 in order"),
        ([[0, 1], [2, 3]], [(1, 4), (1, 2)], "sub-meshes|tile|cannot"),
        ([[0, 1], [2, 3]], [(1, 3), (1, 5)], "not one of the shapes"),
    ],
)
def test_bad_stage_pins_are_refused_and_keep_the_plan(pipelined_steps, layers, submeshes, match):
    step = pipelined_steps["mlp"]
    before = step.current_plan
    with pytest.raises(InterOpError, match=match):
        before.pin_stages(layers, submeshes=submeshes)
    assert step.current_plan is before


def test_pinned_stages_that_do_not_fit_memory():
    ex = tiny_example("gpt")
    small = dataclasses.replace(LOCAL, device_memory=3e5)  # 300 KB per device
    step = al.parallelize(ex.train_step, cluster=small, microbatches=MICROBATCHES, layers=4)
    with pytest.raises(InterOpError, match="may not fit|needs .* per device"):
        step.plan(*ex.args)


def test_cluster_too_small_for_the_model():
    ex = tiny_example("gpt")
    tiny = dataclasses.replace(LOCAL, device_memory=1e4)
    step = al.parallelize(ex.train_step, cluster=tiny, microbatches=MICROBATCHES, layers=4)
    with pytest.raises(InterOpError, match="more devices"):
        step.plan(*ex.args)


def test_zero_bubble_splits_each_backward_into_input_and_weight_gradients(pipelined_steps):
    """ZB-H1's B is what the previous stage waits for; W (weight gradients) is deferred."""
    plan = pipelined_steps["gpt"].current_plan.pin_stages(STAGINGS[2]).with_schedule("zb_h1")
    assert 0 < plan.stages[1].weight_gradient_time < plan.stages[1].backward_time
    one_f_one_b = plan.with_schedule("1f1b")
    assert plan.timeline.makespan <= one_f_one_b.timeline.makespan + 1e-12


@pytest.mark.parametrize(
    "kw, match",
    [
        ({"microbatches": 0}, "positive"),
        ({"schedule": "pipedream"}, "unknown pipeline schedule"),
        ({"microbatches": 2, "mesh_shape": (2, 4)}, "single-mesh"),
    ],
)
def test_bad_pipeline_options(kw, match):
    with pytest.raises(ValueError, match=match):
        al.parallelize(tiny_example("mlp").train_step, cluster=LOCAL, **kw)



def test_stage_construction_respects_eq5_for_the_schedule():
    """Memory per device = weights + in-flight micro-batches x activations (eq. 5). The same
    budget holds 1F1B (S - i in flight) and eager-1F1B (2(S - i) - 1) with the fastest
    layouts; GPipe (all 8 in flight) fits only by giving some stages a memory-saving layout
    (Megatron or ZeRO-3, said in the stage's plan); with half the memory nothing fits."""
    from alpa_lab.passes.pipeline import MEMORY_SAVING_METHODS

    ex = tiny_example("gpt")
    small = dataclasses.replace(LOCAL, device_memory=1.2e6)
    for schedule in ("1f1b", "eager_1f1b"):
        plan = al.parallelize(ex.train_step, cluster=small, microbatches=8, layers=4, schedule=schedule).plan(*ex.args)
        assert plan.memory_per_device <= small.device_memory
        S = plan.num_stages
        want = [min(S - i, 8) if schedule == "1f1b" else min(2 * (S - i) - 1, 8) for i in range(S)]
        assert [st.in_flight for st in plan.stages] == want
    unconstrained = al.parallelize(ex.train_step, cluster=LOCAL, microbatches=8, layers=4, schedule="gpipe").plan(*ex.args)
    assert unconstrained.memory_per_device > small.device_memory
    assert all(st.plan.method == "alpa" for st in unconstrained.stages)
    step = al.parallelize(ex.train_step, cluster=small, microbatches=8, layers=4, schedule="gpipe")
    gpipe = step.plan(*ex.args)
    assert gpipe.memory_per_device <= small.device_memory
    assert any(st.plan.method in MEMORY_SAVING_METHODS for st in gpipe.stages)
    assert all(st.in_flight == 8 for st in gpipe.stages)
    state, loss = step(*ex.args)  # and the memory-saving stages still compute the same step
    ref_state, ref_loss = accumulated_step(ex, 8)(*ex.args)
    assert_close(loss, ref_loss, "loss")
    assert_close(state, ref_state, "state", atol=5e-5)  # Adam near zero gradients: see the full-batch test
    tiny = dataclasses.replace(LOCAL, device_memory=0.6e6)
    with pytest.raises(InterOpError, match="in flight|none combine"):
        al.parallelize(ex.train_step, cluster=tiny, microbatches=8, layers=4, schedule="gpipe").plan(*ex.args)


def test_the_stage_dp_refuses_interleaved_and_says_how_to_get_it():
    with pytest.raises(InterOpError, match=r"with_schedule\('interleaved_1f1b', chunks=2\)"):
        al.parallelize(tiny_example("mlp").train_step, cluster=LOCAL, microbatches=4, schedule="interleaved_1f1b")


@pytest.mark.parametrize("name", ["mlp", "gpt"])
def test_interleaved_1f1b_trains_like_the_reference(name, pipelined_steps, references):
    """Two meshes x two chunks: virtual stage j holds layer j and runs on mesh j % 2 (Megatron)."""
    ex = tiny_example(name)
    step = pipelined_steps[name]
    base = step.current_plan.pin_stages(STAGINGS[2], submeshes=[(1, 4), (1, 4)])
    plan = base.with_schedule("interleaved_1f1b", chunks=2)
    assert plan.num_stages == 4 and plan.num_meshes == 2
    assert [st.layers for st in plan.stages] == [(0, 1), (1, 2), (2, 3), (3, 4)]
    assert [st.device_ids for st in plan.stages] == [base.stages[j % 2].device_ids for j in range(4)]
    # eq. 5 per mesh: the two chunks on a mesh add up
    assert plan.memory_per_device == max(
        plan.stages[p].memory_per_device + plan.stages[p + 2].memory_per_device for p in range(2)
    )
    step.use(plan)
    # GPT: one weight of Block_1's MLP ([187, 20]) has a gradient near Adam's eps, where float32 sums in another order
    # (four virtual stages, other shardings) move its update by up to 4e-5 after one step; everything else is within 1e-5
    trains_like_reference(step, ex, references[name], f"{name} interleaved", state_atol=STATE_ATOL)
    # an interleaved plan edits like any other, and leaving it needs contiguous stages again
    op = next(o for o in plan.stages[3].plan.ops if o.kind == "op" and o.num_strategies > 1)
    other = next(a.strategy for a in plan.stages[3].plan.explain(op.name).alternatives if not a.chosen)
    assert plan.pin(op.name, other).stages[3].plan.op(op.name).strategy == other
    with pytest.raises(InterOpError, match="share 2 meshes"):
        plan.with_schedule("1f1b")
    with pytest.raises(InterOpError, match="needs at least 8 layers"):
        base.with_schedule("interleaved_1f1b", chunks=4)
    step.use(base)


def test_runtime_refuses_stages_off_their_schedule_mesh(pipelined_steps):
    from alpa_lab.passes.schedule import make_schedule
    from alpa_lab.runtime.pipeline import compile_pipeline

    plan = pipelined_steps["mlp"].current_plan.pin_stages(STAGINGS[4])  # 4 stages on 4 sub-meshes
    interleaved = make_schedule("interleaved_1f1b", 4, MICROBATCHES, num_meshes=2)  # wants stage 2 on stage 0's mesh
    with pytest.raises(PipelineRunError, match="the schedule puts it on the mesh of stage 0"):
        compile_pipeline(plan.problem.graph, plan.problem.slicing, plan.stages, interleaved, ())


def test_a_failed_run_keeps_the_plan_and_the_state(pipelined_steps):
    ex = tiny_example("mlp")
    step = pipelined_steps["mlp"]
    plan = step.current_plan
    odd = jax.tree_util.tree_map(lambda x: x[:6], ex.batch)  # 6 examples cannot make 4 micro-batches
    with pytest.raises(ValueError, match="does not divide the batch size 6"):
        step(ex.state, odd)
    assert step.current_plan is plan
    state, loss = step(ex.state, ex.batch)  # the state passed in is untouched and still trains
    assert np.isfinite(float(loss))


def test_a_plan_for_more_devices_than_here_asks_for_enough():
    from alpa_lab.runtime.apply import DeviceError

    ex = tiny_example("mlp")
    step = al.parallelize(ex.train_step, cluster=al.ClusterSpec.local(4, 4), microbatches=4, layers=4)
    plan = step.plan(ex.state, ex.batch)
    need = max(d for st in plan.stages for d in st.device_ids) + 1
    assert need > len(jax.devices())
    with pytest.raises(DeviceError, match=f"device_count={need} "):
        step(ex.state, ex.batch)
    assert step.current_plan is plan


# ----- gradient accumulation ---------------------------------------------------------------------
def test_gradient_sums_are_charged_to_the_phase_that_makes_them(pipelined_steps):
    """Each weight gradient is summed every micro-batch (an add on its planned tile: two tiles read, one
    written), in one more program of the backward; the update is charged its own program only (the average,
    once per step and mesh, is recorded in no phase and not charged)."""
    import math

    from alpa_lab.passes.pipeline import accumulation_seconds, stage_parts
    from alpa_lab.sharding.spec import ShardingSpec

    step = pipelined_steps["mlp"]
    plan = step.current_plan.pin_stages(STAGINGS[2])
    problem, cluster = plan.problem, LOCAL
    graph, sl = problem.graph, problem.slicing
    accumulated = set(sl.accumulated)
    for st in plan.stages:
        sums = accumulation_seconds(problem, st.plan, st.layers)
        planned = {o.name: o for o in st.plan.ops if o.kind == "op"}
        expected = {}
        for i in sl.ops_of(range(*st.layers)):
            op = graph.ops[i]
            for pos, v in enumerate(op.outputs):
                if v in accumulated and graph.vars[v].dtype.startswith("float"):
                    tiles = ShardingSpec.parse(planned[op.name].output_specs[pos]).num_shards(st.plan.mesh_shape)
                    elems = math.prod(graph.vars[v].shape) / tiles
                    add = max(elems / cluster.device_flops, 3 * 4 * elems / cluster.memory_bandwidth)
                    add += cluster.op_overhead + cluster.sum_overhead
                    expected[op.name] = expected.get(op.name, 0.0) + add
        assert expected and set(sums) == set(expected)
        assert [sums[k] for k in expected] == pytest.approx(list(expected.values()), rel=1e-12)
        parts = stage_parts(problem, st.plan, st.layers)
        assert parts[BACKWARD].launches == 2 and parts[APPLY].launches == 1  # the backward's program and its sums'
        backward = {graph.ops[i].name for i in sl.ops_of(range(*st.layers)) if sl.phase[i] == BACKWARD}
        assert parts[BACKWARD].compute == pytest.approx(
            sum(o.compute_cost for name, o in planned.items() if name in backward)
            + sum(a for name, a in sums.items() if name in backward), rel=1e-9)


def test_gradient_sums_run_one_program_per_mesh_and_keep_integers_last():
    """``runtime.accumulate``: floats summed (in one program per call), integers keep the latest micro-batch's,
    the average one program per mesh, so sums living on two meshes are averaged where they are."""
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from alpa_lab.runtime.accumulate import accumulate, averaged

    devices = jax.devices()
    meshes = [Mesh(np.array(devices[k * 2:(k + 1) * 2]), ("x",)) for k in (0, 1)]
    on = [NamedSharding(m, PartitionSpec("x")) for m in meshes]
    dtypes = {0: "float32", 1: "int32", 2: "float32"}
    sums: dict = {}
    values = []
    for mb in range(3):
        x = np.arange(4, dtype=np.float32) + mb
        n = np.full(4, mb, dtype=np.int32)
        y = np.ones(4, dtype=np.float32) * (mb + 1)
        values.append((x, y))
        accumulate(sums, [(0, jax.device_put(x, on[0])), (1, jax.device_put(n, on[0]))], dtypes)
        accumulate(sums, [(2, jax.device_put(y, on[1]))], dtypes)
    assert sums[0].sharding == on[0] and sums[2].sharding == on[1]
    np.testing.assert_array_equal(np.asarray(sums[0]), sum(x for x, _ in values))
    np.testing.assert_array_equal(np.asarray(sums[1]), np.full(4, 2))
    out = averaged(sums, 3, dtypes)
    np.testing.assert_allclose(np.asarray(out[0]), sum(x for x, _ in values) / 3, rtol=1e-7)
    np.testing.assert_allclose(np.asarray(out[2]), np.full(4, 2.0), rtol=1e-7)
    np.testing.assert_array_equal(np.asarray(out[1]), np.full(4, 2))
    assert out[2].sharding == on[1]


def test_a_profiled_run_times_each_unit_task_from_its_inputs_arrival():
    """With ``profile`` on, a RUN's record is the program's run alone: its inputs (a micro-batch put on the
    stage's mesh, an activation sent from the other mesh) have arrived before the clock starts, as the Ray
    runtime's RECV comes before its RUN. Before, the asynchronous puts were still in flight when the program
    was called (15 of 24 calls here), so the records charged the transfers to the stages, which the plan prices
    apart. Oracle: ``jax.Array.is_ready`` of every input at the call."""

    def train_step(params, batch):
        def loss(p):
            x = jnp.tanh(batch @ p["w0"])
            x = al.mark_stage_boundary(x)
            return jnp.mean(jnp.tanh(x @ p["w1"]) ** 2)

        grads = al.grad(loss)(params)
        return jax.tree_util.tree_map(lambda a, g: a - 0.1 * g, params, grads)

    params = {"w0": jnp.ones((512, 512)) * 0.01, "w1": jnp.ones((512, 512)) * 0.01}
    batch = jnp.ones((8192, 512))  # 8 MiB a micro-batch: its puts take long enough to be seen in flight
    step = al.parallelize(train_step, cluster=al.ClusterSpec.local(2, 4), microbatches=2, layers=2)
    step.use(step.plan(params, batch).pin_stages([[0, 0], [1, 1]], submeshes=[(1, 4), (1, 4)]))
    compiled = step.compiled(params, batch)
    compiled.profile = True
    calls = []
    for key, task in list(compiled.tasks.items()):
        def timed(*ins, _fn=task.fn, _key=key):
            calls.append((_key, all(x.is_ready() for x in ins if isinstance(x, jax.Array))))
            return _fn(*ins)

        compiled.tasks[key] = dataclasses.replace(task, fn=timed)
    for _ in range(3):
        params = step(params, batch)
    assert len(calls) >= 12 and any(key == (1, FORWARD) for key, _ in calls)
    assert [key for key, ready in calls if not ready] == []
    assert len(compiled.last_timings["records"]) >= 8


@pytest.mark.parametrize(("name", "stages", "schedule"), [
    ("gpt", 2, "1f1b"), ("moe", 2, "1f1b"), ("wide_resnet", 2, "1f1b"), ("mlp", 4, "gpipe"),
])
def test_a_profiled_steps_bytes_between_stages_are_the_plans_unit_tasks(name, stages, schedule, pipelined_steps):
    """What a profiled step counts landing on each stage's devices from another stage's (each receiving device's
    shard, read from the arrays) against the plan's cross-mesh unit tasks (``passes.transfers``, what the Traffic
    view and the dashboard's link rows predict): equal, byte for byte, per (sender, receiver) stage pair. The
    second step counts the state leaves the first step's update made on another stage's mesh (GPT's tied
    embedding) too; the first one's state came from the caller."""
    from alpa_lab.passes.transfers import pipeline_transfers, stage_traffic

    ex = tiny_example(name)
    step = pipelined_steps[name]
    plan = step.current_plan.pin_stages(STAGINGS[stages]).with_schedule(schedule)
    step.use(plan)
    compiled = step.compiled(*ex.args)
    compiled.profile = True
    try:
        state = ex.state
        for _ in range(2):
            state, _ = step(state, ex.batch)
    finally:
        compiled.profile = False
    predicted = stage_traffic(pipeline_transfers(plan), plan.num_microbatches)
    assert compiled.last_timings["link_bytes"] == predicted and len(predicted) >= 2 * (stages - 1)


def test_a_stage_plan_weighs_its_update_once_per_step():
    """A stage runs its forward and backward once per micro-batch and its update once per step, and its ILP weighs
    them so (``intra_op.weighted_by_microbatch``). The oracles: a step's time by the stage's per-phase figures
    (M x (forward + backward) + update, ``stage_parts``), for the plan made for M micro-batches against the plan that
    weighs the update like a micro-batch (the ILP as it was); and the ILP's minimised objective recomputed here, op
    by op and edge by edge, from the strategies and ``resharding`` (1 / M on the update's ops, the ops of phase
    APPLY, on the reshardings into them and on those of new state into its argument's layout; each cost once for the
    plan's objective); and ``explain``, which prices an op's alternatives as the ILP weighed them.

    The case is a transformer pair on 4 hosts of 8 V100s (shape-only, no weights): weighed like a micro-batch, the
    update's gather of new weights made the ILP keep the weights split and gather them every micro-batch (GPT-3
    175B's layer on 256 devices planned 1.82x over the stage DP's price so; its plan's step was 7% slower)."""
    from alpa_lab.api import trace_microbatched
    from alpa_lab.models import gpt_config, make_gpt
    from alpa_lab.passes.pipeline import PipelineProblem, _plan_stage, _stage_figures
    from alpa_lab.sharding.resharding import resharding

    M, hosts = 16, 4
    ex = make_gpt(gpt_config(layers=2, hidden=4096, heads=32, batch=256, seq_len=512, dtype="float16"), abstract=True)
    graph, _ = trace_microbatched(ex.train_step, ex.args, M, 2, remat=True)
    problem = PipelineProblem.build(graph, al.ClusterSpec.preset("p3.16xlarge", hosts=hosts))
    mesh, devices = (hosts, 8), tuple(range(hosts * 8))
    steps = {}
    for m in (1, M):
        plan = _plan_stage(problem, (0, 2), mesh, mesh, devices, "alpa", {}, m)
        forward, backward, update, *_ = _stage_figures(problem, plan, (0, 2))
        steps[m] = M * (forward + backward) + update
    assert steps[M] < 0.8 * steps[1], steps  # 4.43 s against 7.24 s here

    sg = problem.stage_graph((0, 2), mesh, mesh, devices, plan.solver.get("tie_period", 1), M)
    solved = problem.stage_solutions[next(k for k in problem.stage_solutions if k[-1] == M)][1].solution
    update = set(problem.update_nodes(sg))
    assert update and sg.node_weights is not None
    weight = [1.0 / M if n in update else 1.0 for n in range(len(sg.nodes))]
    minimised = plain = 0.0
    for n, node in enumerate(sg.nodes):
        cost = node.strategies[solved.choice[n]].cost
        minimised, plain = minimised + weight[n] * cost, plain + cost
    for e in sg.edges:
        consumer = e.operand if e.consumer < 0 else e.consumer
        src = sg.nodes[e.producer].strategies[solved.choice[e.producer]].output_specs[e.output]
        chosen = sg.nodes[consumer].strategies[solved.choice[consumer]]
        dst = chosen.output_specs[0] if e.consumer < 0 else chosen.input_specs[e.operand]
        cost = resharding(src, dst, *sg.var_info[e.var], sg.mesh).cost
        # into the update runs with it; a new state into its argument's layout, once a step at its end
        w = 1.0 / M if e.consumer < 0 else min(weight[e.producer], weight[consumer])
        minimised, plain = minimised + w * cost, plain + cost
    assert solved.minimised == pytest.approx(minimised, rel=1e-9)
    assert solved.objective == pytest.approx(plain, rel=1e-9) and plan.objective == solved.objective
    # explain() prices alternatives as the ILP weighed them: an update op's own costs 1 / M, a forward op's whole
    for n in (min(update), next(i for i in range(len(sg.nodes)) if i not in update and sg.nodes[i].op_index is not None)):
        own = {a.strategy: a.own_cost for a in plan.explain(sg.nodes[n].name).alternatives}
        assert own == pytest.approx({s.name: s.cost * weight[n] for s in sg.nodes[n].strategies}, rel=1e-12)
