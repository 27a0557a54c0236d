"""Alpa's ``DataLoader``: batches from a host iterator, put on the devices where a plan reads them, ahead of use.

A step given host arrays puts them on its devices itself, after the previous step's work is queued, so each
step waits for its own batch's transfer. Put ahead with ``jax.device_put`` (asynchronous), the next batches
travel while the current step computes, and arrive in the plan's layout (each device gets its tile only).
"""

from __future__ import annotations

import collections
import itertools
from collections.abc import Iterable, Iterator
from typing import Any

import jax
import numpy as np

__all__ = ["DataLoader", "MeshDriverDataLoader"]


def _is_spec(x: Any) -> bool:
    return hasattr(x, "mesh_ids") and hasattr(x, "shardings")


class DataLoader:
    """``DataLoader(input_iter, placement_specs, prefetch_size=1)``, as Alpa's: iterate over the batches of
    ``input_iter``, each placed as ``placement_specs`` say (a step's ``get_executable(...)
    .get_input_placement_specs()[1]``, a pytree of ``PlacementSpec`` whose leaves match a batch's), with
    ``prefetch_size`` batches put on the devices ahead of the one being used (0: each when asked for).

    A leaf that several meshes read (a pipeline's batch, which every stage reading it lists) goes to the first,
    where the runtime cuts it into micro-batches. In this process: the placements must carry shardings (a plan
    for this process's devices; a Ray cluster's mesh workers receive the batches a run sends them)."""

    def __init__(self, input_iter: Iterable[Any], placement_specs: Any, prefetch_size: int = 1):
        if isinstance(prefetch_size, bool) or not isinstance(prefetch_size, (int, np.integer)) or prefetch_size < 0:
            raise ValueError(f"prefetch_size must be a whole number of batches (0: none ahead), got {prefetch_size!r}")
        specs = jax.tree_util.tree_leaves(placement_specs, is_leaf=_is_spec)
        if not specs or not all(_is_spec(s) for s in specs):
            raise ValueError("placement_specs must be a pytree of PlacementSpec (executable.get_input_placement_specs()[1], "
                             f"the batch's), got {type(placement_specs).__name__}")
        missing = [i for i, s in enumerate(specs) if not s.shardings]
        if missing:
            raise ValueError(
                f"placement spec {missing[0]} has no shardings, so it says no devices to put the batch on: either it was "
                "made by hand (PlacementSpec(aval, mesh_ids, specs) names a plan's meshes by number: take the step's, "
                "executable.get_input_placement_specs()[1], or give shardings=(a jax NamedSharding,)), or its plan is "
                "for devices this process does not have (a Ray cluster's), whose run sends the mesh workers its batches: "
                "iterate over the host batches instead")
        self.input_iter = input_iter
        self.prefetch_size = int(prefetch_size)
        self.placement_specs = placement_specs
        self._specs = specs
        self._iter: Iterator[Any] | None = None

    def _place(self, batch: Any) -> Any:
        leaves, tree = jax.tree_util.tree_flatten(batch)
        if len(leaves) != len(self._specs):
            raise ValueError(f"a batch has {len(leaves)} array leaves but the placement specs describe {len(self._specs)}: "
                             "give the placement specs of the step's batch argument (get_input_placement_specs()[1])")
        placed = []
        for i, (x, spec) in enumerate(zip(leaves, self._specs)):
            if tuple(np.shape(x)) != tuple(spec.aval.shape):
                raise ValueError(f"batch leaf {i} has shape {tuple(np.shape(x))} but its placement spec is for "
                                 f"{tuple(spec.aval.shape)}: every batch must have the planned shapes")
            placed.append(jax.device_put(x, spec.shardings[0]))
        return jax.tree_util.tree_unflatten(tree, placed)

    def __iter__(self) -> Iterator[Any]:
        source = iter(self.input_iter)
        queue: collections.deque = collections.deque()

        def enqueue(n: int) -> None:
            for batch in itertools.islice(source, n):
                queue.append(self._place(batch))

        enqueue(max(self.prefetch_size, 1))
        while queue:
            batch = queue.popleft()
            if self.prefetch_size:  # keep prefetch_size batches in flight while this one is used
                enqueue(self.prefetch_size - len(queue))
            yield batch
            if not self.prefetch_size:
                enqueue(1)


class MeshDriverDataLoader(DataLoader):
    """``MeshDriverDataLoader(batch_size, num_samples, input_iter_func, placement_specs, prefetch_size=1, repeat=False)``,
    as Alpa's, for data each host makes itself: ``input_iter_func(start, end, batch_size)`` yields the batches of
    samples ``start`` to ``end - 1``, ``batch_size`` rows each. This process holds every device it plans for, so it
    is asked for all the samples of the ``num_samples // batch_size`` whole batches (Alpa's hosts each ask for their
    share; as in Alpa, a ragged tail is left out). Each batch is placed as ``placement_specs`` say (``DataLoader``),
    and with ``repeat`` the loader starts over after the last one, without end."""

    def __init__(self, batch_size: int, num_samples: int, input_iter_func: Any, placement_specs: Any,
                 prefetch_size: int = 1, repeat: bool = False):
        for name, value in (("batch_size", batch_size), ("num_samples", num_samples)):
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
                raise ValueError(f"{name} must be a positive whole number, got {value!r}")
        if num_samples < batch_size:
            raise ValueError(f"num_samples={num_samples} holds no batch of batch_size={batch_size}: give at least one batch's samples")
        if not callable(input_iter_func):
            raise TypeError(f"input_iter_func must be a function (start, end, batch_size) -> iterator of batches, got "
                            f"{type(input_iter_func).__name__}")
        self.batch_size, self.num_samples, self.repeat = int(batch_size), int(num_samples), bool(repeat)
        self.input_iter_func = input_iter_func
        super().__init__(_Epochs(self), placement_specs, prefetch_size)

    def __len__(self) -> int:
        """Batches in one pass (Alpa's ``len``), endless or not."""
        return self.num_samples // self.batch_size


class _Epochs:
    """The batches of ``MeshDriverDataLoader``: one pass of ``input_iter_func``, or passes without end with ``repeat``."""

    def __init__(self, loader: MeshDriverDataLoader) -> None:
        self.loader = loader

    def __iter__(self) -> Iterator[Any]:
        loader = self.loader
        while True:
            taken = 0
            end = len(loader) * loader.batch_size  # as Alpa's: whole batches only, a ragged tail left out
            for batch in itertools.islice(loader.input_iter_func(0, end, loader.batch_size), len(loader)):
                taken += 1
                yield batch
            if taken < len(loader):
                raise ValueError(f"input_iter_func(0, {end}, {loader.batch_size}) yielded {taken} batches, "
                                 f"not the {len(loader)} of {end} samples in batches of {loader.batch_size}")
            if not loader.repeat:
                return
