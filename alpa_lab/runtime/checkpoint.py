"""Save a training state and restore it where a plan keeps it (Alpa's ``save_checkpoint`` / ``restore_checkpoint``).

A state trained by a plan is sharded, for a pipeline over several meshes. Orbax (the JAX
ecosystem's checkpointer, which Flax depends on) writes each array's shards as they lie, in its
own array format (no pickles), and reads them back straight into the shardings asked for, so a
state too large for one device is never gathered on one. ``restore_checkpoint`` takes those
shardings from the step's placement specs (``executable.get_input_placement_specs()[0]``, as
Alpa's users pass them), from ``plan.shardings(...)``, or from arrays already placed.

A checkpoint of step ``n`` is the folder ``{ckpt_dir}/{prefix}{n}``.
"""

from __future__ import annotations

import operator
import os
import re
from pathlib import Path
from typing import Any

import jax

__all__ = ["CheckpointError", "restore_checkpoint", "save_checkpoint"]


class CheckpointError(ValueError):
    """A checkpoint that cannot be written or read as asked (what, and what to do)."""


def _step_dir(ckpt_dir: str | os.PathLike, step: Any, prefix: str) -> Path:
    """The folder of step ``step``: a Python, numpy or 0-d JAX integer (``state.step`` will do)."""
    try:
        index = None if isinstance(step, bool) else operator.index(step)
    except TypeError:
        index = None
    if index is None or index < 0:
        raise CheckpointError(f"step must be a non-negative integer (e.g. int(state.step)), got {step!r}")
    return Path(ckpt_dir).absolute() / f"{prefix}{index}"


def saved_steps(ckpt_dir: str | os.PathLike, prefix: str = "checkpoint_") -> list[int]:
    """The steps saved in ``ckpt_dir``, oldest first."""
    folder = Path(ckpt_dir)
    if not folder.is_dir():
        return []
    pattern = re.compile(re.escape(prefix) + r"(\d+)")
    return sorted(int(m.group(1)) for p in folder.iterdir() if (m := pattern.fullmatch(p.name)) and p.is_dir())


def save_checkpoint(ckpt_dir: str | os.PathLike, target: Any, step: Any, local_cache_dir: Any = None, *,
                    prefix: str = "checkpoint_", overwrite: bool = False) -> Path:
    """Write ``target`` (a pytree of arrays, e.g. the training state) as step ``step`` in ``ckpt_dir``; returns
    the step's folder. Each array's shards are written from the devices holding them. A step already saved is
    kept unless ``overwrite=True``. ``local_cache_dir`` (Alpa's staging folder) is not needed here and must
    be None."""
    import orbax.checkpoint as ocp

    if local_cache_dir is not None:
        raise CheckpointError("save_checkpoint(local_cache_dir=...) stages Alpa's distributed writes; here the shards are "
                              "written directly: drop it")
    path = _step_dir(ckpt_dir, step, prefix)
    if path.exists() and not overwrite:
        raise CheckpointError(f"a checkpoint of step {step} exists in {str(ckpt_dir)!r}: save another step, or pass "
                              "overwrite=True to replace it")
    bad = [x for x in jax.tree_util.tree_leaves(target) if not hasattr(x, "shape") and not isinstance(x, (int, float))]
    if bad:
        raise CheckpointError(f"save_checkpoint saves arrays and numbers; the target has a {type(bad[0]).__name__} leaf: "
                              "make it a static field of the state, or leave it out")
    path.parent.mkdir(parents=True, exist_ok=True)
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(path, target, force=overwrite)
        checkpointer.wait_until_finished()
    return path


def _abstract(leaf: Any) -> jax.ShapeDtypeStruct:
    """Where and what a placement leaf asks for: a ``PlacementSpec`` (its first mesh's sharding), a sharded
    ``jax.ShapeDtypeStruct`` or an array (its sharding)."""
    shardings = getattr(leaf, "shardings", None)
    if shardings is not None and hasattr(leaf, "aval"):  # a PlacementSpec
        if not shardings:
            raise CheckpointError("a PlacementSpec without shardings (made by hand, or for devices this process does not "
                                  "have, as a Ray cluster's): take them from executable.get_input_placement_specs() where the "
                                  "plan's devices are, or pass sharded jax.ShapeDtypeStructs")
        return jax.ShapeDtypeStruct(leaf.aval.shape, leaf.aval.dtype, sharding=shardings[0])
    if isinstance(leaf, jax.Array) or (isinstance(leaf, jax.ShapeDtypeStruct) and leaf.sharding is not None):
        return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=leaf.sharding)
    raise CheckpointError(
        f"restore_checkpoint places each leaf by a PlacementSpec, a sharded jax.ShapeDtypeStruct or a placed jax.Array; got a "
        f"{type(leaf).__name__}: pass executable.get_input_placement_specs()[0] (or the state's shardings as "
        "ShapeDtypeStructs)")


def restore_checkpoint(ckpt_dir: str | os.PathLike, step: Any, placement_specs: Any, prefix: str = "checkpoint_") -> Any:
    """Read step ``step`` of ``ckpt_dir`` into the structure of ``placement_specs``, each array straight onto the
    devices and sharding its leaf names (Alpa's order of arguments).

    ``placement_specs``: the step's ``PlacementSpec`` pytree for the state
    (``p_train_step.get_last_executable().get_input_placement_specs()[0]``), or a pytree of sharded
    ``jax.ShapeDtypeStruct``s or of arrays already placed (``jax.tree.map(lambda x: x.sharding, ...)``'s
    shapes). Its tree gives the result's (a ``TrainState``'s static fields come from it), and each array takes
    its leaf's dtype (Orbax casts a stored array of another dtype). A leaf several pipeline stages read is read
    onto the first of its meshes, where the runtime keeps it. Unlike Alpa's, ``save_checkpoint`` keeps a step
    already saved unless told ``overwrite=True``, as Flax's does."""
    import orbax.checkpoint as ocp

    path = _step_dir(ckpt_dir, step, prefix)
    if not path.is_dir():
        have = saved_steps(ckpt_dir, prefix)
        raise CheckpointError(f"no checkpoint of step {step} in {str(ckpt_dir)!r}; "
                              + (f"saved steps: {have}" if have else "it holds none (save_checkpoint writes them)"))
    is_placement = lambda x: hasattr(x, "mesh_ids") or isinstance(x, jax.ShapeDtypeStruct)  # noqa: E731
    target = jax.tree_util.tree_map(_abstract, placement_specs, is_leaf=is_placement)
    try:
        with ocp.StandardCheckpointer() as checkpointer:
            return checkpointer.restore(path, target)
    except (ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"the checkpoint of step {step} does not match the placements given (another state's "
                              f"structure or shapes?): {exc}") from exc
