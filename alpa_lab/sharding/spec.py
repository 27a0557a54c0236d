"""Sharding specs in the notation of the Alpa paper (OSDI'22, sec. 4.1, Table 1).

A sharding spec says, for every tensor axis, whether it is replicated (``R``) or split
(``S``) over one or more axes of a 2-D logical device mesh: ``S0R`` splits a matrix's rows
over mesh axis 0, ``RS01`` splits its columns over both mesh axes (axis 0 major).  A 1-D
mesh is a 2-D mesh with one axis of size 1.

The spec is pure data; it knows which tile every device holds and how to become a
``jax.sharding.PartitionSpec``, but nothing about costs (see ``resharding.py``).
"""

from __future__ import annotations

import functools
import itertools
import math
import re
from dataclasses import dataclass

from jax.sharding import PartitionSpec

MeshAxes = tuple[int, ...]
"""Mesh axes one tensor axis is split over, major first: () is R, (0,) is S0, (0, 1) is S01."""

DEFAULT_AXIS_NAMES = ("x", "y")
"""Names of logical mesh axes 0 and 1 when a spec becomes a PartitionSpec."""

_TOKEN = re.compile(r"R|S[01]{1,2}")


class ShardingSpecError(ValueError):
    """A sharding spec that is malformed or does not fit a tensor or mesh."""


@dataclass(frozen=True)
class ShardingSpec:
    """One entry per tensor axis: the mesh axes that axis is split over."""

    dims: tuple[MeshAxes, ...]

    # ----- construction and printing -------------------------------------------------
    @classmethod
    def replicated(cls, rank: int) -> ShardingSpec:
        return cls(tuple(() for _ in range(rank)))

    @classmethod
    def parse(cls, text: str) -> ShardingSpec:
        """Parse ``"S0R"``, ``"RS01"``, ``"S0RS1"``; ``"-"`` is the spec of a scalar."""
        text = text.strip()
        if text in ("-", ""):
            return cls(())
        tokens = _TOKEN.findall(text)
        if "".join(tokens) != text:
            raise ShardingSpecError(
                f"cannot parse sharding spec {text!r}: write one token per tensor axis, "
                "each R, S0, S1, S01 or S10 (e.g. 'S0R', 'RS01')"
            )
        dims = []
        for tok in tokens:
            axes = tuple(int(c) for c in tok[1:])
            if len(set(axes)) != len(axes):
                raise ShardingSpecError(f"sharding spec {text!r} repeats a mesh axis in {tok}")
            dims.append(axes)
        spec = cls(tuple(dims))
        spec._check_axes_used_once(text)
        return spec

    def __str__(self) -> str:
        return _text(self.dims)

    def __repr__(self) -> str:
        return f"ShardingSpec({self})"

    def _check_axes_used_once(self, text: str) -> None:
        used = [a for axes in self.dims for a in axes]
        if len(used) != len(set(used)):
            raise ShardingSpecError(
                f"sharding spec {text!r} splits two tensor axes over the same mesh axis; "
                "each mesh axis may appear once"
            )

    # ----- structure -----------------------------------------------------------------
    @property
    def rank(self) -> int:
        return len(self.dims)

    @property
    def mesh_axes_used(self) -> tuple[int, ...]:
        return _axes_used(self.dims)

    def num_shards(self, mesh_shape: tuple[int, ...]) -> int:
        """Number of distinct tiles: the product of the sizes of the mesh axes used."""
        return _num_shards(self.dims, tuple(mesh_shape))

    def replication(self, mesh_shape: tuple[int, ...]) -> int:
        """How many devices hold each tile."""
        return math.prod(mesh_shape) // self.num_shards(mesh_shape)

    def is_valid_for(self, shape: tuple[int, ...], mesh_shape: tuple[int, ...]) -> bool:
        """Same rank, every mesh axis used at most once, and each split axis divides evenly."""
        return _fits(self.dims, tuple(shape), tuple(mesh_shape))

    def tile_shape(self, shape: tuple[int, ...], mesh_shape: tuple[int, ...]) -> tuple[int, ...]:
        return tuple(
            size // math.prod(mesh_shape[a] for a in axes) for size, axes in zip(shape, self.dims)
        )

    def tile_index(self, device: tuple[int, ...], mesh_shape: tuple[int, ...]) -> tuple[int, ...]:
        """Which tile (per tensor axis, a block index) the device at mesh coordinate holds.

        Along a tensor axis split over mesh axes (a, b), the block index is
        ``device[a] * mesh_shape[b] + device[b]``: the first mesh axis is the major one,
        the same order as ``PartitionSpec(("x", "y"))``.
        """
        index = []
        for axes in self.dims:
            block = 0
            for a in axes:
                block = block * mesh_shape[a] + device[a]
            index.append(block)
        return tuple(index)

    def tile_map(self, shape: tuple[int, ...], mesh_shape: tuple[int, ...]) -> dict[tuple[int, ...], tuple[slice, ...]]:
        """For every device coordinate, the slice of the full tensor it holds."""
        tile = self.tile_shape(shape, mesh_shape)
        out = {}
        for device in itertools.product(*(range(n) for n in mesh_shape)):
            idx = self.tile_index(device, mesh_shape)
            out[device] = tuple(slice(i * t, (i + 1) * t) for i, t in zip(idx, tile))
        return out

    # ----- conversion ----------------------------------------------------------------
    def to_partition_spec(self, axis_names: tuple[str, ...] = DEFAULT_AXIS_NAMES) -> PartitionSpec:
        entries = []
        for axes in self.dims:
            if not axes:
                entries.append(None)
            elif len(axes) == 1:
                entries.append(axis_names[axes[0]])
            else:
                entries.append(tuple(axis_names[a] for a in axes))
        return PartitionSpec(*entries)

    @classmethod
    def from_partition_spec(
        cls, pspec: PartitionSpec, rank: int, axis_names: tuple[str, ...] = DEFAULT_AXIS_NAMES
    ) -> ShardingSpec:
        entries = tuple(pspec)
        if len(entries) > rank:
            raise ShardingSpecError(f"PartitionSpec {pspec} has {len(entries)} entries for a rank-{rank} tensor")
        dims = []
        for entry in entries + (None,) * (rank - len(entries)):
            names = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
            try:
                dims.append(tuple(axis_names.index(n) for n in names))
            except ValueError:
                raise ShardingSpecError(
                    f"PartitionSpec {pspec} names a mesh axis not in {axis_names}"
                ) from None
        spec = cls(tuple(dims))
        spec._check_axes_used_once(str(pspec))
        return spec


def enumerate_specs(
    shape: tuple[int, ...], mesh_shape: tuple[int, ...], *, allow_major_minor_swap: bool = False
) -> list[ShardingSpec]:
    """Every spec that fits ``shape`` on ``mesh_shape``, replicated first.

    Mesh axes of size 1 are never used (splitting over them changes nothing), so a 1-D
    mesh yields the 1-D specs only. ``S10`` is left out unless asked for: it holds the same
    data as ``S01`` in another device order, which only doubles the search (as in Alpa).
    """
    axes = [a for a, n in enumerate(mesh_shape) if n > 1]
    rank = len(shape)
    choices_per_axis = [[None] + list(range(rank)) for _ in axes]
    specs: list[ShardingSpec] = []
    seen = set()
    for assignment in itertools.product(*choices_per_axis):
        dims: list[list[int]] = [[] for _ in range(rank)]
        for mesh_axis, tensor_axis in zip(axes, assignment):
            if tensor_axis is not None:
                dims[tensor_axis].append(mesh_axis)
        orders = [ShardingSpec(tuple(tuple(d) for d in dims))]
        if allow_major_minor_swap:
            orders.append(ShardingSpec(tuple(tuple(reversed(d)) for d in dims)))
        for spec in orders:
            if spec not in seen and spec.is_valid_for(shape, mesh_shape):
                seen.add(spec)
                specs.append(spec)
    specs.sort(key=lambda s: (len(s.mesh_axes_used), str(s)))
    return specs


# Strategy enumeration asks these of the same few specs, shapes and meshes hundreds of thousands of
# times per plan (every candidate of every op, on every logical mesh): answered once each.


@functools.lru_cache(maxsize=65536)
def _text(dims: tuple[MeshAxes, ...]) -> str:
    if not dims:
        return "-"
    return "".join("R" if not axes else "S" + "".join(map(str, axes)) for axes in dims)


@functools.lru_cache(maxsize=65536)
def _fits(dims: tuple[MeshAxes, ...], shape: tuple[int, ...], mesh_shape: tuple[int, ...]) -> bool:
    if len(shape) != len(dims):
        return False
    used = [a for axes in dims for a in axes]
    if len(used) != len(set(used)) or any(a >= len(mesh_shape) for a in used):
        return False
    return all(size % math.prod(mesh_shape[a] for a in axes) == 0 for size, axes in zip(shape, dims))


@functools.lru_cache(maxsize=65536)
def _axes_used(dims: tuple[MeshAxes, ...]) -> tuple[int, ...]:
    return tuple(a for axes in dims for a in axes)


@functools.lru_cache(maxsize=65536)
def _num_shards(dims: tuple[MeshAxes, ...], mesh_shape: tuple[int, ...]) -> int:
    return math.prod(mesh_shape[a] for a in _axes_used(dims))
