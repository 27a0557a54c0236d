"""A Ray cluster to run plans on: a local one we start on 127.0.0.1, or one the user already runs.

``RayCluster.local(hosts, devices_per_host)`` starts Ray on this machine, bound to 127.0.0.1
with the dashboard off; each simulated "host" is then a set of mesh-worker processes with
their own simulated CPU devices. ``RayCluster.connect(address)`` joins a running cluster and
describes it as a ``ClusterSpec`` (hosts = alive Ray nodes, devices per host = GPUs per node,
or the CPU count given). ``spec`` is what to plan for, so a plan matches the cluster it runs on.
"""

from __future__ import annotations

import numbers
import os
import statistics
import time
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Any

from alpa_lab.cost.cluster import ClusterSpec

__all__ = ["RayCluster", "RayClusterError"]


class RayClusterError(RuntimeError):
    """Ray is missing, does not answer, or cannot give what was asked (says what to do)."""


def _ray() -> Any:
    try:
        import ray
    except ImportError as e:  # pragma: no cover - ray is a dependency; a broken install still gets a clear word
        raise RayClusterError("the Ray runtime needs Ray: pip install 'ray[default]>=2.9'") from e
    return ray


_LOOPBACK_ONLY = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
"""Ray's switch for a cluster-less node: off, Ray takes 127.0.0.1 as the node's address and every process it
starts (GCS, raylet, agents, workers) listens there; Ray otherwise replaces an asked-for 127.0.0.1 with the
machine's routable address and listens on all interfaces. Read by Ray at import and per call, so it is set
in both places, for the local Ray only (a connected cluster's nodes must reach each other)."""


@contextmanager
def _loopback_only(ray: Any) -> Iterator[None]:
    """While a local Ray starts: its processes (which inherit the environment) and the driver bind to 127.0.0.1."""
    constants = ray._private.ray_constants
    before_env, before = os.environ.get(_LOOPBACK_ONLY), constants.ENABLE_RAY_CLUSTER
    os.environ[_LOOPBACK_ONLY], constants.ENABLE_RAY_CLUSTER = "0", False
    try:
        yield
    finally:
        constants.ENABLE_RAY_CLUSTER = before
        if before_env is None:
            os.environ.pop(_LOOPBACK_ONLY, None)
        else:
            os.environ[_LOOPBACK_ONLY] = before_env


TRANSFER_SIZES = (64 * 1024, 1 << 20, 4 << 20, 16 << 20)
"""bytes of the host-to-host transfers ``RayCluster.calibrate`` times"""


def _dashboard_url() -> str:
    """The connected Ray cluster's dashboard address, or "" when it runs none (or Ray does not say)."""
    try:
        from ray._private.worker import get_dashboard_url

        url = get_dashboard_url() or ""
    except Exception:  # noqa: BLE001 - an internal of Ray's that may move: no link then
        return ""
    return f"http://{url}" if url and not url.startswith("http") else url


def _check_answers(address: str, timeout: float) -> None:
    """A ``host:port`` that does not accept connections fails here in seconds (Ray itself retries for a minute)."""
    import socket

    target = address.split("://", 1)[-1]
    if address == "auto" or ":" not in target:
        return
    host, _, port = target.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout):
            pass
    except (OSError, ValueError) as e:
        raise RayClusterError(
            f"no Ray cluster answers at {address!r} ({e}); start one with `ray start --head` or check the address"
        ) from e


@dataclass
class RayCluster:
    """A Ray cluster described for planning (``spec``) and for placing mesh workers."""

    spec: ClusterSpec
    platform: str
    """"cpu" (simulated devices, one process per mesh worker) or "gpu"."""
    address: str
    started_here: bool
    node_ids: tuple[str, ...] = ()
    """Ray node id per host (a connected cluster); a local one has all hosts on this node."""
    dashboard_url: str = ""
    """Ray's dashboard (http://...), when the cluster runs one"""
    _closed: bool = field(default=False, repr=False)

    @classmethod
    def local(
        cls, hosts: int = 2, devices_per_host: int = 4, *, spec: ClusterSpec | None = None, platform: str = "cpu",
        dashboard: bool = False,
    ) -> RayCluster:
        """Start a local Ray (127.0.0.1); each host's devices are simulated CPU devices.

        ``dashboard=True`` starts Ray's dashboard too (on 127.0.0.1; a few seconds more to start),
        linked from alpa_lab's run dashboard.

        ``spec``: the cluster to plan for (default ``ClusterSpec.local(hosts, devices_per_host, platform=platform)``);
        it must have the same hosts and devices per host. ``platform="gpu"``: this machine's
        GPUs instead (hosts x devices_per_host of them), one per device, assigned by Ray.
        """
        if platform not in ("cpu", "gpu"):
            raise ValueError(f"platform must be 'cpu' (simulated devices) or 'gpu', got {platform!r}")
        for name, v in (("hosts", hosts), ("devices_per_host", devices_per_host)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        spec = spec or ClusterSpec.local(hosts, devices_per_host, runtime="ray", platform=platform)
        if (spec.hosts, spec.devices_per_host) != (hosts, devices_per_host):
            raise ValueError(f"spec is for {spec.hosts}x{spec.devices_per_host} devices but the cluster is {hosts}x{devices_per_host}")
        ray = _ray()
        if ray.is_initialized():
            raise RayClusterError(
                "Ray is already running in this process (ray.init was called): use RayCluster.connect('auto') to use "
                "it, or ray.shutdown() first to let RayCluster.local start its own"
            )
        t0 = time.perf_counter()
        with _loopback_only(ray):
            ctx = ray.init(
                address="local",
                num_cpus=max(2, hosts * devices_per_host),
                **({"num_gpus": None} if platform == "gpu" else {"num_gpus": 0}),
                include_dashboard=dashboard,
                **({"dashboard_host": "127.0.0.1"} if dashboard else {}),
                _node_ip_address="127.0.0.1",
                log_to_driver=bool(os.environ.get("ALPA_LAB_RAY_LOGS")),
                configure_logging=False,
            )
        address = ctx.address_info.get("gcs_address", "")
        if platform == "gpu":
            have = int(ray.cluster_resources().get("GPU", 0))
            if have < hosts * devices_per_host:
                ray.shutdown()
                raise RayClusterError(f"asked for {hosts}x{devices_per_host} GPUs but Ray finds {have} on this machine")
        else:
            spec = replace(spec, simulated=True)
        url = ctx.dashboard_url or ""
        cluster = cls(spec=spec, platform=platform, address=address, started_here=True,
                      dashboard_url=f"http://{url}" if url and not url.startswith("http") else url)
        cluster.start_seconds = time.perf_counter() - t0
        return cluster

    @classmethod
    def connect(
        cls,
        address: str = "auto",
        *,
        preset: str | None = None,
        devices_per_host: int | None = None,
        timeout: float = 10.0,
    ) -> RayCluster:
        """Join a running Ray cluster (``"auto"``, ``"host:port"``, ``"ray://host:port"``).

        Hosts are its alive nodes; devices per host its GPUs per node (all nodes alike), or
        ``devices_per_host`` simulated CPU devices on a cluster without GPUs. Bandwidths and
        device speed come from ``preset`` (e.g. ``"p3.16xlarge"``) or the local defaults.
        """
        ray = _ray()
        if not ray.is_initialized():
            _check_answers(address, timeout)
            try:
                ray.init(address=address, log_to_driver=bool(os.environ.get("ALPA_LAB_RAY_LOGS")), configure_logging=False)
            except Exception as e:  # noqa: BLE001 - reported with the address
                raise RayClusterError(f"could not connect to a Ray cluster at {address!r}: {e}") from e
        nodes = [n for n in ray.nodes() if n.get("Alive")]
        if not nodes:
            raise RayClusterError(f"the Ray cluster at {address!r} has no alive nodes")
        gpus = sorted({int(n["Resources"].get("GPU", 0)) for n in nodes})
        if gpus != [0]:
            if len(gpus) != 1:
                raise RayClusterError(f"the Ray cluster's nodes have different GPU counts {gpus}; alpa_lab plans for hosts alike")
            platform, per_host = "gpu", gpus[0]
        else:
            platform = "cpu"
            per_host = devices_per_host or int(min(n["Resources"].get("CPU", 1) for n in nodes))
        hosts = len(nodes)
        spec = ClusterSpec.preset(preset, hosts=hosts) if preset else ClusterSpec.local(hosts, per_host, runtime="ray", platform=platform)
        if spec.devices_per_host != per_host:
            raise RayClusterError(f"preset {preset!r} has {spec.devices_per_host} devices per host but the cluster's nodes have {per_host}")
        if platform == "cpu":
            spec = replace(spec, simulated=True)
        node_ids = tuple(n["NodeID"] for n in sorted(nodes, key=lambda n: (n.get("NodeManagerAddress", ""), n["NodeID"])))
        return cls(spec=spec, platform=platform, address=address, started_here=False, node_ids=node_ids, dashboard_url=_dashboard_url())

    @property
    def hosts(self) -> int:
        return self.spec.hosts

    @property
    def devices_per_host(self) -> int:
        return self.spec.devices_per_host

    # Alpa's DeviceCluster names (``alpa.get_global_cluster()``)
    num_hosts = hosts
    num_devices_per_host = devices_per_host

    @property
    def num_devices(self) -> int:
        return self.spec.num_devices

    def get_virtual_physical_mesh(
        self, host_ids: Sequence[int] | None = None, num_devices_per_host: int | None = None,
    ) -> VirtualPhysicalMesh:
        """Alpa's name: ``host_ids`` hosts (default: all) with ``num_devices_per_host`` devices each (default: all), as a
        method's ``devices=`` or ``set_global_virtual_physical_mesh``: steps plan for that part and run on it here."""
        return VirtualPhysicalMesh(
            self, tuple(range(self.hosts)) if host_ids is None else host_ids,
            self.devices_per_host if num_devices_per_host is None else num_devices_per_host)

    def calibrate(self, *, save: bool = True, repeats: int = 7, sizes: tuple[int, ...] = TRANSFER_SIZES) -> ClusterSpec:
        """Measure this cluster: the spec to plan with, its numbers measured on the cluster's own workers.

        A mesh worker on host 0 runs the cost model's microbenchmarks on all its devices at once
        (``cost.calibrate``; simulated CPU devices: while a worker on host 1 runs the same, as a pipeline's
        meshes load the machine's shared cores together); with two hosts or more, host 1's worker fetches arrays of
        ``sizes`` bytes that host 0's worker put in its object store (the path a cross-mesh region
        takes), fitted to a line for the host-to-host latency and bandwidth; a cross-mesh message's
        fixed cost (``transfer_overhead``) is that latency plus an actor call's round trip.
        ``save``: a cluster started here keeps it for ``ClusterSpec.local(hosts, devices_per_host)`` and the
        next ``RayCluster.local`` of this shape (as the "ray" runtime's: an in-process calibration is kept apart).
        The cluster's ``spec`` becomes the measured one, which is also returned.
        """
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        from alpa_lab.cost.calibrate import Calibration, calibration_path, fit_transfer
        from alpa_lab.runtime.mesh_worker import MeshWorker

        ray = _ray()
        if self._closed or not ray.is_initialized():
            raise RayClusterError("the Ray cluster was shut down; start one with RayCluster.local(...) or connect(...)")
        actor_cls = ray.remote(MeshWorker)
        workers = []
        for h in range(min(2, self.hosts)):
            opts: dict[str, Any] = {"num_cpus": 1}
            if self.platform == "cpu":
                flags = f"--xla_force_host_platform_device_count={self.devices_per_host}"
                opts["runtime_env"] = {"env_vars": {"XLA_FLAGS": flags, "JAX_PLATFORMS": "cpu"}}
            else:
                opts["num_gpus"] = self.devices_per_host
            if self.node_ids:
                opts["scheduling_strategy"] = NodeAffinitySchedulingStrategy(self.node_ids[h], soft=False)
            workers.append(actor_cls.options(**opts).remote(h, h, self.devices_per_host, self.platform))
        t0 = time.perf_counter()
        try:
            # simulated devices: every started worker runs the benchmarks at once, host 0's kept, as hosts sharing
            # a machine's cores are loaded when a pipeline's meshes run (two of them: a lower bound of that load)
            busy = workers if self.platform == "cpu" else workers[:1]
            measured = Calibration(**ray.get([w.calibrate.remote(repeats) for w in busy], timeout=600)[0])
            measured = replace(measured, num_devices=self.hosts * self.devices_per_host, hosts=self.hosts,
                               devices_per_host=self.devices_per_host, runtime="ray")
            if len(workers) == 2:
                best = []
                for size in sizes:
                    times = []
                    for _ in range(repeats + 1):  # the first pull of a size warms the object store up: dropped
                        refs = ray.get(workers[0].offer.remote(size))
                        times.append(ray.get(workers[1].pull.remote(refs)))
                    # the fastest: on a shared host other work only ever adds time (a spike of 10x is common)
                    best.append(min(times[1:]))
                latency, bandwidth = fit_transfer(list(sizes), best)
                pings = []
                for _ in range(repeats):
                    t = time.perf_counter()
                    ray.get(workers[1].clock.remote())
                    pings.append(time.perf_counter() - t)
                measured = replace(measured, inter_host_bandwidth=bandwidth, inter_host_latency=latency,
                                   transfer_overhead=latency + statistics.median(pings))
            measured = replace(measured, seconds=time.perf_counter() - t0 + measured.seconds)
        finally:
            for w in workers:
                ray.kill(w, no_restart=True)
        if save and self.started_here:
            measured.save(calibration_path(measured.platform, self.hosts, self.devices_per_host, "ray"))
        self.spec = measured.apply(self.spec)  # what ``parallelize(..., cluster=cluster.spec)`` plans with from now on
        return self.spec

    def shutdown(self) -> None:
        """Stop Ray if this object started it; a connected cluster is only disconnected from."""
        if self._closed:
            return
        self._closed = True
        ray = _ray()
        if ray.is_initialized():
            ray.shutdown()

    def __enter__(self) -> RayCluster:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()

    def __repr__(self) -> str:
        kind = "local" if self.started_here else f"connected to {self.address}"
        return f"RayCluster({self.hosts}x{self.devices_per_host} {self.platform}, {kind})"


@dataclass(frozen=True)
class VirtualPhysicalMesh:
    """Alpa's mesh of a Ray cluster's devices (``get_global_cluster().get_virtual_physical_mesh(host_ids,
    num_devices_per_host)``): ``num_hosts`` of its hosts with ``num_devices_per_host`` devices each.

    As a method's ``devices=`` (or ``set_global_virtual_physical_mesh``) the step plans for that part of the
    cluster (``spec``: the cluster's hardware, ``ClusterSpec.part``) and runs on the cluster's mesh workers, on
    that many devices. Which nodes they take is the placement group's choice (Ray packs them): ``host_ids``
    are kept as given, and their number is what counts.
    """

    cluster: RayCluster = field(repr=False, compare=False)
    """the Ray cluster whose devices these are"""
    host_ids: tuple[int, ...]
    num_devices_per_host: int

    def __post_init__(self) -> None:
        hosts, per_host = self.cluster.hosts, self.cluster.devices_per_host

        def whole(x: Any) -> bool:  # an int, numpy's too (Alpa's default host_ids are np.arange), not a bool
            return isinstance(x, numbers.Integral) and not isinstance(x, bool)

        ids = tuple(self.host_ids) if isinstance(self.host_ids, Iterable) and not isinstance(self.host_ids, str) else ()
        if not ids or len(set(ids)) != len(ids) or any(not whole(h) or not 0 <= h < hosts for h in ids):
            raise ValueError(f"host_ids must be distinct hosts of the cluster's {hosts} (0..{hosts - 1}), got {self.host_ids!r}")
        n = self.num_devices_per_host
        if not whole(n) or not 1 <= n <= per_host:
            raise ValueError(f"num_devices_per_host must be 1..{per_host} (the cluster's hosts have {per_host}), got {n!r}")
        object.__setattr__(self, "host_ids", tuple(int(h) for h in ids))
        object.__setattr__(self, "num_devices_per_host", int(n))

    @property
    def num_hosts(self) -> int:
        return len(self.host_ids)

    @property
    def num_devices(self) -> int:
        return self.num_hosts * self.num_devices_per_host

    @property
    def shape(self) -> tuple[int, int]:
        return (self.num_hosts, self.num_devices_per_host)

    @property
    def spec(self) -> ClusterSpec:
        """The cluster to plan for: the Ray cluster's hardware, this many hosts and devices of it."""
        return self.cluster.spec.part(self.num_hosts, self.num_devices_per_host)
