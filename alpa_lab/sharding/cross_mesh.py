"""Cross-mesh resharding as unit communication tasks (Zhuang et al., MLSys'23, sec. 3-4).

A tensor held with one sharding spec on a source sub-mesh is needed with another spec on
a destination sub-mesh (a pipeline stage's activation or gradient going to the next
stage). The paper decomposes the move into *unit communication tasks*: cut the tensor into
the regions that are intersections of a source tile and a destination tile. Each region
lies in exactly one source tile and one destination tile, so every device of the source
mesh that holds that tile (its replicas) is a possible *sender*, and every device of the
destination mesh that holds that tile is a *receiver*. A receiver that already holds the
region (meshes that share devices) copies it locally.

Two ways to deliver a unit task (``method``):

* ``"broadcast"`` (the default; the paper's sec. 3.1): per unit task and per receiving
  *host*, one sender device; the region crosses the network once into that host, to the
  host's first receiver, which forwards it (pipelined, in chunks) to the next receiver on
  the host over the fast intra-host links, and so on: a chain
  ``sender -> r1 -> r2 -> ...``. ``UnitTask.assignment`` lists the chain's hops, so a pair
  ``(s, r)`` is "r gets the region from s", where s is a source device holding it or an
  earlier receiver of the same task on r's host. When some source device on the receiving
  host holds the region, the chain starts there and nothing crosses hosts.
* ``"send_recv"``: point to point, a sender per (unit task, receiver device) as the
  runtime's ``device_put`` does (heaviest task first, least-loaded sender, a sender on the
  receiver's host when there is one).

Load balance and order (the paper's sec. 3.2, "sec. 4.2" of its outline): the network
transfers (a unit task into one receiving host) are scheduled on host links. A host's
send side and its receive side each carry one transfer at a time (one NIC, full duplex);
a transfer takes ``nbytes / host_link`` (``ClusterSpec.host_link``) and starts when both its sender host's
send side and its receiver host's receive side are free. The pipelined intra-host forwarding
of a broadcast is hidden under the network transfer (the paper's ``t + A t / K`` with
K >> A, i.e. about one send). Sender hosts and the order are chosen to minimise the
makespan: the paper's greedy (heaviest first to the least-loaded sender host), a
randomised greedy that at each step starts the largest set of transfers whose hosts are
free, and, for small counts, a depth-first branch and bound over (next transfer, its sender
host) that prunes on per-host remaining-load bounds. The schedule is kept in *byte time*
(seconds x bandwidth), so it does not depend on the cluster's bandwidth.

This module is plain data and numpy: it says what moves where and when, not how JAX moves it.
"""

from __future__ import annotations

import itertools
import math
import random
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from alpa_lab.cost.cluster import ClusterSpec
from alpa_lab.graph.opgraph import dtype_of
from alpa_lab.sharding.spec import ShardingSpec, ShardingSpecError

__all__ = [
    "CrossMeshResharding",
    "Region",
    "ScheduledTransfer",
    "UnitTask",
    "cross_mesh_resharding",
    "list_schedule",
    "tile_regions",
]

Region = tuple[tuple[int, int], ...]
"""A box of the global tensor: per tensor axis a half-open range [start, stop)."""

METHODS = ("broadcast", "send_recv")
ORDERS = ("search", "naive")


@dataclass(frozen=True)
class UnitTask:
    """One region of the tensor: who holds it (senders) and who needs it (receivers).

    ``assignment`` has one (source, receiver) pair per receiver, in ``receivers`` order: the
    device the receiver gets the region from. A pair (d, d) is a device that already holds
    the region because it is on both meshes (a local copy, no traffic). With the broadcast
    method the source may be an earlier receiver on the same host (a hop of the chain).
    ``groups`` has one (sender device, receivers in chain order) per receiving host (one per
    receiver with send_recv); local copies are left out.
    """

    region: Region
    nbytes: int
    senders: tuple[int, ...]
    receivers: tuple[int, ...]
    assignment: tuple[tuple[int, int], ...]
    groups: tuple[tuple[int, tuple[int, ...]], ...] = ()

    @property
    def slices(self) -> tuple[slice, ...]:
        """The region as numpy index: ``x[task.slices]`` is the data this task moves."""
        return tuple(slice(a, b) for a, b in self.region)


@dataclass(frozen=True)
class ScheduledTransfer:
    """One network transfer of the schedule: unit task ``task`` into ``receiver_host``.

    ``start``/``end`` are in byte time (seconds x inter-host bandwidth): divide by the
    bandwidth for seconds. ``sender`` is the sending device, ``receivers`` the devices of
    the receiving host it feeds (the chain; one device with send_recv).
    """

    task: int
    sender_host: int
    receiver_host: int
    start: float
    end: float
    sender: int
    receivers: tuple[int, ...]

    @property
    def nbytes(self) -> float:
        return self.end - self.start


@dataclass(frozen=True)
class CrossMeshResharding:
    """A tensor moved from ``src_spec`` on one sub-mesh to ``dst_spec`` on another.

    Sub-meshes are given as a logical mesh shape and the global device ids in row-major
    order (as ``jax.sharding.Mesh(np.array(devices).reshape(shape), ...)`` lays them out).
    ``schedule`` is the ordered list of network (inter-host) transfers; ``makespan`` its
    completion in byte time; ``optimal`` says whether the branch and bound proved it best.
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
    method: str = "broadcast"
    order: str = "search"
    devices_per_host: int | None = None
    schedule: tuple[ScheduledTransfer, ...] = ()
    optimal: bool = False
    planning_seconds: float = field(default=0.0, compare=False)

    def host_of(self, device: int) -> int:
        """The host of a device under this plan's ``devices_per_host`` (None: one per device)."""
        return device if self.devices_per_host is None else device // self.devices_per_host

    # ----- traffic -----------------------------------------------------------------------
    @property
    def pairs(self) -> tuple[tuple[int, int, int], ...]:
        """Every (source, receiver, bytes) that crosses a link (local copies left out)."""
        return tuple((s, r, t.nbytes) for t in self.tasks for s, r in t.assignment if s != r)

    @property
    def total_bytes(self) -> int:
        """Bytes delivered over links: each region once per receiver that lacks it."""
        return sum(n for _, _, n in self.pairs)

    def bytes_by_pair(self) -> dict[tuple[int, int], int]:
        """(source device, receiver device) -> bytes."""
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

    def inter_host_bytes_into(self, devices_per_host: int) -> dict[int, int]:
        """Receiving host -> network bytes into it (hops whose sender is on another host)."""
        out: dict[int, int] = defaultdict(int)
        for s, r, n in self.pairs:
            if s // devices_per_host != r // devices_per_host:
                out[r // devices_per_host] += n
        return dict(out)

    def sent_bytes(self) -> dict[int, int]:
        """Per device, the bytes it sends (relays of a broadcast chain included)."""
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

    # ----- time --------------------------------------------------------------------------
    @property
    def makespan(self) -> float:
        """When the last network transfer ends, in byte time (seconds x bandwidth)."""
        return max((x.end for x in self.schedule), default=0.0)

    def intra_host_time(self, cluster: ClusterSpec) -> float:
        """Seconds of the busiest device's intra-host link: max over devices of what it sends
        or receives inside its host (local chains, relays of broadcasts, same-host sends)."""
        per_host = cluster.devices_per_host
        send: dict[int, int] = defaultdict(int)
        recv: dict[int, int] = defaultdict(int)
        for s, r, n in self.pairs:
            if s // per_host == r // per_host:
                send[s] += n
                recv[r] += n
        return max([*send.values(), *recv.values(), 0]) / cluster.intra_host_bandwidth

    def cost(self, cluster: ClusterSpec) -> float:
        """Seconds for the move under the paper's host-link model, plus one latency.

        time = max(makespan / host_link, intra-host time) + alpha: the network
        transfers run on host links as ``schedule`` orders them (a host link's send side and
        receive side each carry one transfer at a time, at ``ClusterSpec.host_link``: the paper's
        one-NIC host); the intra-host hops
        (broadcast chains, pipelined under the network transfer, and local sends) run on
        the devices' own fast links at the same time and are bound by the busiest device;
        alpha is the latency of the slowest kind of link used. A plan built with another
        ``devices_per_host`` than the cluster's is re-planned for the cluster's hosts.
        """
        if self.devices_per_host != cluster.devices_per_host:
            return self._replanned(cluster.devices_per_host).cost(cluster)
        pairs = self.pairs
        if not pairs:
            return 0.0
        crosses = bool(self.schedule)
        alpha = cluster.inter_host_latency if crosses else cluster.intra_host_latency
        return max(self.makespan / cluster.host_link, self.intra_host_time(cluster)) + alpha

    def _replanned(self, devices_per_host: int) -> CrossMeshResharding:
        return cross_mesh_resharding(
            self.shape, self.dtype, self.src_spec, self.src_mesh_shape, self.src_devices,
            self.dst_spec, self.dst_mesh_shape, self.dst_devices,
            devices_per_host=devices_per_host, method=self.method, order=self.order,
        )

    def summary(self) -> str:
        return (
            f"{self.dtype}{list(self.shape)} {self.src_spec} on {_mesh_str(self.src_mesh_shape, self.src_devices)} -> "
            f"{self.dst_spec} on {_mesh_str(self.dst_mesh_shape, self.dst_devices)}: "
            f"{len(self.tasks)} unit tasks, {self.total_bytes} bytes"
            + (f", {len(self.schedule)} network transfers ({self.method}), makespan {self.makespan:.0f} byte-time"
               if self.schedule else "")
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




# ----- scheduling network transfers on host links --------------------------------------------
@dataclass(frozen=True)
class _Job:
    """A network transfer to place: unit task ``task`` into ``receiver_host`` from one of ``candidates``."""

    task: int
    nbytes: int
    candidates: tuple[int, ...]
    receiver_host: int
    receivers: tuple[int, ...]
    sender: int | None = None  # fixed sender device (send_recv), else chosen after the host


def list_schedule(transfers: Sequence[tuple[int, int, float]]) -> list[tuple[float, float]]:
    """(start, end) of each (sender host, receiver host, duration), placed in the given order.

    Each transfer starts as soon as its sender host's send side and its receiver host's
    receive side are both free (they carry one transfer at a time). Every schedule that
    respects those constraints is no earlier than the list schedule of its transfers sorted
    by start time, so searching over orders is searching over schedules.
    """
    free_s: dict[int, float] = defaultdict(float)
    free_r: dict[int, float] = defaultdict(float)
    out = []
    for s, r, n in transfers:
        start = max(free_s[s], free_r[r])
        free_s[s] = free_r[r] = start + n
        out.append((start, start + n))
    return out


def _makespan(jobs: Sequence[_Job], order: Sequence[tuple[int, int]]) -> float:
    times = list_schedule([(h, jobs[j].receiver_host, jobs[j].nbytes) for j, h in order])
    return max((e for _, e in times), default=0.0)


def _lower_bound(jobs: Sequence[_Job]) -> float:
    """max over receiving hosts of what they receive, and over sender hosts of what only they can send."""
    into: dict[int, int] = defaultdict(int)
    only: dict[int, int] = defaultdict(int)
    for j in jobs:
        into[j.receiver_host] += j.nbytes
        if len(j.candidates) == 1:
            only[j.candidates[0]] += j.nbytes
    return float(max([*into.values(), *only.values(), 0]))


def _lpt_hosts(jobs: Sequence[_Job]) -> list[int]:
    """The paper's greedy: heaviest job first, to the least-loaded candidate sender host."""
    load: dict[int, int] = defaultdict(int)
    out = [0] * len(jobs)
    for j in sorted(range(len(jobs)), key=lambda j: (-jobs[j].nbytes, j)):
        h = min(jobs[j].candidates, key=lambda h: (load[h], h))
        load[h] += jobs[j].nbytes
        out[j] = h
    return out


def _greedy_rounds(jobs: Sequence[_Job], rng: random.Random, fixed: list[int] | None, tries: int) -> list[tuple[int, int]]:
    """The paper's randomised greedy: at each moment, start the largest set of waiting
    transfers whose sender and receiver sides are free (best of ``tries`` random orders);
    the sender host is the free candidate with the least load so far (or ``fixed``)."""
    free_s: dict[int, float] = defaultdict(float)
    free_r: dict[int, float] = defaultdict(float)
    load: dict[int, int] = defaultdict(int)
    left = set(range(len(jobs)))
    rem_in: dict[int, int] = defaultdict(int)  # work each receiving host still has to take
    rem_out: dict[int, int] = defaultdict(int)  # work only this sender host can still do
    for j in left:
        rem_in[jobs[j].receiver_host] += jobs[j].nbytes
        if fixed is not None or len(jobs[j].candidates) == 1:
            rem_out[fixed[j] if fixed is not None else jobs[j].candidates[0]] += jobs[j].nbytes

    def urgency(j: int) -> tuple:  # the most loaded hosts first (a critical-path rule), then heaviest
        h = fixed[j] if fixed is not None else min(jobs[j].candidates, key=lambda h: -rem_out[h])
        return (-(rem_in[jobs[j].receiver_host] + rem_out[h]), -jobs[j].nbytes, j)

    order: list[tuple[int, int]] = []
    t = 0.0
    while left:
        ready = [j for j in left if free_r[jobs[j].receiver_host] <= t]
        best: list[tuple[int, int]] = []
        best_key = (0, 0)
        for k in range(tries):
            if k == 0:
                perm = sorted(ready, key=urgency)
            elif k == 1:
                perm = sorted(ready, key=lambda j: (-jobs[j].nbytes, j))
            else:
                perm = rng.sample(ready, len(ready))
            used_s, used_r, pick = set(), set(), []
            for j in perm:
                r = jobs[j].receiver_host
                if r in used_r:
                    continue
                hosts = [fixed[j]] if fixed is not None else list(jobs[j].candidates)
                hosts = [h for h in hosts if h not in used_s and free_s[h] <= t]
                if not hosts:
                    continue
                h = min(hosts, key=lambda h: (load[h], rng.random() if k > 1 else h))
                used_s.add(h)
                used_r.add(r)
                pick.append((j, h))
            key = (len(pick), sum(jobs[j].nbytes for j, _ in pick))
            if key > best_key:
                best, best_key = pick, key
        for j, h in best:
            left.discard(j)
            load[h] += jobs[j].nbytes
            rem_in[jobs[j].receiver_host] -= jobs[j].nbytes
            if fixed is not None or len(jobs[j].candidates) == 1:
                rem_out[h] -= jobs[j].nbytes
            free_s[h] = free_r[jobs[j].receiver_host] = t + jobs[j].nbytes
            order.append((j, h))
        later = [x for x in [*free_s.values(), *free_r.values()] if x > t]
        if not later:
            if left and not best:  # nothing could start and nothing is running: cannot happen
                raise AssertionError("greedy scheduling made no progress")
            continue
        t = min(later)
    return order


def _branch_and_bound(
    jobs: Sequence[_Job], incumbent: float, bound: float, node_budget: int, deadline: float
) -> tuple[list[tuple[int, int]] | None, float, bool]:
    """Depth-first search over (next transfer, its sender host), identical transfers merged.

    Prunes a branch when its lower bound (current end, and per host its free time plus the
    load it must still carry) reaches the best makespan found. Returns (best order or None
    if none beat ``incumbent``, its makespan, whether the search finished, i.e. is exact).
    """
    classes: dict[tuple, list[int]] = defaultdict(list)
    for j, job in enumerate(jobs):
        classes[(job.candidates, job.receiver_host, job.nbytes)].append(j)
    keys = sorted(classes, key=lambda k: (-k[2], k))
    left = [len(classes[k]) for k in keys]
    rem_in: dict[int, int] = defaultdict(int)
    rem_only: dict[int, int] = defaultdict(int)
    for k, n in zip(keys, left):
        rem_in[k[1]] += k[2] * n
        if len(k[0]) == 1:
            rem_only[k[0][0]] += k[2] * n
    free_s: dict[int, float] = defaultdict(float)
    free_r: dict[int, float] = defaultdict(float)
    best = [incumbent, None]
    path: list[tuple[int, int]] = []
    nodes = [0]
    finished = [True]

    def lb(end: float) -> float:
        v = end
        for r, n in rem_in.items():
            v = max(v, free_r[r] + n)
        for s, n in rem_only.items():
            v = max(v, free_s[s] + n)
        return v

    def dfs(end: float) -> None:
        if best[0] <= bound:
            return
        nodes[0] += 1
        if nodes[0] > node_budget or (nodes[0] & 1023 == 0 and time.perf_counter() > deadline):
            finished[0] = False
            return
        if not any(left):
            if end < best[0]:
                best[0], best[1] = end, list(path)
            return
        moves = []
        for i, k in enumerate(keys):
            if left[i]:
                cands, r, n = k
                for h in cands:
                    moves.append((max(free_s[h], free_r[r]), i, h))
        moves.sort()
        for start, i, h in moves:
            cands, r, n = keys[i]
            stop = start + n
            if stop >= best[0]:
                continue
            old = free_s[h], free_r[r]
            free_s[h] = free_r[r] = stop
            left[i] -= 1
            rem_in[r] -= n
            if len(cands) == 1:
                rem_only[h] -= n
            if lb(max(end, stop)) < best[0]:
                path.append((classes[keys[i]][left[i]], h))
                dfs(max(end, stop))
                path.pop()
            left[i] += 1
            rem_in[r] += n
            if len(cands) == 1:
                rem_only[h] += n
            free_s[h], free_r[r] = old
            if not finished[0] or best[0] <= bound:
                return

    dfs(0.0)
    return best[1], best[0], finished[0]


def _order_jobs(
    jobs: Sequence[_Job], order: str, *, seed: int = 0, tries: int = 8, restarts: int = 8,
    dfs_limit: int = 16, node_budget: int = 200_000, time_budget: float = 1.0,
) -> tuple[list[tuple[int, int]], bool]:
    """(job, sender host) in start order, and whether it is proven optimal."""
    if not jobs:
        return [], True
    fixed = _lpt_hosts(jobs)
    naive = [(j, fixed[j]) for j in range(len(jobs))]
    if order == "naive":
        return naive, False
    deadline = time.perf_counter() + time_budget
    bound = _lower_bound(jobs)
    rng = random.Random(seed)
    best, best_t = naive, _makespan(jobs, naive)

    def consider(cand: list[tuple[int, int]]) -> None:
        nonlocal best, best_t
        t = _makespan(jobs, cand)
        if t < best_t:
            best, best_t = cand, t

    consider(_greedy_rounds(jobs, rng, fixed, tries))
    for _ in range(restarts):
        if best_t <= bound or time.perf_counter() > deadline:
            break
        consider(_greedy_rounds(jobs, rng, None, tries))
        consider(_greedy_rounds(jobs, rng, fixed, tries))
    if best_t <= bound:
        return best, True
    if len(jobs) <= dfs_limit:
        found, t, exact = _branch_and_bound(jobs, best_t, bound, node_budget, deadline)
        if found is not None:
            best, best_t = found, t
        return best, exact
    return best, False


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
    method: str = "broadcast",
    order: str = "search",
    seed: int = 0,
    time_budget: float = 1.0,
    dfs_limit: int = 16,
) -> CrossMeshResharding:
    """The unit tasks of moving a tensor between two sub-meshes, their senders and schedule.

    ``devices_per_host``: device d is on host d // devices_per_host, as in ``ClusterSpec``;
    None: every device is its own host. ``method``: ``"broadcast"`` (one sender per unit
    task and receiving host, then a chain inside the host) or ``"send_recv"`` (one sender
    per receiver device). ``order``: ``"search"`` (greedy, randomised greedy and, for at most
    ``dfs_limit`` transfers, branch and bound, within ``time_budget`` seconds) or
    ``"naive"`` (the paper's baseline: the unit tasks' order, greedy load balance).
    Meshes may share devices. Raises ``ShardingSpecError`` when a spec does not fit its mesh
    or the tensor.
    """
    t0 = time.perf_counter()
    shape = tuple(int(n) for n in shape)
    src_mesh_shape, dst_mesh_shape = tuple(src_mesh_shape), tuple(dst_mesh_shape)
    src_devices, dst_devices = tuple(int(d) for d in src_devices), tuple(int(d) for d in dst_devices)
    src = _check(shape, src_spec, src_mesh_shape, src_devices, "source")
    dst = _check(shape, dst_spec, dst_mesh_shape, dst_devices, "destination")
    if devices_per_host is not None and devices_per_host < 1:
        raise ValueError(f"devices_per_host must be positive, got {devices_per_host}")
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    if order not in ORDERS:
        raise ValueError(f"order must be one of {ORDERS}, got {order!r}")
    dtype = dtype if isinstance(dtype, str) else np.dtype(dtype).name  # by name: a typed key has no NumPy dtype
    itemsize = dtype_of(dtype).itemsize

    def host(d: int) -> int:
        return d if devices_per_host is None else d // devices_per_host

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

    load: dict[int, int] = defaultdict(int)  # bytes sent per source device
    local_groups: list[tuple[int, int, tuple[int, ...]]] = []  # (task, sender device, chain) inside one host
    jobs: list[_Job] = []
    if method == "send_recv":
        # heaviest unit task first, each receiver to the least-loaded sender (on its own host
        # when one is); ties go to the lower device id, so plans are stable
        for k in sorted(range(len(found)), key=lambda k: (-found[k][1], k)):
            _, nbytes, senders, receivers = found[k]
            for r in receivers:
                if r in senders:
                    continue
                near = [s for s in senders if devices_per_host is not None and host(s) == host(r)]
                s = min(near or senders, key=lambda d: (load[d], d))
                load[s] += nbytes
                if host(s) == host(r):
                    local_groups.append((k, s, (r,)))
                else:
                    jobs.append(_Job(k, nbytes, (host(s),), host(r), (r,), s))
        jobs.sort(key=lambda j: (j.task, found[j.task][3].index(j.receivers[0])))
    else:
        for k, (_, nbytes, senders, receivers) in enumerate(found):
            by_host: dict[int, list[int]] = defaultdict(list)
            for r in receivers:
                if r not in senders:
                    by_host[host(r)].append(r)
            sender_hosts = tuple(sorted({host(s) for s in senders}))
            for h, chain in by_host.items():
                if h in sender_hosts:  # a holder on this host: the chain starts there
                    s = min((s for s in senders if host(s) == h), key=lambda d: (load[d], d))
                    load[s] += nbytes
                    local_groups.append((k, s, tuple(chain)))
                else:
                    jobs.append(_Job(k, nbytes, sender_hosts, h, tuple(chain)))

    placed, optimal = _order_jobs(jobs, order, seed=seed, time_budget=time_budget, dfs_limit=dfs_limit)
    times = list_schedule([(h, jobs[j].receiver_host, jobs[j].nbytes) for j, h in placed])
    schedule = []
    groups: dict[int, list[tuple[int, tuple[int, ...]]]] = defaultdict(list)
    for (j, h), (start, end) in zip(placed, times):
        job = jobs[j]
        s = job.sender
        if s is None:  # the least-loaded holder on the chosen sender host
            s = min((d for d in found[job.task][2] if host(d) == h), key=lambda d: (load[d], d))
            load[s] += job.nbytes
        schedule.append(ScheduledTransfer(job.task, h, job.receiver_host, start, end, s, job.receivers))
        groups[job.task].append((s, job.receivers))
    for k, s, chain in local_groups:
        groups[k].append((s, chain))

    tasks = []
    for k, (region, nbytes, senders, receivers) in enumerate(found):
        source = {r: r for r in receivers if r in senders}
        for s, chain in groups[k]:
            for a, b in zip((s, *chain[:-1]), chain):
                source[b] = a
        mine = tuple(sorted(groups[k], key=lambda g: receivers.index(g[1][0])))
        tasks.append(UnitTask(region, nbytes, senders, receivers, tuple((source[r], r) for r in receivers), mine))
    return CrossMeshResharding(
        shape, dtype, src, src_mesh_shape, src_devices, dst, dst_mesh_shape, dst_devices, tuple(tasks),
        method=method, order=order, devices_per_host=devices_per_host, schedule=tuple(schedule), optimal=optimal,
        planning_seconds=time.perf_counter() - t0,
    )
