"""Tracing: every example model becomes a flat OpGraph with stable names, the wrappers JAX
adds (jit, custom_jvp/vjp, checkpoint) are inlined without changing what the program
computes, and ops carry the FLOPs/bytes/labels the planner reads."""

from __future__ import annotations

import re
from collections import Counter
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from alpa_lab.graph.evaluate import as_function, evaluate
from alpa_lab.graph.opgraph import OpGraph
from alpa_lab.graph.trace import TraceError, trace
from alpa_lab.models import EXAMPLES, GPTConfig, gpt_config, make_gpt, tiny_example

NAMES = sorted(EXAMPLES) + ["mlp_nnx"]
WRAPPERS = {"jit", "pjit", "closed_call", "core_call", "custom_jvp_call", "custom_vjp_call",
            "custom_vjp_call_jaxpr", "remat", "remat2", "checkpoint"}


@pytest.fixture(scope="module", params=NAMES)
def traced(request):
    ex = tiny_example(request.param)
    return ex, trace(ex.train_step, *ex.args)


def primitives(graph: OpGraph) -> Counter:
    return Counter(op.primitive for op in graph.ops)


def assert_close(expected, actual, rtol=1e-5, atol=1e-6):
    assert jax.tree_util.tree_structure(expected) == jax.tree_util.tree_structure(actual)
    for e, a in zip(jax.tree_util.tree_leaves(expected), jax.tree_util.tree_leaves(actual)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(e), rtol=rtol, atol=atol)


# --- the example models ---------------------------------------------------------------


def test_models_trace_to_flat_named_ops(traced):
    ex, graph = traced
    counts = primitives(graph)
    assert counts["dot_general"] >= 3, counts
    assert not WRAPPERS & set(counts)
    names = [op.name for op in graph.ops]
    assert len(set(names)) == len(names)
    seen: Counter = Counter()
    for op in graph.ops:  # <primitive>_<k>, k counting that primitive's uses in program order
        assert op.name == f"{op.primitive}_{seen[op.primitive]}"
        seen[op.primitive] += 1
        assert re.fullmatch(r"[\w-]+_\d+", op.name)
    assert [op.index for op in graph.ops] == list(range(len(graph.ops)))
    assert len(graph.invars) == len(jax.tree_util.tree_leaves(ex.args))
    assert graph.out_tree == jax.tree_util.tree_structure(jax.eval_shape(ex.train_step, *ex.args))
    assert graph.total_flops > 0 and all(op.bytes_accessed >= 0 for op in graph.ops)


def test_retracing_gives_the_same_names_and_fingerprint(traced):
    ex, graph = traced
    again = trace(ex.train_step, *ex.args)
    assert [op.name for op in again.ops] == [op.name for op in graph.ops]
    assert again.fingerprint == graph.fingerprint and len(graph.fingerprint) == 16


def test_trace_of_abstract_args_equals_trace_of_arrays(traced):
    ex, graph = traced
    abstract = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), ex.args)
    assert trace(ex.train_step, *abstract).fingerprint == graph.fingerprint


def test_inlining_preserves_the_numerics(traced):
    """Re-running the graph op by op (``evaluate``) gives what the train step gives.

    Both run in one jit (one compile instead of two); XLA may share work between them but
    not change either's results, so a wrong inlining still shows as a mismatch.
    """
    ex, graph = traced
    both = jax.jit(lambda *args: (ex.train_step(*args), as_function(graph)(*args)))
    expected, actual = both(*ex.args)
    assert_close(expected, actual)


def test_a_different_config_gives_a_different_fingerprint():
    small = make_gpt(GPTConfig(), abstract=True)
    wider = make_gpt(GPTConfig(hidden=128), abstract=True)
    deeper = make_gpt(GPTConfig(layers=3), abstract=True)
    prints = {trace(ex.train_step, *ex.args).fingerprint for ex in (small, wider, deeper)}
    assert len(prints) == 3


def test_flax_module_names_label_the_ops():
    _, graph = trace_of("mlp")
    labels = {op.label for op in graph.ops if op.primitive == "dot_general"}
    assert any("Dense_0" in label for label in labels) and any("Dense_3" in label for label in labels)
    _, gpt = trace_of("gpt")
    gather_labels = " ".join(op.label for op in gpt.ops if op.primitive == "gather")
    assert "wte" in gather_labels and "wpe" in gather_labels
    assert any("Attention_0/query" in op.label for op in gpt.ops)


def trace_of(name: str) -> tuple:
    ex = tiny_example(name)
    return ex, trace(ex.train_step, *ex.args)


def test_model_specific_ops():
    moe = trace_of("moe")[1]
    counts = primitives(moe)
    assert counts["argmax"] == 2 and counts["cumsum"] == 2  # top-1 routing in each of 2 layers
    # expert FFN: batched over the expert axis, [E, G, C, M] x [E, M, H]
    expert_matmuls = [
        op for op in moe.ops if op.primitive == "dot_general" and op.params["dimension_numbers"][1] != ((), ())
        and moe.vars[op.inputs[1]].shape == (8, 64, 128)
    ]
    assert expert_matmuls
    wrn = trace_of("wide_resnet")[1]
    assert primitives(wrn)["conv_general_dilated"] >= 3 * 9  # forward, input and weight gradients
    assert primitives(trace_of("gpt")[1])["gather"] >= 2  # token and position embeddings


def test_gpt_350m_traces_from_shapes_alone():
    ex = make_gpt(gpt_config(layers=24, hidden=1024, heads=16, seq_len=1024, batch=8), abstract=True)
    graph = trace(ex.train_step, *ex.args)
    counts = primitives(graph)
    assert counts["dot_general"] >= 24 * 18  # 6 matmuls per layer, forward + 2 gradients
    assert graph.total_flops > 6 * 350e6 * 8 * 1024  # ~6 x params x tokens


# --- inlining ------------------------------------------------------------------------


@jax.custom_jvp
def soft_clip(x):
    return jnp.tanh(x) * 2.0


@soft_clip.defjvp
def _soft_clip_jvp(primals, tangents):
    (x,), (dx,) = primals, tangents
    return soft_clip(x), 2.0 * (1.0 - jnp.tanh(x) ** 2) * dx


SCALE = np.linspace(0.5, 1.5, 8, dtype=np.float32)


@jax.custom_vjp
def scaled_sin(x):
    return jnp.sin(x) * SCALE  # closes over an array: a const of the custom_vjp body


def _scaled_sin_fwd(x):
    return scaled_sin(x), x


def _scaled_sin_bwd(x, g):
    return (jnp.cos(x) * SCALE * g,)


scaled_sin.defvjp(_scaled_sin_fwd, _scaled_sin_bwd)


@jax.jit
def inner_jit(x, y):
    with jax.named_scope("inner_scope"):
        return jnp.exp(x) * y + SCALE, y  # also passes an input straight through


def wrapped(x, y):
    a, b = inner_jit(x, y)
    a = jax.checkpoint(lambda u: jnp.log1p(u * u) * 3.0)(a)
    return jnp.sum(soft_clip(a) + scaled_sin(b) + jax.nn.relu(x) + jax.jit(partial(jnp.multiply, 2.0))(x))


X = jnp.linspace(-1.0, 1.0, 8, dtype=jnp.float32)
Y = jnp.linspace(0.5, 2.0, 8, dtype=jnp.float32)


@pytest.mark.parametrize("fn", [wrapped, jax.grad(wrapped, argnums=(0, 1))], ids=["forward", "grad"])
def test_wrappers_are_inlined_and_keep_the_numerics(fn):
    graph = trace(fn, X, Y)
    counts = primitives(graph)
    assert not WRAPPERS & set(counts), counts
    # bodies of jit, checkpoint, custom_jvp/vjp, relu; the gradient needs the custom_vjp's backward rule (cos), and
    # the forward's sin and relu's max are dead there (nothing reads them), so they are not traced, as XLA drops them
    for inner in ("exp", "log1p", "tanh") + (("sin", "max") if fn is wrapped else ("cos",)):
        assert counts[inner] >= 1, inner
    if fn is not wrapped:
        assert counts["sin"] == counts["max"] == 0, counts
    assert any("inner_jit/inner_scope" in op.label for op in graph.ops)
    assert_close(fn(X, Y), evaluate(graph, [X, Y])[0] if fn is wrapped else as_function(graph)(X, Y))
    assert len({id(v) for v in graph.consts.values()}) == len(graph.consts)


def test_dead_code_is_not_traced():
    """What nothing reads is not planned (XLA drops it when compiling): ``model.init``'s forward, run to find the
    shapes, and a value computed and discarded; effects (a debug callback) stay. Oracle: the numerics of the
    traced program against the function's."""
    seen = []

    def fn(x, w):
        unused = jnp.tanh(x @ w)  # noqa: F841 - dead
        jax.debug.callback(lambda v: seen.append(float(v)), jnp.sum(x))
        return jnp.exp(x) * 2.0

    graph = trace(fn, X[:4].reshape(2, 2), jnp.ones((2, 2)))
    counts = primitives(graph)
    assert counts["dot_general"] == counts["tanh"] == 0 and counts["exp"] == 1, counts
    assert counts["debug_callback"] == 1 and counts["reduce_sum"] == 1, counts
    assert_close(fn(X[:4].reshape(2, 2), jnp.ones((2, 2))), evaluate(graph, [X[:4].reshape(2, 2), jnp.ones((2, 2))])[0])


def test_custom_vjp_backward_is_the_users_rule():
    graph = trace(jax.grad(lambda x: jnp.sum(scaled_sin(x))), X)
    assert primitives(graph)["cos"] == 1
    assert_close(jnp.cos(X) * SCALE, evaluate(graph, [X])[0])


def test_a_const_shared_by_inlined_calls_is_one_var():
    graph = trace(lambda x, y: inner_jit(x, y)[0] + inner_jit(y, x)[0], X, Y)
    assert len(graph.consts) == 1


def test_literals_and_passthrough_outputs():
    fn = jax.jit(lambda x: (x, 2.0, x + 1))
    graph = trace(fn, X)
    assert graph.outvars[0] == graph.invars[0]
    assert graph.vars[graph.outvars[1]].kind == "literal"
    assert_close(fn(X), as_function(graph)(X))


def test_an_nnx_model_traces():
    ex, graph = trace_of("mlp_nnx")
    assert primitives(graph)["dot_general"] == primitives(trace_of("mlp")[1])["dot_general"]
    assert any("['params']" in path or "params" in path for path in graph.in_paths)


# --- control flow --------------------------------------------------------------------


def differentiable_control_flow(x):
    y = jax.lax.cond(jnp.sum(x) > 0, lambda v: v * 2.0, lambda v: v - 1.0, x)
    carry, ys = jax.lax.scan(lambda c, v: (c + v, c * v), 0.0, y)
    return carry + jnp.sum(ys)


def control_flow(x):
    _, y = jax.lax.while_loop(lambda c: c[0] < 3, lambda c: (c[0] + 1, c[1] * 0.5 + 1.0), (0, x))
    return differentiable_control_flow(y)


def test_control_flow_stays_one_op():
    graph = trace(control_flow, X)
    counts = primitives(graph)
    assert counts["cond"] == 1 and counts["while"] == 1 and counts["scan"] == 1
    assert_close(control_flow(X), evaluate(graph, [X])[0])
    grad = jax.grad(differentiable_control_flow)
    graph = trace(grad, X)
    assert primitives(graph)["scan"] == 2  # forward and transposed
    assert_close(grad(X), as_function(graph)(X))


# --- costs ---------------------------------------------------------------------------


def test_matmul_flops_and_bytes():
    m, k, n = 16, 32, 8
    graph = trace(jnp.matmul, jnp.ones((m, k)), jnp.ones((k, n)))
    (op,) = graph.ops
    assert op.primitive == "dot_general"
    assert op.flops == 2 * m * n * k
    assert op.bytes_accessed == 4 * (m * k + k * n + m * n)
    batched = trace(lambda a, b: jnp.einsum("bmk,bkn->bmn", a, b), jnp.ones((4, m, k)), jnp.ones((4, k, n)))
    assert [op.flops for op in batched.ops if op.primitive == "dot_general"] == [2 * 4 * m * n * k]


def test_conv_flops():
    n, h, w, cin, cout, kh, kw = 2, 8, 8, 3, 4, 3, 3
    conv = partial(jax.lax.conv_general_dilated, padding="SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))
    x, kernel = jnp.ones((n, h, w, cin)), jnp.ones((kh, kw, cin, cout))
    forward = 2 * n * h * w * cout * kh * kw * cin
    for stride in (1, 2):
        # squared: the gradient reads the forward (of a plain sum it would not, and the forward would be dead code)
        graph = trace(jax.grad(lambda a, b: jnp.sum(conv(a, b, (stride, stride)) ** 2), argnums=(0, 1)), x, kernel)
        convs = [op.flops for op in graph.ops if op.primitive == "conv_general_dilated"]
        # forward, kernel gradient and input gradient all do the forward's multiply-adds
        assert convs == [forward / stride**2] * 3, (stride, convs)


def test_elementwise_and_layout_costs():
    graph = trace(lambda x: jnp.transpose(jnp.exp(x)).sum(), jnp.ones((4, 8)))
    flops = {op.primitive: op.flops for op in graph.ops}
    assert flops == {"exp": 32.0, "transpose": 0.0, "reduce_sum": 32.0}


# --- errors --------------------------------------------------------------------------


def concretizes(x):
    return x * float(x.sum())


def mismatched(x):
    return x @ jnp.ones((3, 3))


@pytest.mark.parametrize("fn, original", [(concretizes, "ConcretizationTypeError"), (mismatched, "TypeError")])
def test_untraceable_functions_raise_trace_error(fn, original):
    with pytest.raises(TraceError, match=fn.__name__) as info:
        trace(fn, jnp.ones((4, 4)))
    assert original in str(info.value)
    assert info.value.__cause__ is not None


def test_a_leaked_tracer_is_a_trace_error():
    def leaky(x):
        a = jnp.sum(x)

        @jax.custom_vjp
        def scale(v):
            return v * a

        scale.defvjp(lambda v: (v * a, None), lambda _, g: (g * a,))
        return jnp.sum(scale(x))

    with pytest.raises(TraceError, match="escaped"):
        trace(jax.grad(leaky), X)


# --- evaluate ------------------------------------------------------------------------


def test_evaluate_calls_the_hook_on_every_op():
    graph = trace(lambda x: jnp.sum(jnp.exp(x) * 2.0), X)
    seen = []

    def hook(op, outs):
        seen.append(op.name)
        return [o * 10.0 for o in outs] if op.primitive == "exp" else outs

    (out,) = evaluate(graph, [X], on_output=hook)
    assert seen == [op.name for op in graph.ops]
    assert_close(jnp.sum(jnp.exp(X) * 20.0), out)


def test_evaluate_hook_can_shard_under_jit():
    """The runtime's use: constrain each op's output to a sharding, inside one jit."""
    ex, graph = trace_of("mlp")
    mesh = Mesh(np.array(jax.devices()[:8]), ("data",))

    def shard_batch(op, outs):
        return [
            jax.lax.with_sharding_constraint(o, NamedSharding(mesh, P("data")))
            if op.primitive == "dot_general" and o.shape[:1] == (ex.config.batch,) else o
            for o in outs
        ]

    expected = jax.jit(ex.train_step)(*ex.args)
    actual = jax.jit(as_function(graph, on_output=shard_batch))(*ex.args)
    assert_close(expected, actual, rtol=1e-5, atol=1e-6)


def test_evaluate_checks_its_arguments():
    graph = trace(jnp.sin, X)
    with pytest.raises(ValueError, match="1 flat arguments"):
        evaluate(graph, [X, X])
    with pytest.raises(ValueError, match="structure"):
        as_function(graph)((X,))
