"""Which arguments are the train state and which are the batch, as a user's step lays them out.

The oracle is ``jax.jit`` of the same step: a pipelined step cuts only the batch into micro-batches
(its loss is a mean, so the micro-batches' average equals the full batch's), so a state or a side
input taken for the batch gives other numbers. Tolerances: float32 sums in another order (rtol 1e-4).
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.training import train_state

import alpa_lab as al
from alpa_lab.graph.analysis import batch_dimension, state_aliases

LOCAL = al.ClusterSpec.local(2, 4)


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        for _ in range(3):
            x = nn.relu(nn.Dense(32)(x))
        return nn.Dense(10)(x)


@pytest.fixture(scope="module")
def setup():
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((32, 16), dtype=np.float32))
    y = jnp.asarray(rng.integers(0, 10, 32), dtype=jnp.int32)
    model = MLP()
    state = train_state.TrainState.create(apply_fn=model.apply, params=model.init(jax.random.PRNGKey(0), x), tx=optax.sgd(0.1))
    return state, x, y


def loss_of(state, params, x, y, class_w):
    logits = state.apply_fn(params, x)
    per_example = optax.softmax_cross_entropy_with_integer_labels(logits, y)
    return jnp.mean(per_example * class_w[y])


def assert_like_jit(step, fn, state, batch, steps: int = 2, loss_at: int = 1, state_at: int = 0):
    a = b = state
    for _ in range(steps):
        out_a, out_b = step(a, batch), jax.jit(fn)(b, batch)
        a, b = out_a[state_at], out_b[state_at]
    np.testing.assert_allclose(float(out_a[loss_at]), float(out_b[loss_at]), rtol=1e-4)
    for u, v in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b), strict=True):
        np.testing.assert_allclose(np.asarray(u), np.asarray(v), rtol=1e-4, atol=1e-5)


def test_per_class_weights_beside_the_batch_are_passed_whole_not_cut(setup):
    """The batch is the leading dimension most data leaves share (x and y: 32), not the largest one
    (100 class weights): cutting the weights and passing x whole gave other numbers, silently."""
    state, x, y = setup
    batch = {"x": x, "y": y, "class_w": jnp.linspace(0.5, 1.5, 100, dtype=jnp.float32)}

    def train_step(state, batch):
        loss, grads = al.value_and_grad(lambda p: loss_of(state, p, batch["x"], batch["y"], batch["class_w"]))(state.params)
        return state.apply_gradients(grads=grads), loss

    step = al.parallelize(train_step, cluster=LOCAL, microbatches=4, layers=2)
    plan = step.plan(state, batch)
    assert plan.split_inputs == ("[1]['x']", "[1]['y']")
    assert_like_jit(step, train_step, state, batch)


def test_a_step_returning_loss_then_state_finds_its_state(setup):
    """``return loss, state``: the state is found by its structure, not only by its position."""
    state, x, y = setup
    batch = {"x": x, "y": y}
    ones = jnp.ones(10, jnp.float32)

    def train_step(state, batch):
        loss, grads = al.value_and_grad(lambda p: loss_of(state, p, batch["x"], batch["y"], ones))(state.params)
        return loss, state.apply_gradients(grads=grads)

    step = al.parallelize(train_step, cluster=LOCAL, microbatches=4, layers=2)
    assert step.plan(state, batch).split_inputs == ("[1]['x']", "[1]['y']")
    assert_like_jit(step, train_step, state, batch, loss_at=0, state_at=1)


@pytest.mark.parametrize("method", ["data_parallel", "zero3"])
def test_a_raw_prng_key_in_the_batch_is_not_split_by_data_parallel_methods(setup, method):
    """A ``uint32[2]`` key beside the batch is data, but not the batch: replicated, not refused
    ('cannot split the batch argument ... must divide by 8' before)."""
    state, x, y = setup
    batch = {"x": x, "y": y, "key": jax.random.PRNGKey(3)}

    def train_step(state, batch):
        noise = 0.01 * jax.random.normal(batch["key"], batch["x"].shape)
        loss, grads = jax.value_and_grad(lambda p: loss_of(state, p, batch["x"] + noise, batch["y"], jnp.ones(10)))(state.params)
        return state.apply_gradients(grads=grads), loss

    step = al.parallelize(train_step, cluster=LOCAL, method=method)
    plan = step.plan(state, batch)
    key = next(t for t in plan.inputs if t.path == "[1]['key']")
    assert "S" not in key.spec
    assert_like_jit(step, train_step, state, batch)


def test_state_aliases_by_path_and_by_structure():
    f32 = "float32"
    args = [("[0]['w']", (4, 4), f32), ("[0]['b']", (4,), f32), ("[1]['x']", (8, 4), f32), ("[1]['y']", (8,), "int32")]
    # return state, loss: by path
    assert state_aliases(args, [("[0]['w']", (4, 4), f32), ("[0]['b']", (4,), f32), ("[1]", (), f32)]) == {0: 0, 1: 1}
    # return loss, state: by structure, leaf by leaf
    assert state_aliases(args, [("[0]", (), f32), ("[1]['b']", (4,), f32), ("[1]['w']", (4, 4), f32)]) == {1: 1, 2: 0}
    # return state alone (not a tuple)
    assert state_aliases(args, [("['b']", (4,), f32), ("['w']", (4, 4), f32)]) == {0: 1, 1: 0}
    # a result like the batch in shape but under other names is not state
    assert state_aliases(args, [("[0]", (), f32), ("[1]['pred']", (8, 4), f32), ("[1]['label']", (8,), "int32")]) == {}
    # an autoencoder: the batch comes back changed, beside the state; it stays the batch
    recon = [("[0]['w']", (4, 4), f32), ("[0]['b']", (4,), f32), ("[1]", (), f32), ("[2]", (8, 4), f32)]
    assert state_aliases(args[:2] + [("[1]", (8, 4), f32)], recon) == {0: 0, 1: 1}
    loss_first = [("[0]", (), f32), ("[1]['b']", (4,), f32), ("[1]['w']", (4, 4), f32), ("[2]", (8, 4), f32)]
    assert state_aliases(args[:2] + [("[1]", (8, 4), f32)], loss_first) == {1: 1, 2: 0}
    # a single array returned as the step's only result replaces the argument it matches
    assert state_aliases([("[0]", (16, 8), f32), ("[1]", (16, 8), f32)], [("[]", (16, 8), f32)]) == {0: 0}
    # a changed shape or dtype is not the same leaf
    assert state_aliases(args, [("[0]['w']", (4, 4), "float16"), ("[0]['b']", (4,), f32)]) == {1: 1}


def test_batch_dimension_is_what_most_data_leaves_lead_with():
    assert batch_dimension([(32, 16), (32,), (100,)]) == 32  # x, y and per-class weights
    assert batch_dimension([(32, 16), (100,)]) == 32  # a tie: the leaf with more dimensions
    assert batch_dimension([(2,), (64, 128), (64,)]) == 64  # a raw key beside the batch
    assert batch_dimension([(8,), (16,)]) == 8  # a full tie: the first
    assert batch_dimension([(), ()]) is None


def test_a_pipelined_step_refuses_per_example_results_and_averages_a_mean(setup):
    """A result besides the state comes back once per step (the micro-batches' average): a mean equals
    ``jax.jit``'s, a per-example result would come back with one micro-batch's rows, so it is refused."""
    state, x, y = setup
    batch = {"x": x, "y": y}
    ones = jnp.ones(10, jnp.float32)

    def make(per_example: bool):
        def train_step(state, batch):
            def loss_fn(p):
                logits = state.apply_fn(p, batch["x"])
                err = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]) * ones[batch["y"]]
                return jnp.mean(err), (err if per_example else jnp.mean(jnp.max(logits, axis=-1)))

            (loss, aux), grads = al.value_and_grad(loss_fn, has_aux=True)(state.params)
            return state.apply_gradients(grads=grads), loss, aux

        return train_step

    mean_step = make(False)
    step = al.parallelize(mean_step, cluster=LOCAL, microbatches=4, layers=2)
    (_, loss, aux), (_, ref_loss, ref_aux) = step(state, batch), jax.jit(mean_step)(state, batch)
    np.testing.assert_allclose([float(loss), float(aux)], [float(ref_loss), float(ref_aux)], rtol=1e-4)
    step = al.parallelize(make(True), cluster=LOCAL, microbatches=4, layers=2)
    with pytest.raises(al.TraceError, match=r"returns \[2\] per example \(\(32,\) for the batch, \(8,\) for one of its 4"):
        step.plan(state, batch)
    assert step.current_plan is None


def tables_step(state, batch, tables):
    """A step with side tables that outnumber the batch's leaves (RoPE's sin and cos are such tables)."""
    def loss_fn(p):
        x = batch["x"] @ (tables["a"] * tables["b"]) + tables["c"][0]
        return loss_of(state, p, x, batch["y"], jnp.ones(10, jnp.float32))

    loss, grads = al.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads=grads), loss


@pytest.fixture(scope="module")
def tables():
    rng = np.random.default_rng(1)
    return {k: jnp.asarray(rng.standard_normal((16, 16), dtype=np.float32) * 0.3) for k in "abc"}


def test_batch_argnums_names_the_batch_where_side_tables_outnumber_it(setup, tables):
    """Three (16, 16) tables beside a batch of two leaves of 32 rows: the rule takes 16 for the batch size;
    ``batch_argnums=(1,)`` (Alpa's argument) cuts the batch and passes the tables whole, as jax.jit computes."""
    state, x, y = setup
    batch = {"x": x, "y": y}
    step = al.parallelize(tables_step, cluster=LOCAL, microbatches=4, layers=2, batch_argnums=(1,))
    plan = step.plan(state, batch, tables)
    assert plan.split_inputs == ("[1]['x']", "[1]['y']")
    a = b = state
    for _ in range(2):
        (a, loss_a), (b, loss_b) = step(a, batch, tables), jax.jit(tables_step)(b, batch, tables)
    np.testing.assert_allclose(float(loss_a), float(loss_b), rtol=1e-4)
    for u, v in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b), strict=True):
        np.testing.assert_allclose(np.asarray(u), np.asarray(v), rtol=1e-4, atol=1e-5)
    # the same positions counted from the end, and an int for a single position, name the same batch
    for nums in (1, -2):
        again = al.parallelize(tables_step, cluster=LOCAL, microbatches=4, layers=2, batch_argnums=nums)
        assert again.plan(state, batch, tables).split_inputs == plan.split_inputs
    # without it, the rule cuts the tables (they are most of the data leaves) and passes argument 1 whole: said,
    # naming batch_argnums (or refused, where the cut tables no longer multiply x)
    ruled = al.parallelize(tables_step, cluster=LOCAL, microbatches=4, layers=2)
    with pytest.raises(al.TraceError, match=r"traced on one micro-batch: cut \[2\]\['a'\], \[2\]\['b'\], \[2\]\['c'\] .*"
                       r"batch_argnums=\(1,\).*passed whole: \[1\]\['x'\] \(32, 16\), \[1\]\['y'\] \(32,\)"):
        ruled.plan(state, batch, tables)

    def sliced_step(state, batch, tables):  # tables of 64 rows read up to 16 (RoPE's up to the sequence length)
        return tables_step(state, batch, {k: v[:16] for k, v in tables.items()})

    long = {k: jnp.tile(v, (4, 1)) for k, v in tables.items()}  # cut into 4, each still has its 16 rows: warned
    ruled = al.parallelize(sliced_step, cluster=LOCAL, microbatches=4, layers=2)
    with pytest.warns(UserWarning, match=r"the batch cut into micro-batches is \[2\]\['a'\].*batch_argnums=\(1,\)"):
        assert ruled.plan(state, batch, long).split_inputs == ("[2]['a']", "[2]['b']", "[2]['c']")
    # the usual layouts say nothing: a batch dict beside the state, or the batch as two arguments
    import warnings

    def two_args(state, x, y):
        return tables_step(state, {"x": x, "y": y}, tables)

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        al.parallelize(tables_step, cluster=LOCAL, microbatches=4, layers=2, batch_argnums=1).plan(state, batch, tables)
        assert al.parallelize(two_args, cluster=LOCAL, microbatches=4, layers=2).plan(state, x, y).split_inputs == ("[1]", "[2]")

        def key_first(state, rng, batch):  # a raw PRNG key as argument 1 is not a batch passed whole
            return tables_step(state, batch, tables)

        planned = al.parallelize(key_first, cluster=LOCAL, microbatches=4, layers=2).plan(state, jax.random.PRNGKey(0), batch)
        assert planned.split_inputs == ("[2]['x']", "[2]['y']")


@pytest.mark.parametrize("method", ["data_parallel", "zero2"])
def test_batch_argnums_tells_data_parallel_methods_what_to_split(setup, tables, method):
    """A single-mesh data-parallel plan splits the named batch over the devices and replicates the tables
    (by the rule it would split the tables, the leaves most data shares a leading size with)."""
    state, x, y = setup
    batch = {"x": x, "y": y}
    step = al.parallelize(tables_step, cluster=al.ClusterSpec.local(1, 4), method=method, batch_argnums=1)
    plan = step.plan(state, batch, tables)
    specs = {o.name: o.output_specs[0] for o in plan.ops if o.kind != "op"}
    graph = step.trace(state, batch, tables)
    spec_of = {p: specs[graph.vars[v].name] for p, v in zip(graph.in_paths, graph.invars) if graph.vars[v].name in specs}
    assert spec_of["[1]['x']"].startswith("S") and spec_of["[1]['y']"].startswith("S"), spec_of
    for k in "abc":
        assert spec_of[f"[2]['{k}']"] == "RR", spec_of
    out, loss = step(state, batch, tables)
    _, want = jax.jit(tables_step)(state, batch, tables)
    np.testing.assert_allclose(float(loss), float(want), rtol=1e-4)
    # saved, the plan keeps its batch: loaded into a step that names none, a re-solve (a pin) splits the same inputs
    assert plan.batch_inputs == ("[1]['x']", "[1]['y']")
    loaded = al.Plan.from_json(plan.to_json())
    assert loaded.batch_inputs == plan.batch_inputs
    other = al.parallelize(tables_step, cluster=al.ClusterSpec.local(1, 4), method=method)
    loaded = other.use(loaded, state, batch, tables)
    op = next(o for o in loaded.ops if o.kind == "op" and o.num_strategies > 1)
    pinned = loaded.pin(op.name, op.strategy)
    assert {t.path: t.spec for t in pinned.inputs} == {t.path: t.spec for t in plan.inputs}
    # pipelined: every stage's data-parallel plan splits the named batch, not the tables
    piped = al.parallelize(tables_step, cluster=al.ClusterSpec.local(1, 4), method=method, microbatches=4, layers=2,
                           batch_argnums=(1,), max_stages=1)
    stage = piped.plan(state, batch, tables).stages[0].plan
    spec_of = {t.path: t.spec for t in stage.inputs}
    assert spec_of["[1]['x']"].startswith("S") and all(spec_of[f"[2]['{k}']"] == "RR" for k in "abc"), spec_of
    _, loss = piped(state, batch, tables)
    np.testing.assert_allclose(float(loss), float(want), rtol=1e-4)


def test_bad_batch_argnums_say_what_is_wrong(setup, tables):
    state, x, y = setup
    batch = {"x": x, "y": y}
    for bad in ("1", (), (1, 1), True, (1.0,)):
        with pytest.raises(ValueError, match="batch_argnums must be an argument position"):
            al.parallelize(tables_step, microbatches=4, batch_argnums=bad)
    cases = [
        ((3,), r"names argument 3, but the step was called with 3 argument"),
        ((0,), r"which the step returns in place as its state"),
        ((1, 2), r"leaves of different leading sizes"),
    ]
    for nums, message in cases:
        step = al.parallelize(tables_step, cluster=LOCAL, microbatches=4, layers=2, batch_argnums=nums)
        with pytest.raises(ValueError, match=message):
            step.plan(state, batch, tables)
    # the state named as the batch: said on a single mesh too (it planned a "data-parallel" plan splitting nothing)
    single = al.parallelize(tables_step, cluster=al.ClusterSpec.local(1, 4), method="data_parallel", batch_argnums=0)
    with pytest.raises(ValueError, match="which the step returns in place as its state"):
        single.plan(state, batch, tables)

    def weights_step(w, batch):  # a bare weight matrix: cut into micro-batches it breaks the step's matmul first
        loss, g = al.value_and_grad(lambda w: jnp.mean((batch["x"] @ w) ** 2))(w)
        return w - 0.1 * g, loss

    piped = al.parallelize(weights_step, cluster=LOCAL, microbatches=4, layers=2, batch_argnums=0)
    with pytest.raises(ValueError, match=r"names \[0\], which the step returns in place as its state"):
        piped.plan(jnp.ones((16, 4)), batch)
    scalar = {"x": x, "y": y, "lr": jnp.float32(0.1)}
    step = al.parallelize(tables_step, cluster=LOCAL, microbatches=4, layers=2, batch_argnums=(1,))
    with pytest.raises(ValueError, match=r"names \[1\]\['lr'\], which has no leading \(batch\) dimension"):
        step.plan(state, scalar, tables)
    step = al.parallelize(tables_step, cluster=LOCAL, microbatches=3, layers=2, batch_argnums=(1,))
    with pytest.raises(ValueError, match="microbatches=3 does not divide the batch size 32"):
        step.plan(state, batch, tables)


@pytest.mark.parametrize("how", ["layers", "remat", "boundary"])
def test_a_loss_function_taking_a_module_apply_and_a_flag_is_cut_as_jax_grad_passes_them(setup, how):
    """``loss_fn(params, apply_fn, x, y, train)``: the callable and the Python flag are passed as they are, as
    ``jax.value_and_grad`` passes them (the pipelined step traced them as arrays and failed), whether the
    layers are cut automatically, rematerialised, or at ``al.mark_pipeline_boundary()``."""
    state, x, y = setup
    batch = {"x": x, "y": y}

    def loss_fn(params, apply_fn, x, y, train):
        logits = apply_fn(params, x)
        if how == "boundary":
            al.mark_pipeline_boundary()
        if train:  # Python control flow on a Python flag
            logits = logits * 0.5
        return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, y))

    def train_step(state, batch):
        loss, grads = al.value_and_grad(loss_fn)(state.params, state.apply_fn, batch["x"], batch["y"], True)
        return state.apply_gradients(grads=grads), loss

    step = al.parallelize(train_step, cluster=LOCAL, microbatches=4, layers=None if how == "boundary" else 2,
                          remat=how == "remat")
    assert_like_jit(step, train_step, state, batch)


def test_a_named_batch_is_never_state_even_where_a_result_is_shaped_like_it():
    """An autoencoder returns its reconstruction at the batch's path with the batch's shape and dtype, and an
    inference step its output: the shapes alone take it for the batch's new value (state), which refused the
    user's ``batch_argnums`` (and Alpa's default ``(1,)``) as "naming the state". Named, the batch is the batch.
    Oracle: ``jax.jit`` of the same steps (rtol 1e-5); the refusal of a step whose only state is named stays
    (``test_bad_batch_argnums_say_what_is_wrong``)."""
    rng = np.random.default_rng(1)
    params = {"enc": jnp.asarray(rng.normal(size=(16, 8)), jnp.float32), "dec": jnp.asarray(rng.normal(size=(8, 16)), jnp.float32)}
    batch = jnp.asarray(rng.normal(size=(32, 16)), jnp.float32)

    def autoencoder_step(params, batch):
        def loss_fn(p):
            h = jnp.tanh(batch @ p["enc"])
            al.mark_pipeline_boundary()
            y = h @ p["dec"]
            return jnp.mean((y - batch) ** 2), y

        (_, y), g = al.value_and_grad(loss_fn, has_aux=True)(params)
        return jax.tree_util.tree_map(lambda a, b: a - 0.1 * b, params, g), y

    def plain(params, batch):
        def loss_fn(p):
            y = jnp.tanh(batch @ p["enc"]) @ p["dec"]
            return jnp.mean((y - batch) ** 2), y

        (_, y), g = jax.value_and_grad(loss_fn, has_aux=True)(params)
        return jax.tree_util.tree_map(lambda a, b: a - 0.1 * b, params, g), y

    assert state_aliases([("[1]", (32, 16), "float32")], [("[1]", (32, 16), "float32")]) == {0: 0}
    assert state_aliases([("[1]", (32, 16), "float32")], [("[1]", (32, 16), "float32")], batch={0}) == {}
    want_params, want_y = jax.jit(plain)(params, batch)
    for kw in ({"batch_argnums": (1,)}, {"method": al.ShardParallel()}, {"method": al.DataParallel()}):
        step = al.parallelize(autoencoder_step, cluster=al.ClusterSpec.local(1, 4), **kw)
        new_params, y = step(params, batch)
        np.testing.assert_allclose(np.asarray(y), np.asarray(want_y), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(np.asarray(new_params["enc"]), np.asarray(want_params["enc"]), rtol=1e-5, atol=1e-6)
        assert not batch.is_deleted()
    # exported (Plan.jit traces with the plan's named batch, so it is the plan's program)
    plan = al.parallelize(autoencoder_step, cluster=al.ClusterSpec.local(1, 4), batch_argnums=(1,)).plan(params, batch)
    _, y = plan.jit(autoencoder_step)(params, batch)
    np.testing.assert_allclose(np.asarray(y), np.asarray(want_y), rtol=1e-5, atol=1e-6)

    # the state named is still refused: Alpa's default (1,) on step(params, opt_state, batch) names Adam's state,
    # which comes back whole (before this rule it was cut as the batch, and the real batch replicated)
    tx = optax.adam(1e-2)

    def three(params, opt_state, batch):
        g = jax.grad(lambda p: jnp.mean((jnp.tanh(batch @ p["enc"]) @ p["dec"] - batch) ** 2))(params)
        updates, opt_state = tx.update(g, opt_state)
        return optax.apply_updates(params, updates), opt_state

    with pytest.raises(ValueError, match=r"names \[1\]\[0\]\.count.*returns in place as its state"):
        al.parallelize(three, method=al.DataParallel()).plan(params, tx.init(params), batch)
    # pipelined, the reconstruction is what it is, a per-example result (one per micro-batch), said as such
    piped = al.parallelize(autoencoder_step, cluster=LOCAL, microbatches=2, batch_argnums=(1,))
    with pytest.raises(ValueError, match=r"returns \[1\] per example"):
        piped(params, batch)

    w = jnp.asarray(rng.normal(size=(16, 16)), jnp.float32)

    def infer(w, x):  # Alpa's inference test_output: the output has the input's shape
        h = x @ w
        al.mark_pipeline_boundary()
        y = h @ w.T
        return jnp.mean((y - x) ** 2), y

    method = al.PipeshardParallel(num_micro_batches=2, pipeline_schedule="inference", layer_option="manual")
    loss, y = al.parallelize(infer, method=method, batch_argnums=(1,))(w, batch)
    want_loss, want = jax.jit(infer)(w, batch)
    np.testing.assert_allclose(np.asarray(y), np.asarray(want), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(float(loss), float(want_loss), rtol=1e-5)


def test_a_state_only_jax_grad_step_tells_weights_from_statistics():
    """A step returning only its new state, differentiated by ``jax.grad`` (Alpa's tests' form), reports no loss:
    its parameters are the state the backward pass reads; BatchNorm's running statistics, updated beside the
    gradient (``mutable=["batch_stats"]``), stay optimizer state, as they are for the same step returning its loss."""
    from alpa_lab.graph.analysis import classify_arguments

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(4)(nn.BatchNorm(use_running_average=False)(nn.Dense(8)(x)))

    x = jnp.ones((16, 4))
    model = Net()
    variables = model.init(jax.random.PRNGKey(0), x)
    tx = optax.adam(1e-2)

    def step(params, stats, opt, x):
        def loss(p):
            out, new = model.apply({"params": p, "batch_stats": stats}, x, mutable=["batch_stats"])
            return jnp.mean(out ** 2), new["batch_stats"]

        g, stats = jax.grad(loss, has_aux=True)(params)
        updates, opt = tx.update(g, opt)
        return optax.apply_updates(params, updates), stats, opt

    graph = al.trace(step, variables["params"], variables["batch_stats"], tx.init(variables["params"]), x)
    kinds = {p: classify_arguments(graph)[v] for p, v in zip(graph.in_paths, graph.invars)}
    assert {p for p, k in kinds.items() if k == "param"} == {p for p in kinds if p.startswith("[0]")}, kinds
    assert all(kinds[p] == "optimizer_state" for p in kinds if p.startswith(("[1]", "[2]"))), kinds


def test_a_tuple_of_parameters_returned_whole_is_the_state():
    """``step(params, batch) -> new_params`` with params a tuple of arrays (Alpa's pipeline manual-sharding test):
    the result's paths are ``[0]``, ``[1]``, ... as a tuple of results' would be, and they are exactly the
    parameters' below their top, so they are the new parameters (the batch, not returned, is data)."""
    f32 = "float32"
    args = [("[0][0]", (6, 8), f32), ("[0][1]", (8,), f32), ("[1][0]", (64, 6), f32), ("[1][1]", (64, 8), f32)]
    assert state_aliases(args, [("[0]", (6, 8), f32), ("[1]", (8,), f32)]) == {0: 0, 1: 1}
    # a result of other shapes is not taken for them; neither is the batch returned whole (an autoencoder's pair)
    assert state_aliases(args, [("[0]", (6, 8), f32), ("[1]", (), f32)]) == {}
    assert state_aliases(args, [("[0]", (64, 6), f32), ("[1]", (64, 8), f32)]) == {}
    from alpa_lab.graph.analysis import classify_arguments
    from alpa_lab.graph.trace import trace

    def step(params, batch):
        grads = al.grad(lambda p: jnp.mean((jnp.tanh(batch[0] @ p[0]) + p[1] - batch[1]) ** 2))(params)
        return tuple(p - 0.1 * g for p, g in zip(params, grads))

    params, batch = (jnp.ones((6, 8)), jnp.ones((8,))), (jnp.ones((64, 6)), jnp.ones((64, 8)))
    graph = trace(step, params, batch)
    kinds = classify_arguments(graph)
    assert [kinds[v] for v in graph.invars] == ["param", "param", "data", "data"]
