"""Resharding a tensor from one sharding spec to another (Alpa paper, Table 2).

Every change of spec is decomposed, mesh axis by mesh axis, into the cheapest of:

* **slice** (free): a mesh axis the tensor was replicated over now splits it; each device
  keeps part of what it has (Table 2, ``RR -> S0S1``).
* **all-to-all**: a mesh axis moves from one tensor axis to another; each device swaps
  parts of its tile, whose size does not change (``S0R -> RS0``: all-to-all(M/n0, 0)).
* **all-gather**: a mesh axis no longer splits the tensor; devices collect the missing
  parts (``S0R -> RR``: all-gather(M, 0); ``S0S1 -> S0R``: all-gather(M/n0, 1)).

All-to-alls run first (while tiles are small), then one all-gather over every axis to
drop, then the free slices. An axis kept on the same tensor axis but at another major/minor
position counts as dropped and re-added, since the device no longer holds its new tile.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from alpa_lab.cost.cluster import Collective, LogicalMesh
from alpa_lab.sharding.spec import ShardingSpec, ShardingSpecError


@dataclass(frozen=True)
class Resharding:
    """The collectives that turn ``src`` into ``dst``, and their total cost in seconds."""

    src: ShardingSpec
    dst: ShardingSpec
    collectives: tuple[Collective, ...]

    @property
    def cost(self) -> float:
        return sum(c.cost for c in self.collectives)

    def __str__(self) -> str:
        body = " + ".join(map(str, self.collectives)) or "free"
        return f"{self.src} -> {self.dst}: {body}"


def resharding(
    src: ShardingSpec, dst: ShardingSpec, shape: tuple[int, ...], itemsize: int, mesh: LogicalMesh
) -> Resharding:
    """Collectives that reshard a tensor of ``shape`` from ``src`` to ``dst`` on ``mesh``."""
    if src.rank != len(shape) or dst.rank != len(shape):
        raise ShardingSpecError(
            f"resharding {src} -> {dst} needs specs of rank {len(shape)} (tensor shape {shape})"
        )
    if src == dst:
        return Resharding(src, dst, ())
    kept: set[int] = set()
    for s_axes, d_axes in zip(src.dims, dst.dims):
        for a, b in zip(s_axes, d_axes):  # common major-first prefix stays in place
            if a != b:
                break
            kept.add(a)
    src_dim = {a: d for d, axes in enumerate(src.dims) for a in axes}
    dst_dim = {a: d for d, axes in enumerate(dst.dims) for a in axes}
    moved = sorted(a for a in src_dim if a not in kept and a in dst_dim and dst_dim[a] != src_dim[a])
    gathered = sorted(a for a in src_dim if a not in kept and a not in moved)

    total = math.prod(shape) * itemsize
    tile = total / src.num_shards(mesh.shape)
    collectives = []
    for a in moved:
        if mesh.shape[a] > 1:
            collectives.append(mesh.collective("all-to-all", tile, (a,)))
    gathered = tuple(a for a in gathered if mesh.shape[a] > 1)
    if gathered:
        result = tile * math.prod(mesh.shape[a] for a in gathered)
        collectives.append(mesh.collective("all-gather", result, gathered))
    return Resharding(src, dst, tuple(collectives))


def resharding_cost(
    src: ShardingSpec, dst: ShardingSpec, shape: tuple[int, ...], itemsize: int, mesh: LogicalMesh
) -> float:
    return resharding(src, dst, shape, itemsize, mesh).cost
