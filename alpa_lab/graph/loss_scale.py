"""Dynamic loss scaling for mixed-precision training, whose gradients a pipeline can cut (Alpa's ``DynamicScale``)."""

from __future__ import annotations

import functools
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
from flax import struct
from flax.training.dynamic_scale import DynamicScaleResult

from alpa_lab.graph.markers import value_and_grad


@struct.dataclass
class DynamicScale:
    """Flax's ``DynamicScale`` (same fields, same rule) with the gradient taken by ``alpa_lab.value_and_grad``.

    Flax's takes it with ``jax.value_and_grad``, inside which an argument-less ``mark_pipeline_boundary()``
    cannot be mirrored in the backward pass, so a pipelined step refused it; Alpa ships its own for that reason.
    The loss is multiplied by ``scale`` before differentiating and the gradients divided by it after; where a
    gradient is not finite the scale shrinks by ``backoff_factor`` (the caller skips the update), and after
    ``growth_interval`` finite steps in a row it grows by ``growth_factor``.
    """

    growth_factor: float = struct.field(pytree_node=False, default=2.0)
    backoff_factor: float = struct.field(pytree_node=False, default=0.5)
    growth_interval: int = struct.field(pytree_node=False, default=2000)
    fin_steps: Any = 0
    scale: Any = 65536.0
    minimum_scale: float | None = struct.field(pytree_node=False, default=float(jnp.finfo(jnp.float32).tiny))

    def value_and_grad(
        self, fun: Callable[..., Any], argnums: int | Sequence[int] = 0, has_aux: bool = False, axis_name: str | None = None,
    ) -> Callable[..., DynamicScaleResult]:
        """``fun``'s value and gradients at the current scale: a function returning Flax's ``DynamicScaleResult``
        ``(dynamic_scale, finite, aux, grad)``; ``axis_name``: the gradients averaged over that axis (under
        ``pmap`` / ``shard_map``, as Flax's)."""

        @functools.wraps(fun)
        def scaled(*args: Any) -> Any:
            out = fun(*args)
            return (self.scale * out[0], out[1]) if has_aux else self.scale * out

        differentiated = value_and_grad(scaled, argnums, has_aux)

        def run(*args: Any) -> DynamicScaleResult:
            value, grads = differentiated(*args)
            value = (value[0] / self.scale, value[1]) if has_aux else value / self.scale
            grads = jax.tree_util.tree_map(lambda g: jnp.asarray(g, jnp.float32) / self.scale, grads)
            if axis_name is not None:
                grads = jax.lax.pmean(grads, axis_name)
            finite = jnp.array(True)
            for g in jax.tree_util.tree_leaves(grads):
                finite &= jnp.all(jnp.isfinite(g))
            grow = self.fin_steps == self.growth_interval
            grown = jnp.where(grow & finite, jnp.minimum(self.scale * self.growth_factor, jnp.finfo(jnp.float32).max), self.scale)
            shrunk = self.scale * self.backoff_factor
            if self.minimum_scale is not None:
                shrunk = jnp.maximum(shrunk, self.minimum_scale)
            new = self.replace(fin_steps=jnp.where(grow | ~finite, 0, self.fin_steps + 1), scale=jnp.where(finite, grown, shrunk))
            return DynamicScaleResult(new, finite, value, grads)

        return run
