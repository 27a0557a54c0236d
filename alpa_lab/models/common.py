"""What every example model hands the planner: a pure train step, its state and a batch.

Each family module only says how to initialise its parameters, how to compute its loss
and how to draw a batch; ``build_example`` turns that into one optimizer step so that all
families produce the same kind of program (forward, backward, optimizer update), which is
what Alpa plans.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax

from alpa_lab.graph.markers import value_and_grad

PyTree = Any
InitFn = Callable[[jax.Array], tuple[PyTree, PyTree]]
"""key -> (params, model_state): trainable parameters and non-trainable collections."""
LossFn = Callable[[PyTree, PyTree, PyTree], tuple[jax.Array, PyTree]]
"""(params, model_state, batch) -> (scalar loss, new model_state)."""
BatchFn = Callable[[jax.Array], PyTree]
"""key -> batch: a deterministic batch of arrays."""


class TrainState(NamedTuple):
    """Everything a step reads and writes; a NamedTuple so it is a pytree with no registration.

    ``model_state`` holds non-trainable collections (BatchNorm's ``batch_stats``); it is an
    empty dict for models without any.
    """

    params: PyTree
    opt_state: PyTree
    model_state: PyTree


@dataclass(frozen=True)
class Example:
    """A model ready to plan and run: ``train_step(state, batch) -> (new_state, loss)``.

    ``train_step`` is pure and not jitted, so it can be traced, jitted or planned as is;
    ``new_state`` has the structure of ``state`` so steps can be chained. With
    ``abstract=True`` ``state`` and ``batch`` are ``jax.ShapeDtypeStruct`` pytrees: enough
    to trace and plan a model too large to allocate.
    """

    name: str
    config: Any
    train_step: Callable[[PyTree, PyTree], tuple[PyTree, jax.Array]]
    state: PyTree
    batch: PyTree
    abstract: bool = False
    loss_fn: LossFn | None = None
    """``(params, model_state, batch) -> (loss, new model_state)``: the step's loss, for references."""
    optimizer: optax.GradientTransformation | None = None

    @property
    def args(self) -> tuple[PyTree, PyTree]:
        """The train step's arguments, for ``trace(ex.train_step, *ex.args)``."""
        return (self.state, self.batch)


def build_example(
    name: str,
    config: Any,
    *,
    init: InitFn,
    loss_fn: LossFn,
    optimizer: optax.GradientTransformation,
    make_batch: BatchFn,
    seed: int,
    abstract: bool,
) -> Example:
    """One optimizer step over ``loss_fn``, with state and batch drawn from ``seed``."""

    def init_state(key: jax.Array) -> TrainState:
        params, model_state = init(key)
        return TrainState(params, optimizer.init(params), model_state)

    def train_step(state: TrainState, batch: PyTree) -> tuple[TrainState, jax.Array]:
        grad_fn = value_and_grad(loss_fn, has_aux=True)  # marks the loss and gradients for pipelining
        (loss, model_state), grads = grad_fn(state.params, state.model_state, batch)
        updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        return TrainState(params, opt_state, model_state), loss

    train_step.__name__ = train_step.__qualname__ = f"{name}_train_step"
    param_key, data_key = jax.random.split(jax.random.PRNGKey(seed))
    if abstract:
        state = jax.eval_shape(init_state, param_key)
        batch = jax.eval_shape(make_batch, data_key)
    else:
        state = run_once(init_state, param_key)
        batch = run_once(make_batch, data_key)
    return Example(name, config, train_step, state, batch, abstract, loss_fn, optimizer)


def run_once(fn: Callable[..., PyTree], *args: Any) -> PyTree:
    """``fn(*args)`` compiled without backend optimisation: it runs once, so compile time is all.

    Random initialisers are many small programs; run eagerly each compiles on its own, and
    jitted at the default level LLVM spends seconds optimising code that runs for a
    millisecond (14 s -> 3 s for the Wide-ResNet's init on CPU).
    """
    lowered = jax.jit(fn).lower(*args)
    try:
        compiled = lowered.compile(compiler_options={"xla_backend_optimization_level": 0})
    except Exception:  # a backend without that option: the default compile is still right
        compiled = lowered.compile()
    return compiled(*args)


def linen_init(model: Any, example_input: Callable[[], PyTree]) -> InitFn:
    """Init for a flax linen model: params plus any other collections (as model_state)."""

    def init(key: jax.Array) -> tuple[PyTree, PyTree]:
        variables = dict(model.init(key, example_input()))
        params = variables.pop("params")
        return params, variables

    return init


def dtype_of(name: str) -> jnp.dtype:
    """A config's dtype string ("float32", "bfloat16", ...) as a numpy dtype."""
    return jnp.dtype(name)
