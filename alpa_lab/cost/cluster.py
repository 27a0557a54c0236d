"""Clusters and logical meshes, with the alpha-beta cost of each collective.

A ``ClusterSpec`` describes hardware (hosts x devices per host, link speeds, FLOP/s,
memory). A ``LogicalMesh`` views some of its devices as a 2-D grid (sec. 4.1 of the Alpa
paper) and prices collectives along each grid axis: an axis whose devices sit on one host
uses the intra-host link, an axis that crosses hosts uses the slower inter-host link.

The formulas are the usual ring costs (cf. the Alpa paper's cost model, sec. 4.2, and
Thakur et al. 2005), with ``M`` the bytes per device and ``n`` the devices in the group:

    all-gather(M)     = alpha + beta * (n-1)/n * M      (M: bytes of the gathered result)
    reduce-scatter(M) = alpha + beta * (n-1)/n * M      (M: bytes of the full input)
    all-reduce(M)     = alpha + beta * 2(n-1)/n * M
    all-to-all(M)     = alpha + beta * (n-1)/n * M      (M: bytes of the local tile)

where ``beta = 1 / bandwidth``. A collective over both axes (``01``) uses every device of
the mesh, the sum of the two latencies and the slower of the two links.
"""

from __future__ import annotations

import math
import re
import warnings
from dataclasses import dataclass, field, replace

import numpy as np

GB = 1e9
COLLECTIVE_KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all")


class ClusterError(ValueError):
    """A cluster or mesh description that cannot be used."""


@dataclass(frozen=True)
class ClusterSpec:
    """Hardware the planner plans for. Bandwidths in bytes/s, latencies in s."""

    hosts: int
    devices_per_host: int
    intra_host_bandwidth: float
    inter_host_bandwidth: float
    intra_host_latency: float = 5e-6
    inter_host_latency: float = 2e-5
    device_flops: float = 1e12
    device_memory: float = 16 * GB
    memory_bandwidth: float = 100 * GB
    host_to_device_bandwidth: float = 12 * GB
    name: str = "custom"
    simulated: bool = False
    op_overhead: float = 0.0
    """seconds one operator costs beyond its FLOPs and bytes (0 for the presets; measured by ``calibrate``)"""
    task_overhead: float = 0.0
    """seconds to launch one compiled program (a stage's unit task) and see it finish, beyond its ops"""
    transfer_overhead: float = 0.0
    """seconds one cross-mesh transfer costs beyond its bytes (a message between mesh workers; measured by a run)"""
    sum_overhead: float = 0.0
    """seconds each tensor summed over the micro-batches costs beyond an op's (its own kernel and result in the
    sums program, ``runtime.accumulate``; 0 for the presets, measured by ``calibrate``)"""
    host_link_bandwidth: float | None = None
    """bytes/s of one host's network link: what a transfer between two hosts' meshes can use (the cross-mesh
    model's host link, MLSys'23; ``host_link``). None: ``inter_host_bandwidth``, right where each device has its
    own NIC and for a calibration, which measures one transfer. Where a host's devices share one NIC (the p3
    presets), ``inter_host_bandwidth`` is a device's share, right for a collective in which every device of a host
    sends at once, and ``devices_per_host`` times too slow for one transfer between stages."""

    def __post_init__(self) -> None:
        if self.hosts < 1 or self.devices_per_host < 1:
            raise ClusterError(
                f"a cluster needs at least one host and one device per host, got "
                f"hosts={self.hosts}, devices_per_host={self.devices_per_host}"
            )
        for f in (
            "intra_host_bandwidth",
            "inter_host_bandwidth",
            "device_flops",
            "device_memory",
            "memory_bandwidth",
            "host_to_device_bandwidth",
        ):
            if getattr(self, f) <= 0:
                raise ClusterError(f"ClusterSpec.{f} must be positive, got {getattr(self, f)}")
        if self.host_link_bandwidth is not None and not self.host_link_bandwidth > 0:
            raise ClusterError(f"ClusterSpec.host_link_bandwidth must be positive (or None), got {self.host_link_bandwidth}")

    @property
    def host_link(self) -> float:
        """Bytes/s a transfer between meshes on two hosts gets (``host_link_bandwidth``)."""
        return self.host_link_bandwidth or self.inter_host_bandwidth

    @property
    def num_devices(self) -> int:
        return self.hosts * self.devices_per_host

    def part(self, hosts: int | None = None, devices_per_host: int | None = None) -> ClusterSpec:
        """The same hardware, ``hosts`` of its hosts with ``devices_per_host`` devices each (default: all): a plan
        for part of a cluster, which a Ray cluster of this spec runs on that many of its devices."""
        hosts = self.hosts if hosts is None else hosts
        per_host = self.devices_per_host if devices_per_host is None else devices_per_host
        for what, n, most in (("hosts", hosts, self.hosts), ("devices_per_host", per_host, self.devices_per_host)):
            if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= most:
                raise ClusterError(f"part of a {self.hosts}x{self.devices_per_host} cluster: {what} must be 1..{most}, got {n!r}")
        if (hosts, per_host) == (self.hosts, self.devices_per_host):
            return self
        return replace(self, hosts=hosts, devices_per_host=per_host, name=f"{self.name}, {hosts}x{per_host} of it")

    # ----- constructors ----------------------------------------------------------------
    @classmethod
    def local(
        cls, hosts: int = 1, devices_per_host: int = 4, *, calibrated: bool | None = None, runtime: str = "process",
        platform: str = "cpu",
    ) -> ClusterSpec:
        """Simulated CPU devices in this process (``--xla_force_host_platform_device_count``), or with
        ``platform="gpu"`` this machine's GPUs (``gpu:HxD``: what ``parallelize`` plans for by default where
        JAX's devices are GPUs).

        Without a calibration, costs model a small GPU box, a V100's (so plans look like plans for
        real hardware; simulated CPU devices run the program for checking numerics and
        collectives; for GPUs a warning says that nothing was measured). With one (``ClusterSpec.calibrate(hosts,
        devices_per_host)`` or a local ``RayCluster(hosts, devices_per_host).calibrate()`` saved it
        for this platform and shape), the measured numbers are used, so predicted seconds are
        local seconds. ``platform``: JAX's name ("cpu", "gpu"; "cuda" and "rocm" mean "gpu").
        ``calibrated``: None uses a saved calibration when there is one; True requires it;
        False ignores it. ``runtime``: whose calibration comes first, "process" (measured in
        this process) or "ray" (measured on Ray mesh workers, the host-to-host link included);
        the other one is used when only it was saved for this shape.
        """
        if not isinstance(platform, str) or not platform.isalnum():
            raise ClusterError(f"platform must be a JAX platform name such as 'cpu' or 'gpu', got {platform!r}")
        platform = {"cuda": "gpu", "rocm": "gpu"}.get(platform.lower(), platform.lower())  # as Device.platform names it
        simulated = platform == "cpu"
        # one figure for the network (no host link): a calibration measures one transfer between hosts as
        # inter_host_bandwidth, and an uncalibrated local cluster plans as a calibrated one would be read
        base = replace(
            PRESETS["p3.8xlarge"], hosts=hosts, devices_per_host=devices_per_host, simulated=simulated,
            name=f"{'local' if simulated else platform}:{hosts}x{devices_per_host}", host_link_bandwidth=None,
        )
        if calibrated is False:
            return base
        from alpa_lab.cost.calibrate import calibration_path, find_calibration, load_calibration

        path = find_calibration(platform, hosts, devices_per_host, prefer=runtime)
        measured = load_calibration(path) if path is not None else None
        if measured is not None and not simulated and measured.device_memory is None:
            # saved before accelerators were measured at their own sizes (and their memory read): not used
            warnings.warn(f"ignoring {path}: an older calibration of {platform} devices; run ClusterSpec.calibrate() again",
                          stacklevel=2)
            measured = None
        if measured is None:
            if calibrated:
                raise ClusterError(
                    f"no calibration for {hosts * devices_per_host} {platform.upper()} devices ({hosts} hosts x {devices_per_host}) at "
                    f"{calibration_path(platform, hosts, devices_per_host, runtime)}; run "
                    f"ClusterSpec.calibrate(hosts={hosts}, devices_per_host={devices_per_host}) first "
                    f"(or RayCluster.local({hosts}, {devices_per_host}).calibrate() for the Ray runtime)"
                )
            if not simulated:  # not read from the devices here: that would start JAX's GPU backend in this
                # process (a Ray driver's), which takes most of each GPU's memory from the mesh workers
                warnings.warn(
                    f"no calibration of {hosts}x{devices_per_host} {platform} devices: planning with a V100's "
                    f"speeds; run al.ClusterSpec.calibrate({hosts}, {devices_per_host}) once on that machine to plan "
                    "with measured ones", stacklevel=2)
            return base
        return measured.apply(base)

    @classmethod
    def default(cls) -> ClusterSpec:
        """The devices JAX has in this process, as one host: simulated CPU devices, or a GPU box's GPUs
        (with their saved calibration, if any; without one, with the memory their backend offers):
        what ``parallelize`` and ``%%parallelize`` plan for by default."""
        import jax

        from alpa_lab.cost.calibrate import _device_memory

        devices = jax.devices()
        platform = devices[0].platform
        spec = cls.local(1, len(devices), platform=platform)
        if platform != "cpu" and spec == cls.local(1, len(devices), calibrated=False, platform=platform):
            spec = replace(spec, device_memory=_device_memory(devices) or spec.device_memory)  # no calibration
        return spec

    @classmethod
    def calibrate(cls, hosts: int = 1, devices_per_host: int | None = None, *, save: bool = True, repeats: int = 7) -> ClusterSpec:
        """Measure this process's devices (compute rate, memory bandwidth, per-op cost, all-reduce alpha and
        beta, host-to-device copies, and the memory a device offers where the backend says) and return a
        cluster that plans with the measurements; saved for ``local()`` to reuse. On a GPU box the
        devices are JAX's GPUs: the cluster is ``local(..., platform="gpu")`` (named ``gpu:HxD (calibrated)``), which
        ``parallelize`` then plans with by default.

        Accelerators: one host's devices (the first ``devices_per_host``) are measured, all at once, as a
        stage's sub-mesh (within a host in most plans) runs. Simulated CPU devices: every host's, all at
        once, collectives within each host: they all share this machine's cores, and a pipeline's meshes
        run at the same time, each slowing the others (calibrated on one host's devices alone, the tiny
        models' stages ran 1.1-1.8x slower than predicted; ``benchmarks/calibration.py``). The calibration is saved
        for ``hosts`` x ``devices_per_host`` in this process (what ``local(hosts, devices_per_host)``
        looks up first; a Ray cluster's calibration of the same shape is kept apart).
        """
        import jax

        from alpa_lab.cost.calibrate import calibrate, calibration_path

        have = jax.devices()
        devices_per_host = devices_per_host or len(have) // hosts
        n = hosts * devices_per_host
        if n < 1 or n > len(have):
            raise ClusterError(f"cannot calibrate {hosts}x{devices_per_host} devices: JAX sees {len(have)} here")
        if have[0].platform == "cpu":  # simulated: every host's devices share this machine's cores, as the meshes run
            measured = calibrate(have[:n], repeats=repeats, hosts=hosts)
        else:
            measured = calibrate(have[:devices_per_host], repeats=repeats)
        result = replace(measured, hosts=hosts, devices_per_host=devices_per_host, runtime="process")
        if save:
            result.save(calibration_path(result.platform, hosts, devices_per_host, "process"))
        return result.apply(cls.local(hosts, devices_per_host, calibrated=False, platform=result.platform))

    @classmethod
    def parse(cls, text: str) -> ClusterSpec:
        """The cluster a short text names, as the command line and ``%%parallelize --cluster`` write it:
        ``local:HxD`` (simulated devices here, with their calibration if saved), ``gpu:HxD`` (this machine's
        GPUs) or ``PRESET[:HOSTS]`` (``p3.16xlarge:2``: two of that machine type). ``local`` alone is 1x4."""
        if not isinstance(text, str):
            raise ClusterError(f"a cluster text must be a string such as 'local:2x4', got {type(text).__name__} {text!r}")
        kind, _, size = text.strip().partition(":")
        kind = kind.lower()
        try:
            if kind in ("local", "gpu"):
                hosts, devices = (int(x) for x in (size or "1x4").lower().split("x"))
                return cls.local(hosts, devices, platform="cpu" if kind == "local" else "gpu")
            if kind in PRESETS:
                return cls.preset(kind, hosts=int(size or 1))
        except ValueError as exc:  # ClusterError too: a count the constructors refuse
            raise ClusterError(
                f"cannot read the cluster {text!r} ({exc}): write local:HOSTSxDEVICES (e.g. local:2x4), gpu:HOSTSxDEVICES "
                f"(e.g. gpu:1x8) or PRESET:HOSTS (e.g. p3.16xlarge:2)") from None
        ray = (" (a Ray cluster is an object, not a text: al.RayCluster.local(2, 4), al.RayCluster.connect('auto'), "
               "or al.init('ray'))") if kind == "ray" else ""
        raise ClusterError(
            f"unknown cluster {text!r}: write local:HOSTSxDEVICES (e.g. local:2x4), gpu:HOSTSxDEVICES (e.g. gpu:1x8) or "
            f"PRESET:HOSTS with a preset from {', '.join(sorted(PRESETS))} (e.g. p3.16xlarge:2){ray}")

    @classmethod
    def preset(cls, name: str, hosts: int = 1) -> ClusterSpec:
        """A real machine type, ``hosts`` of them (e.g. ``preset("p3.16xlarge", hosts=8)``)."""
        if name not in PRESETS:
            raise ClusterError(f"unknown cluster preset {name!r}; known presets: {', '.join(sorted(PRESETS))}")
        return replace(PRESETS[name], hosts=hosts, name=f"{name}:{hosts}")

    def to_dict(self) -> dict:
        """The fields, as plans record their cluster; an unset host link is left out (such a cluster records as it did
        before the field existed; a p3 preset's plan saved before then reads back without its link)."""
        return {k: getattr(self, k) for k in self.__dataclass_fields__
                if not (k == "host_link_bandwidth" and self.host_link_bandwidth is None)}

    # ----- logical meshes --------------------------------------------------------------
    def logical_mesh_shapes(self) -> list[tuple[int, int]]:
        """Every 2-D view (n0, n1) of all devices; (1, n) and (n, 1) are the 1-D meshes."""
        n = self.num_devices
        return [(a, n // a) for a in range(1, n + 1) if n % a == 0]

    def logical_mesh(self, shape: tuple[int, int] | None = None, devices: tuple[int, ...] | None = None) -> LogicalMesh:
        """View ``devices`` (default: all, host-major order) as a grid of ``shape``.

        Device ids are host * devices_per_host + local index. Mesh axis 1 runs over
        consecutive devices, so it stays inside a host when it is no longer than a host.
        """
        devices = tuple(range(self.num_devices)) if devices is None else tuple(devices)
        shape = (1, len(devices)) if shape is None else tuple(shape)
        if len(shape) != 2 or math.prod(shape) != len(devices) or min(shape) < 1:
            fewer = ""
            if len(shape) == 2 and min(shape) >= 1 and math.prod(shape) < len(devices) and devices == tuple(range(self.num_devices)):
                fewer = (f", or plan for {math.prod(shape)} of them: cluster='local:1x{math.prod(shape)}' "
                         f"(ClusterSpec.local(1, {math.prod(shape)}))" if self.simulated else
                         ", or plan for part of the cluster: cluster=<this cluster>.part(hosts, devices_per_host)")
            raise ClusterError(
                f"logical mesh shape {shape} does not hold {len(devices)} devices; "
                f"use a 2-D shape whose product is {len(devices)}, e.g. {(1, len(devices))}{fewer}"
            )
        if len(set(devices)) != len(devices) or not all(0 <= d < self.num_devices for d in devices):
            raise ClusterError(
                f"logical mesh devices {devices} must be distinct device ids in 0..{self.num_devices - 1}"
            )
        grid = np.array(devices).reshape(shape)
        hosts_of = grid // self.devices_per_host
        alphas, betas = [], []
        for axis in range(2):
            crosses = bool((np.diff(hosts_of, axis=axis) != 0).any()) if shape[axis] > 1 else False
            bw = self.inter_host_bandwidth if crosses else self.intra_host_bandwidth
            lat = self.inter_host_latency if crosses else self.intra_host_latency
            alphas.append(lat)
            betas.append(1.0 / bw)
        return LogicalMesh(
            shape=shape,
            device_ids=tuple(int(d) for d in grid.reshape(-1)),
            alpha=tuple(alphas),
            beta=tuple(betas),
            device_flops=self.device_flops,
            memory_bandwidth=self.memory_bandwidth,
            device_memory=self.device_memory,
            host_to_device_bandwidth=self.host_to_device_bandwidth,
            op_overhead=self.op_overhead,
        )


@dataclass(frozen=True)
class Collective:
    """One collective a strategy or a resharding issues: kind, mesh axes, bytes, seconds."""

    kind: str
    axes: tuple[int, ...]
    nbytes: float
    cost: float

    def __str__(self) -> str:
        axes = "".join(map(str, self.axes))
        return f"{self.kind}({_fmt_bytes(self.nbytes)}, {axes})"


_BYTE_UNITS = {"": 1, "b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(value: float | str, what: str = "memory_budget") -> float:
    """Bytes from a number, or from a text with a unit as people write sizes: ``"16GB"`` (10**9 bytes a GB),
    ``"512 MiB"`` (2**20 a MiB); a value that is neither, or not positive, is refused naming ``what``."""
    if isinstance(value, str):
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*", value)
        if m is None or m.group(2).lower() not in _BYTE_UNITS:
            raise ValueError(f"{what} is bytes per device: a number (16e9) or a size such as '16GB' or '512MiB'; got {value!r}")
        n = float(m.group(1)) * _BYTE_UNITS[m.group(2).lower()]
    elif isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool):
        n = float(value)
    else:
        raise ValueError(f"{what} is bytes per device: a number (16e9) or a size such as '16GB'; got {type(value).__name__} {value!r}")
    if not math.isfinite(n) or n <= 0:
        raise ValueError(f"{what} must be a positive number of bytes per device, got {value!r}")
    return n


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1000 or unit == "GB":
            return f"{n:.0f}{unit}" if unit == "B" else f"{n:.1f}{unit}"
        n /= 1000
    return f"{n}"


@dataclass(frozen=True)
class LogicalMesh:
    """A 2-D grid of devices with a latency (alpha) and inverse bandwidth (beta) per axis."""

    shape: tuple[int, int]
    device_ids: tuple[int, ...]
    alpha: tuple[float, float]
    beta: tuple[float, float]
    device_flops: float = 1e12
    memory_bandwidth: float = 100 * GB
    device_memory: float = 16 * GB
    host_to_device_bandwidth: float = 12 * GB
    axis_names: tuple[str, str] = field(default=("x", "y"))
    op_overhead: float = 0.0
    forbidden: tuple[str, ...] = ()
    """collective kinds the planner may not issue on this mesh (Alpa's ``AutoShardingOption(allow_all_gather=False,
    allow_all_to_all=False)``): they cost infinitely much, so the ILP chooses strategies and reshardings without
    them, or says that none exist"""

    def __post_init__(self) -> None:
        unknown = sorted(set(self.forbidden) - set(COLLECTIVE_KINDS))
        if unknown:
            raise ValueError(f"cannot forbid {unknown}: the collective kinds are {', '.join(COLLECTIVE_KINDS)}")

    @property
    def num_devices(self) -> int:
        return math.prod(self.shape)

    def group(self, axes: tuple[int, ...]) -> tuple[int, float, float]:
        """(devices, alpha, beta) of a collective over the given mesh axes."""
        axes = tuple(axes)
        if not axes:
            return 1, 0.0, 0.0
        n = math.prod(self.shape[a] for a in axes)
        alpha = sum(self.alpha[a] for a in axes if self.shape[a] > 1)
        beta = max((self.beta[a] for a in axes if self.shape[a] > 1), default=0.0)
        return n, alpha, beta

    def collective_cost(self, kind: str, nbytes: float, axes: tuple[int, ...]) -> float:
        """Seconds for one collective of ``kind`` moving ``nbytes`` (see module doc)."""
        n, alpha, beta = self.group(axes)
        if n == 1:
            return 0.0
        if kind in self.forbidden:
            return math.inf
        if kind == "all-reduce":
            return alpha + beta * 2 * (n - 1) / n * nbytes
        if kind in ("all-gather", "reduce-scatter", "all-to-all"):
            return alpha + beta * (n - 1) / n * nbytes
        raise ValueError(f"unknown collective {kind!r}; expected one of {COLLECTIVE_KINDS}")

    def collective(self, kind: str, nbytes: float, axes: tuple[int, ...]) -> Collective:
        """The collective as data, with its cost on this mesh."""
        axes = tuple(a for a in axes if self.shape[a] > 1)
        return Collective(kind, axes, float(nbytes), self.collective_cost(kind, nbytes, axes))

    def compute_cost(self, flops: float, nbytes: float, parallelism: int) -> float:
        """Roofline time of work split ``parallelism`` ways, max(FLOP time, memory time), plus the per-op overhead."""
        work = max(flops / self.device_flops, nbytes / self.memory_bandwidth) / max(parallelism, 1)
        return work + (self.op_overhead if flops or nbytes else 0.0)

    def to_dict(self) -> dict:
        return {
            "shape": list(self.shape),
            "device_ids": list(self.device_ids),
            "alpha": list(self.alpha),
            "beta": list(self.beta),
            **({"forbidden": list(self.forbidden)} if self.forbidden else {}),
        }


def _preset(
    name: str, devices: int, intra_gbps: float, inter_gbps: float, tflops: float, mem_gb: float, hbm_gbps: float,
    host_gbps: float | None = None,
) -> ClusterSpec:
    return ClusterSpec(
        hosts=1,
        devices_per_host=devices,
        intra_host_bandwidth=intra_gbps * GB,
        inter_host_bandwidth=inter_gbps * GB,
        intra_host_latency=5e-6,
        inter_host_latency=2e-5,
        device_flops=tflops * 1e12,
        device_memory=mem_gb * GB,
        memory_bandwidth=hbm_gbps * GB,
        name=name,
        host_link_bandwidth=None if host_gbps is None else host_gbps * GB,
    )


# Bandwidths are per-device bus bandwidths in GB/s (NVLink within a host, network between
# hosts shared by the host's devices), and the host's network link where its devices share one NIC;
# FLOP/s are half-precision tensor-core peaks.
PRESETS: dict[str, ClusterSpec] = {
    # 8 x V100 16 GB, NVLink (~130 GB/s bus), 25 Gbit/s network (the Alpa paper's testbed).
    "p3.16xlarge": _preset("p3.16xlarge", 8, 130.0, 25 / 8 / 8, 125.0, 16.0, 900.0, host_gbps=25 / 8),
    # 4 x V100 16 GB, NVLink, 10 Gbit/s network.
    "p3.8xlarge": _preset("p3.8xlarge", 4, 130.0, 10 / 8 / 4, 125.0, 16.0, 900.0, host_gbps=10 / 8),
    # 8 x A100 80 GB, NVLink3 (~300 GB/s bus), 8 x 200 Gbit/s InfiniBand.
    "dgx-a100": _preset("dgx-a100", 8, 300.0, 25.0, 312.0, 80.0, 2039.0),
    # 8 x H100 80 GB, NVLink4 (~450 GB/s bus), 8 x 400 Gbit/s InfiniBand.
    "dgx-h100": _preset("dgx-h100", 8, 450.0, 50.0, 989.0, 80.0, 3350.0),
}
