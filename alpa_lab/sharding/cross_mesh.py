"""Cross-mesh resharding as unit communication tasks (Zhuang et al., MLSys'23, sec. 3-4).

A tensor held with one sharding spec on a source sub-mesh is needed with another spec on
a destination sub-mesh (a pipeline stage's activation or gradient going to the next
stage). The paper decomposes the move into *unit communication tasks*: cut the tensor into
the regions that are intersections of a source tile and a destination tile. Each region
lies in exactly one source tile and one destination tile, so every device of the source
mesh that holds that tile (its replicas) is a possible *sender*, and every device of the
destination mesh that holds that tile is a *receiver*. A receiver that already holds the
region (meshes that share devices) copies it locally; every other receiver gets it from one
sender, chosen by the paper's greedy load balancing (heaviest task first, least-loaded
sender, a sender on the receiver's host when there is one). A sender is chosen per
(unit task, receiver), i.e. point-to-point sends as the runtime's ``device_put`` does; the
paper's broadcast variant instead picks one sender per unit task and pipelines the region
to all its receivers.

This module is plain data and numpy: it says what moves where, not how JAX moves it.
"""

from __future__ import annotations

import itertools
import math
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from alpa_lab.cost.cluster import ClusterSpec
from alpa_lab.sharding.spec import ShardingSpec, ShardingSpecError

__all__ = ["CrossMeshResharding", "Region", "UnitTask", "cross_mesh_resharding", "tile_regions"]

Region = tuple[tuple[int, int], ...]
"""A box of the global tensor: per tensor axis a half-open range [start, stop)."""


@dataclass(frozen=True)
class UnitTask:
    """One region of the tensor: who holds it (senders) and who needs it (receivers).

    ``assignment`` has one (sender, receiver) pair per receiver; a pair (d, d) is a device
    that already holds the region because it is on both meshes (a local copy, no traffic).
    """

    region: Region
    nbytes: int
    senders: tuple[int, ...]
    receivers: tuple[int, ...]
    assignment: tuple[tuple[int, int], ...]

    @property
    def slices(self) -> tuple[slice, ...]:
        """The region as numpy index: ``x[task.slices]`` is the data this task moves."""
        return tuple(slice(a, b) for a, b in self.region)


@dataclass(frozen=True)
class CrossMeshResharding:
    """A tensor moved from ``src_spec`` on one sub-mesh to ``dst_spec`` on another.

    Sub-meshes are given as a logical mesh shape and the global device ids in row-major
    order (as ``jax.sharding.Mesh(np.array(devices).reshape(shape), ...)`` lays them out).
    """

    shape: tuple[int, ...]
    dtype: str
    src_spec: ShardingSpec
    src_mesh_shape: tuple[int, ...]
    src_devices: tuple[int, ...]
    dst_spec: ShardingSpec
    dst_mesh_shape: tuple[int, ...]
    dst_devices: tuple[int, ...]
    tasks: tuple[UnitTask, ...]

    # ----- traffic -----------------------------------------------------------------------
    @property
    def pairs(self) -> tuple[tuple[int, int, int], ...]:
        """Every (sender, receiver, bytes) that crosses a link (local copies left out)."""
        return tuple((s, r, t.nbytes) for t in self.tasks for s, r in t.assignment if s != r)

    @property
    def total_bytes(self) -> int:
        """Bytes sent over all links: each region once per receiver that lacks it."""
        return sum(n for _, _, n in self.pairs)

    def bytes_by_pair(self) -> dict[tuple[int, int], int]:
        """(sender device, receiver device) -> bytes."""
        out: dict[tuple[int, int], int] = defaultdict(int)
        for s, r, n in self.pairs:
            out[(s, r)] += n
        return dict(out)

    def bytes_between(self, host_of: Callable[[int], int]) -> dict[tuple[int, int], int]:
        """(sender host, receiver host) -> bytes; (h, h) is traffic inside host h."""
        out: dict[tuple[int, int], int] = defaultdict(int)
        for s, r, n in self.pairs:
            out[(host_of(s), host_of(r))] += n
        return dict(out)

    def inter_host_bytes(self, devices_per_host: int) -> int:
        """Bytes whose sender and receiver are on different hosts (the slow links)."""
        return sum(n for s, r, n in self.pairs if s // devices_per_host != r // devices_per_host)

    def sent_bytes(self) -> dict[int, int]:
        """Per sender device, the bytes it sends."""
        out: dict[int, int] = defaultdict(int)
        for s, _, n in self.pairs:
            out[s] += n
        return dict(out)

    def received_bytes(self) -> dict[int, int]:
        """Per receiver device, the bytes it receives."""
        out: dict[int, int] = defaultdict(int)
        for _, r, n in self.pairs:
            out[r] += n
        return dict(out)

    def cost(self, cluster: ClusterSpec) -> float:
        """Seconds for the move: the busiest device's link time, plus one latency.

        time = max over devices d of max(send(d), recv(d)) + alpha, where
        send(d) = intra-host bytes d sends / intra_host_bandwidth
                + inter-host bytes d sends / inter_host_bandwidth (recv(d) likewise), and
        alpha is the latency of the slowest kind of link used.

        Why: all unit tasks run at once, so the move is bound by the device whose link
        carries the most; a link is full duplex, so a device's sends and receives overlap,
        while the sends of one device share its link and add up. ClusterSpec bandwidths are
        per device (the network already divided among a host's devices), which is what a
        per-device bound needs. This is the quantity the greedy balances.
        """
        pairs = self.pairs
        if not pairs:
            return 0.0
        per_host = cluster.devices_per_host
        send: dict[int, float] = defaultdict(float)
        recv: dict[int, float] = defaultdict(float)
        crosses = False
        for s, r, n in pairs:
            inter = s // per_host != r // per_host
            crosses |= inter
            t = n / (cluster.inter_host_bandwidth if inter else cluster.intra_host_bandwidth)
            send[s] += t
            recv[r] += t
        alpha = cluster.inter_host_latency if crosses else cluster.intra_host_latency
        return max(max(send.values()), max(recv.values())) + alpha

    def summary(self) -> str:
        return (
            f"{self.dtype}{list(self.shape)} {self.src_spec} on {_mesh_str(self.src_mesh_shape, self.src_devices)} -> "
            f"{self.dst_spec} on {_mesh_str(self.dst_mesh_shape, self.dst_devices)}: "
            f"{len(self.tasks)} unit tasks, {self.total_bytes} bytes"
        )


def _mesh_str(shape: tuple[int, ...], devices: tuple[int, ...]) -> str:
    return f"{'x'.join(map(str, shape))}[{','.join(map(str, devices))}]"


def tile_regions(
    shape: Sequence[int], spec: ShardingSpec | str, mesh_shape: Sequence[int], devices: Sequence[int]
) -> dict[int, Region]:
    """Global device id -> the region of the tensor it holds under ``spec`` on that mesh."""
    shape, mesh_shape, devices = tuple(shape), tuple(mesh_shape), tuple(devices)
    spec = _check(shape, spec, mesh_shape, devices, "")
    out = {}
    for coord, sl in spec.tile_map(shape, mesh_shape).items():
        out[devices[int(np.ravel_multi_index(coord, mesh_shape))]] = tuple((s.start, s.stop) for s in sl)
    return out


def _check(
    shape: tuple[int, ...], spec: ShardingSpec | str, mesh_shape: tuple[int, ...], devices: tuple[int, ...], side: str
) -> ShardingSpec:
    """The spec, parsed; a ShardingSpecError (a ValueError) saying what does not fit."""
    where = f"{side} " if side else ""
    spec = ShardingSpec.parse(spec) if isinstance(spec, str) else spec
    if any(int(n) < 0 for n in shape):
        raise ShardingSpecError(f"tensor shape {shape} has a negative dimension")
    if not mesh_shape or any(int(n) < 1 for n in mesh_shape):
        raise ShardingSpecError(f"{where}mesh shape {mesh_shape} must have positive sizes")
    if len(devices) != math.prod(mesh_shape):
        raise ShardingSpecError(
            f"{where}mesh {mesh_shape} holds {math.prod(mesh_shape)} devices but {len(devices)} device ids were given"
        )
    if len(set(devices)) != len(devices):
        raise ShardingSpecError(f"{where}mesh device ids {devices} repeat a device")
    if spec.rank != len(shape):
        raise ShardingSpecError(
            f"{where}spec {spec} has {spec.rank} entries but the tensor of shape {shape} has rank {len(shape)}"
        )
    bad_axes = [a for a in spec.mesh_axes_used if a >= len(mesh_shape)]
    if bad_axes:
        raise ShardingSpecError(
            f"{where}spec {spec} splits over mesh axis {bad_axes[0]} but the mesh {mesh_shape} has {len(mesh_shape)} axes"
        )
    for axis, (size, axes) in enumerate(zip(shape, spec.dims)):
        parts = math.prod(mesh_shape[a] for a in axes)
        if size % parts:
            raise ShardingSpecError(
                f"{where}spec {spec} splits tensor axis {axis} (size {size}) into {parts} parts on mesh {mesh_shape}, "
                "which does not divide it"
            )
    return spec


def _pieces(size: int, parts_a: int, parts_b: int) -> list[tuple[int, int]]:
    """The ranges one tensor axis is cut into by two block partitions (their common refinement).

    The intersection of a block of one partition with a block of the other holds no cut of
    either inside it, so the non-empty intersections are exactly these ranges.
    """
    cuts = sorted({size * k // parts_a for k in range(parts_a + 1)} | {size * k // parts_b for k in range(parts_b + 1)})
    return list(zip(cuts[:-1], cuts[1:])) if size else [(0, 0)]


def _holders(
    shape: tuple[int, ...], spec: ShardingSpec, mesh_shape: tuple[int, ...], devices: tuple[int, ...]
) -> dict[Region, tuple[int, ...]]:
    """Tile -> the devices that hold it (its replicas), in mesh order."""
    out: dict[Region, list[int]] = defaultdict(list)
    for device, region in tile_regions(shape, spec, mesh_shape, devices).items():
        out[region].append(device)
    return {k: tuple(v) for k, v in out.items()}


def _tile_of(region: Region, tile_shape: tuple[int, ...]) -> Region:
    """The tile (of a uniform partition with tiles of ``tile_shape``) that holds ``region``."""
    out = []
    for (start, _), t in zip(region, tile_shape):
        first = start // t * t if t else 0
        out.append((first, first + t))
    return tuple(out)


def cross_mesh_resharding(
    shape: Sequence[int],
    dtype: str | np.dtype,
    src_spec: ShardingSpec | str,
    src_mesh_shape: Sequence[int],
    src_devices: Sequence[int],
    dst_spec: ShardingSpec | str,
    dst_mesh_shape: Sequence[int],
    dst_devices: Sequence[int],
    *,
    devices_per_host: int | None = None,
) -> CrossMeshResharding:
    """The unit tasks of moving a tensor between two sub-meshes, with a sender per receiver.

    ``devices_per_host`` (device d is on host d // devices_per_host, as in ``ClusterSpec``)
    lets the greedy prefer a sender on the receiver's host; None: no preference. Meshes
    may share devices. Raises ``ShardingSpecError`` when a spec does not fit its mesh or
    the tensor.
    """
    shape = tuple(int(n) for n in shape)
    src_mesh_shape, dst_mesh_shape = tuple(src_mesh_shape), tuple(dst_mesh_shape)
    src_devices, dst_devices = tuple(int(d) for d in src_devices), tuple(int(d) for d in dst_devices)
    src = _check(shape, src_spec, src_mesh_shape, src_devices, "source")
    dst = _check(shape, dst_spec, dst_mesh_shape, dst_devices, "destination")
    if devices_per_host is not None and devices_per_host < 1:
        raise ValueError(f"devices_per_host must be positive, got {devices_per_host}")
    itemsize = np.dtype(dtype).itemsize

    src_tiles = _holders(shape, src, src_mesh_shape, src_devices)
    dst_tiles = _holders(shape, dst, dst_mesh_shape, dst_devices)
    per_axis = [
        _pieces(size, math.prod(src_mesh_shape[a] for a in sa), math.prod(dst_mesh_shape[a] for a in da))
        for size, sa, da in zip(shape, src.dims, dst.dims)
    ]
    src_tile, dst_tile = src.tile_shape(shape, src_mesh_shape), dst.tile_shape(shape, dst_mesh_shape)
    found = []  # (region, bytes, senders, receivers), regions in row-major order
    for region in itertools.product(*per_axis):
        nbytes = math.prod(b - a for a, b in region) * itemsize
        found.append((region, nbytes, src_tiles[_tile_of(region, src_tile)], dst_tiles[_tile_of(region, dst_tile)]))

    # the paper's greedy: heaviest unit task first, each receiver to the least-loaded sender
    # (on its own host when one is); ties go to the lower device id, so plans are stable
    load: dict[int, int] = defaultdict(int)
    chosen: dict[tuple[int, int], int] = {}
    order = sorted(range(len(found)), key=lambda k: (-found[k][1], k))
    for k in order:
        _, nbytes, senders, receivers = found[k]
        for r in receivers:
            if r in senders:
                chosen[(k, r)] = r
                continue
            near = [s for s in senders if devices_per_host is not None and s // devices_per_host == r // devices_per_host]
            s = min(near or senders, key=lambda d: (load[d], d))
            load[s] += nbytes
            chosen[(k, r)] = s
    tasks = tuple(
        UnitTask(region, nbytes, senders, receivers, tuple((chosen[(k, r)], r) for r in receivers))
        for k, (region, nbytes, senders, receivers) in enumerate(found)
    )
    return CrossMeshResharding(
        shape, np.dtype(dtype).name, src, src_mesh_shape, src_devices, dst, dst_mesh_shape, dst_devices, tasks
    )
