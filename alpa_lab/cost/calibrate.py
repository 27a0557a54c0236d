"""Measure the devices this process can reach, so the cost model predicts what they really do.

The presets describe real machines (V100 boxes and the like); simulated CPU devices are
orders of magnitude slower and share the host's cores, so a plan's predicted seconds say
nothing about a local run. ``calibrate`` runs small microbenchmarks on the devices, *all of
them at once* (so devices that share cores are measured sharing them), and returns the
``ClusterSpec`` fields it measured:

- ``device_flops``: a batched matmul, one block per device;
- ``memory_bandwidth``: elementwise passes over an array per device;
- ``device_memory``: what the backend lets a program allocate on a device, where it says
  (``Device.memory_stats``; GPUs do, CPU devices do not and keep the spec's figure);
- ``op_overhead``: what one traced operator costs beyond its FLOPs and bytes (dispatch,
  loop set-up, a fusion's launch): the slope of a reference program's time (a small MLP's
  training step at two depths) over its op count, the ops counted as the planner counts
  them (``graph.trace``);
- ``task_overhead``: launching a tiny program on the devices and waiting for it, the fixed
  cost of each unit task a stage runs;
- ``sum_overhead``: what each tensor summed over the micro-batches costs beyond an op's overhead
  and its bytes: the slope of a program adding k pairs of tensors (the runtime's sums program)
  over k;
- ``intra_host_bandwidth`` and ``intra_host_latency``: an all-reduce over the devices at
  two sizes, solved for the ring formula's alpha and beta (``cost.cluster``).

- ``host_to_device_bandwidth``: a batch-sized host array put on the devices, each device
  receiving its tile (what the planner charges a batch argument every step).
- ``transfer_overhead``: a small tensor put from one half of the devices onto the other and
  waited for, after the devices idled a moment, less its bytes: the fixed cost of each tensor a
  stage gets from another mesh in this process, whose devices have waited for it
  (``RayCluster.calibrate`` measures it between mesh workers instead).

The sizes depend on the platform (``_SIZES``): simulated CPU devices are measured at the sizes
a small model's tensors have (in cache, sharing the host's cores), an accelerator at sizes
that saturate it (a GPU's launch costs nothing next to an 8192-wide matmul), since what
is left of a small op's time there is its launch, which ``op_overhead`` measures.

On one process all devices share one host, so the inter-host link is measured as the same
as the intra-host one; ``fit_transfer`` fits a Ray cluster's host-to-host transfer
(``RayCluster.calibrate`` runs both on its mesh workers).

A calibration is kept per platform, cluster shape (hosts x devices per host) and runtime
(``calibration_path``): ``"process"`` for ``ClusterSpec.calibrate`` (every device in this
process, the inter-host link taken as the intra-host one) and ``"ray"`` for
``RayCluster.calibrate`` (mesh workers, the host-to-host link measured), so the two never
overwrite each other. Files of the older naming (``calibration-cpu-8.json``, keyed by the
device count alone, which could not tell 2x4 from 1x8 or Ray from one process) are ignored.
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable

import numpy as np

from alpa_lab.cost.cluster import ClusterError, ClusterSpec

__all__ = ["RUNTIMES", "Calibration", "calibrate", "calibration_path", "find_calibration", "fit_transfer", "load_calibration"]

FORMAT = "alpa_lab.calibration/1"
RUNTIMES = ("process", "ray")
"""where a calibration was measured: all devices in one process (``ClusterSpec.calibrate``) or on Ray mesh workers"""


@dataclass(frozen=True)
class Calibration:
    """What was measured, on which devices, and the seconds it took."""

    platform: str
    num_devices: int
    """the devices measured at once (simulated CPU devices: every host's; accelerators: one host's)"""
    device_flops: float
    memory_bandwidth: float
    op_overhead: float
    task_overhead: float
    intra_host_bandwidth: float
    intra_host_latency: float
    seconds: float = 0.0
    inter_host_bandwidth: float | None = None
    """host-to-host transfer (a Ray cluster's, ``RayCluster.calibrate``); None: measured in one process, as intra-host"""
    inter_host_latency: float | None = None
    transfer_overhead: float | None = None
    """the fixed cost of one cross-mesh message (the transfer's alpha): between mesh workers (``RayCluster.calibrate``)
    or between two halves of this process's devices (``calibrate``, as the in-process runtime sends); None: an older file"""
    host_to_device_bandwidth: float | None = None
    """bytes/s of a host array put on the devices, per device's tile (None: not measured, the spec's own kept)"""
    sum_overhead: float | None = None
    """seconds per tensor summed over the micro-batches beyond an op's (None: not measured, an older file; the
    spec's own kept)"""
    device_memory: float | None = None
    """bytes a program may allocate on one device, as the backend reports it (None: not reported, the spec's own
    kept): JAX's allocator cap at calibration time (``XLA_PYTHON_CLIENT_MEM_FRACTION``, by default 75% of a GPU)"""
    hosts: int | None = None
    """the cluster shape and runtime it was saved for (None: not recorded, an older file)"""
    devices_per_host: int | None = None
    runtime: str | None = None

    def apply(self, spec: ClusterSpec) -> ClusterSpec:
        """``spec`` with the measured numbers in place of its own (hosts stay; memory where the backend reports none).
        The network is one measured figure, one transfer between hosts: a preset's host link is dropped with it."""
        return replace(
            spec,
            device_flops=self.device_flops,
            memory_bandwidth=self.memory_bandwidth,
            op_overhead=self.op_overhead,
            task_overhead=self.task_overhead,
            intra_host_bandwidth=self.intra_host_bandwidth,
            intra_host_latency=self.intra_host_latency,
            inter_host_bandwidth=self.inter_host_bandwidth or self.intra_host_bandwidth,
            inter_host_latency=self.intra_host_latency if self.inter_host_latency is None else self.inter_host_latency,
            transfer_overhead=spec.transfer_overhead if self.transfer_overhead is None else self.transfer_overhead,
            host_to_device_bandwidth=spec.host_to_device_bandwidth if not self.host_to_device_bandwidth else self.host_to_device_bandwidth,
            sum_overhead=spec.sum_overhead if self.sum_overhead is None else self.sum_overhead,
            device_memory=self.device_memory or spec.device_memory,
            host_link_bandwidth=None,
            name=f"{spec.name} (calibrated)" if "calibrated" not in spec.name else spec.name,
        )

    def save(self, path: str | os.PathLike) -> None:
        """Write the calibration atomically (a temporary file in the same folder, then a rename)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        try:
            with os.fdopen(fd, "w") as f:
                f.write(json.dumps({"format": FORMAT, **self.__dict__}, indent=1))
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise


def calibration_path(platform: str, hosts: int, devices_per_host: int, runtime: str = "process") -> Path:
    """Where the calibration of this platform, cluster shape and runtime is kept (``$ALPA_LAB_CACHE`` or ~/.cache/alpa_lab).

    ``runtime``: "process" (``ClusterSpec.calibrate``, every device in this process) or "ray"
    (``RayCluster.calibrate``, measured on mesh workers, the host-to-host link included).
    """
    if runtime not in RUNTIMES:
        raise ClusterError(f"runtime must be one of {RUNTIMES}, got {runtime!r}")
    for name, v in (("hosts", hosts), ("devices_per_host", devices_per_host)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ClusterError(f"{name} must be a positive integer, got {v!r}")
    root = Path(os.environ.get("ALPA_LAB_CACHE") or Path.home() / ".cache" / "alpa_lab")
    return root / f"calibration-{platform}-{hosts}x{devices_per_host}-{runtime}.json"


def find_calibration(platform: str, hosts: int, devices_per_host: int, prefer: str = "process") -> Path | None:
    """The saved calibration for this shape: the ``prefer`` runtime's, else the other runtime's, else None."""
    order = (prefer, *(r for r in RUNTIMES if r != prefer))
    for runtime in order:
        path = calibration_path(platform, hosts, devices_per_host, runtime)
        if path.is_file():
            return path
    return None


def load_calibration(path: str | os.PathLike) -> Calibration:
    """A saved calibration; a file that is not one says so."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise ClusterError(f"cannot read the calibration file {str(path)!r}: {e}") from e
    if not isinstance(data, dict) or data.pop("format", None) != FORMAT:
        raise ClusterError(f"{str(path)!r} is not an alpa_lab calibration file ({FORMAT}); run ClusterSpec.calibrate() again")
    try:
        return Calibration(**data)
    except TypeError as e:
        raise ClusterError(f"the calibration file {str(path)!r} has other fields than expected ({e}); calibrate again") from e


def _median_seconds(fn: Callable[[], Any], repeats: int, warm_up: float = 0.0, pause: float = 0.0) -> float:
    """Median seconds of ``fn`` over ``repeats`` runs, after one run (compiling it) and ``warm_up`` seconds more;
    ``pause`` seconds idle (not timed) before each run."""
    import jax

    jax.block_until_ready(fn())  # compile and warm up
    until = time.perf_counter() + warm_up
    while time.perf_counter() < until:
        jax.block_until_ready(fn())
    times = []
    for _ in range(repeats):
        if pause:
            time.sleep(pause)
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _fastest_seconds(fn: Callable[[], Any], repeats: int) -> float:
    import jax

    jax.block_until_ready(fn())  # warm up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t0)
    return max(min(times), 1e-9)


def _paired_medians(fa: Callable[[], Any], fb: Callable[[], Any], repeats: int) -> tuple[float, float]:
    """Median seconds of ``fa`` and of ``fb``, their runs interleaved (a b, b a, a b, ...): what the machine does
    meanwhile (this one is shared) then weighs on both alike, and a difference of the two is steadier than of two
    separate series."""
    import jax

    jax.block_until_ready(fa())  # compile and warm up
    jax.block_until_ready(fb())
    times: dict[int, list[float]] = {0: [], 1: []}
    for i in range(repeats):
        for which in (0, 1) if i % 2 == 0 else (1, 0):
            fn = fa if which == 0 else fb
            t0 = time.perf_counter()
            jax.block_until_ready(fn())
            times[which].append(time.perf_counter() - t0)
    return statistics.median(times[0]), statistics.median(times[1])


@dataclass(frozen=True)
class _Sizes:
    """Microbenchmark sizes: an m x m x m matmul, ``passes`` elementwise passes over ``elems`` float32, and
    all-reduces of two sizes (float32 elements), per device."""

    matmul: int
    passes: int
    elems: int
    allreduce: tuple[int, int]


_SIZES = {"cpu": _Sizes(matmul=384, passes=500, elems=16 * 1024, allreduce=(256, 2**18))}
"""simulated CPU devices: the sizes a small model's layer has (64 KiB per device, in cache), kept short since
the devices share the host's cores"""
_ACCELERATOR = _Sizes(matmul=8192, passes=10, elems=1 << 27, allreduce=(2**16, 2**24))
"""GPUs and other accelerators: sizes that saturate the device (a 512 MiB array per pass, so a loop
iteration's own cost is a few percent of it; a 64 MiB all-reduce, where NVLink's bandwidth shows, against a
256 KiB one for its latency); what a small op costs beyond its FLOPs and bytes there is its launch, measured
by ``op_overhead``"""


def calibrate(devices: list | None = None, *, repeats: int = 7, hosts: int = 1) -> Calibration:
    """Microbenchmarks on ``devices`` (default: every device JAX sees here), all of them at once.

    ``hosts``: the devices are that many hosts' (in order, equally many each); collectives are measured
    within each host, every host at once, as a pipeline's meshes run theirs.
    """
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    t_start = time.perf_counter()
    devices = list(jax.devices()) if devices is None else list(devices)
    n = len(devices)
    if isinstance(hosts, bool) or not isinstance(hosts, (int, np.integer)) or hosts < 1 or n % hosts:
        raise ClusterError(f"cannot split {n} devices into hosts of equally many devices: hosts must be a positive "
                           f"integer dividing {n}")
    hosts = int(hosts)
    per_host = n // hosts
    mesh = Mesh(np.array(devices, dtype=object).reshape(hosts, per_host), ("x", "y"))
    per_device = NamedSharding(mesh, PartitionSpec(("x", "y")))  # a leading axis of n: one block per device

    def spread(shape: tuple[int, ...]) -> Any:
        """A standard-normal block of ``shape`` per device: drawn on the host when small, on the devices when
        large (an accelerator's sizes would take seconds of host RNG and copying)."""
        if 4 * int(np.prod(shape)) <= 16 << 20:
            return jax.device_put(np.random.default_rng(0).standard_normal((n, *shape), dtype=np.float32), per_device)
        draw = jax.jit(lambda key: jax.random.normal(key, (n, *shape), jnp.float32), out_shardings=per_device)
        return draw(jax.random.key(0))

    sizes = _SIZES.get(devices[0].platform, _ACCELERATOR)

    # FLOP rate: one m x m matmul per device, concurrently
    m = sizes.matmul
    a, b = spread((m, m)), spread((m, m))
    matmul = jax.jit(lambda a, b: jnp.einsum("dij,djk->dik", a, b), out_shardings=per_device)
    # the first: timed after half a second of it (a fresh process's first matmuls ran 20-30% slower here)
    flops = 2 * m**3 / _median_seconds(lambda: matmul(a, b), 3 * repeats, warm_up=0.5)

    # memory bandwidth: a loop of elementwise passes inside one program, so the call's dispatch is spread
    # over many passes
    passes, elems = sizes.passes, sizes.elems
    x = spread((elems,))
    axpy = jax.jit(lambda x: jax.lax.fori_loop(0, passes, lambda _, y: y * 0.999 + 0.001, x), out_shardings=per_device)
    bandwidth = 2 * 4 * elems * passes / _median_seconds(lambda: axpy(x), 3 * repeats)

    # collectives: an all-reduce over each host's devices (every host at once) at two sizes, solved for alpha and
    # beta of the ring formula
    def allreduce_seconds(elems: int, rounds: int = 40) -> float:
        """Seconds of one all-reduce inside a program: a loop of ``rounds`` all-reduces (each round sums a
        host's devices' rows and hands each of them the sum), less the same loop without the collective."""
        y = spread((elems,))

        def in_hosts(z: Any) -> Any:
            total = z.reshape(hosts, per_host, elems).sum(axis=1, keepdims=True) * (1.0 / per_host)
            return jax.lax.with_sharding_constraint(jnp.broadcast_to(total, (hosts, per_host, elems)).reshape(n, elems), per_device)

        def loop(body: Callable[[Any], Any]) -> Any:
            return jax.jit(lambda y: jax.lax.fori_loop(0, rounds, lambda _, z: body(z), y), out_shardings=per_device)

        reduce = loop(in_hosts)
        local = loop(lambda z: z * (1.0 / per_host))
        return max(_median_seconds(lambda: reduce(y), repeats) - _median_seconds(lambda: local(y), repeats), 1e-7 * rounds) / rounds

    small, large = sizes.allreduce
    if per_host > 1:
        t_small, t_large = allreduce_seconds(small), allreduce_seconds(large)
        ring = 2 * (per_host - 1) / per_host * 4  # bytes on the wire per element of the reduced tensor
        beta = max((t_large - t_small) / (ring * (large - small)), 1e-15)
        alpha = max(t_small - beta * ring * small, 1e-7)
        intra_bw, intra_lat = 1.0 / beta, alpha
    else:
        intra_bw, intra_lat = bandwidth, 1e-6

    # host to device: a host array (4 MiB per device: smaller ones may be aliased, not copied) put on the devices,
    # each receiving its tile, as a batch argument is every step; a tile's bytes over the seconds (the planner
    # charges tile / bandwidth); the fastest of the repeats, as for the host link: other work only adds time
    h2d_elems = 1 << 20
    host = np.random.default_rng(2).standard_normal((n, h2d_elems), dtype=np.float32)
    h2d = 4 * h2d_elems / _fastest_seconds(lambda: jax.device_put(host, per_device), repeats)

    # per-message cost between meshes: a small tensor put from one half of the devices (a host, on several) onto the
    # other, as the in-process runtime sends a stage's activation to the next stage's mesh, timed to its arrival
    transfer_overhead = _transfer_overhead(devices, intra_bw, repeats)

    # per-program cost: launching a tiny program on the devices and waiting for it (a unit task's fixed cost)
    tiny = spread((8,))
    bump = jax.jit(lambda y: y + 1.0, out_shardings=per_device)
    task_overhead = _median_seconds(lambda: bump(tiny), 30 * repeats)  # ~0.2 ms a sample: many are cheap

    # per-op cost: a reference program (a small MLP's training step, data parallel over the devices), minus its
    # FLOP and byte time at the rates just measured, over its op count as the planner traces it
    op_overhead = _op_overhead(devices, per_device, flops, bandwidth, task_overhead, repeats)

    # per summed tensor: a program adding k pairs of tensors on one host's devices, as the runtime sums a unit
    # task's gradients on its stage's mesh
    host_mesh = Mesh(np.array(devices[:per_host], dtype=object).reshape(1, per_host), ("x", "y"))
    sum_overhead = _sum_overhead(host_mesh, bandwidth, op_overhead, repeats)

    return Calibration(
        platform=devices[0].platform,
        num_devices=n,
        device_flops=float(flops),
        memory_bandwidth=float(bandwidth),
        op_overhead=float(op_overhead),
        task_overhead=float(task_overhead),
        intra_host_bandwidth=float(intra_bw),
        intra_host_latency=float(intra_lat),
        seconds=time.perf_counter() - t_start,
        host_to_device_bandwidth=float(h2d),
        sum_overhead=float(sum_overhead),
        device_memory=_device_memory(devices),
        transfer_overhead=transfer_overhead,
    )


MESSAGE_PAUSE = 2e-3
"""Seconds the devices idle before each timed message (``_transfer_overhead``)."""


def _transfer_overhead(devices: list, bandwidth: float, repeats: int) -> float | None:
    """Seconds one cross-mesh message costs beyond its bytes, between the two halves of ``devices`` (None: fewer
    than two devices, or an odd count).

    A 1 KiB tile per device, split over the first half of the devices, put onto the second half in the same
    layout and waited for: what the in-process runtime does with each tensor a stage gets from another mesh
    (``runtime.pipeline``), less its bytes over the link. Each put follows ``MESSAGE_PAUSE`` of idle devices, as
    a RECV follows a wait in a pipeline: simulated CPU devices' threads sleep when idle, and a put onto them then
    costs 0.4 ms here, against 0.09 ms back to back. The runtime's own messages, each timed alone, measure
    0.23-0.77 ms (medians per mesh of the four tiny models); timed back to back, the overhead predicted them 3-6x
    too fast, and priced at their bytes alone (microseconds), 100x.
    """
    import jax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    n = len(devices)
    if n < 2 or n % 2:
        return None
    half = n // 2
    meshes = [Mesh(np.array(part, dtype=object).reshape(1, half), ("x", "y")) for part in (devices[:half], devices[half:])]
    src, dst = (NamedSharding(m, PartitionSpec(("x", "y"))) for m in meshes)
    elems = 256 * half  # 1 KiB of float32 per device
    x = jax.device_put(np.random.default_rng(4).standard_normal((elems,), dtype=np.float32), src)
    seconds = _median_seconds(lambda: jax.device_put(x, dst), 20 * repeats, pause=MESSAGE_PAUSE)
    return max(seconds - 4 * 256 / bandwidth, 0.0)


def _device_memory(devices: list) -> float | None:
    """The smallest per-device allocation limit the backend reports (GPUs: ``bytes_limit``); None where it reports none."""
    limits = []
    for d in devices:
        try:
            stats = d.memory_stats() or {}
        except Exception:  # noqa: BLE001 - CPU backends may raise instead of returning None
            stats = {}
        if not stats.get("bytes_limit"):
            return None
        limits.append(float(stats["bytes_limit"]))
    return min(limits) if limits else None


def _op_overhead(devices: list, per_device: Any, flops: float, bandwidth: float, task_overhead: float, repeats: int) -> float:
    """Seconds per traced op beyond its roofline: the slope of a reference program's time over its op count.

    The reference is a small MLP's training step (one copy per device, run at once, as a mesh's devices run
    their parts) at depths 4 and 32, their runs interleaved; the deeper one's extra time, less its extra FLOP
    and byte time, over its extra ops. A slope needs no launch cost subtracted: taking one measured
    ``task_overhead`` off a single program's time left the per-op figure varying 2x from one calibration to the
    next on this shared machine; depths 4 and 16 timed one after the other, 1.4-1.9x; interleaved at 4 and 32
    with 84 samples each, about 1.1x (five calibrations back to back, ``benchmarks/calibration.py``).
    """
    import jax
    import jax.numpy as jnp

    from alpa_lab.graph.trace import trace

    n = len(devices)
    rng = np.random.default_rng(1)
    width, batch = 64, 16

    def reference(depth: int) -> tuple[Callable[[], Any], float, int]:
        params = [
            (rng.standard_normal((width, width), dtype=np.float32) * 0.1, np.zeros(width, np.float32)) for _ in range(depth)
        ]

        def loss(params: Any, x: Any) -> Any:
            for w, b in params:
                x = jnp.tanh(x @ w + b)
            return jnp.mean(x**2)

        def train_step(params: Any, x: Any) -> Any:
            grads = jax.grad(loss)(params, x)
            return jax.tree_util.tree_map(lambda p, g: p - 0.1 * g, params, grads)

        stacked = jax.tree_util.tree_map(lambda p: jax.device_put(np.stack([p] * n), per_device), params)
        xs = jax.device_put(rng.standard_normal((n, batch, width), dtype=np.float32), per_device)
        step = jax.jit(jax.vmap(train_step), out_shardings=per_device)
        graph = trace(train_step, params, xs[0])
        work = sum(max(op.flops / flops, op.bytes_accessed / bandwidth) for op in graph.ops)
        return (lambda: step(stacked, xs)), work, len(graph.ops)

    (run_small, w_small, n_small), (run_large, w_large, n_large) = reference(4), reference(32)
    t_small, t_large = _paired_medians(run_small, run_large, 12 * repeats)
    slope = ((t_large - t_small) - (w_large - w_small)) / max(n_large - n_small, 1)
    if slope > 0:
        return slope
    # the two timings did not separate (a very fast device, or noise): the deeper program alone, less its launch
    return max(t_large - task_overhead - w_large, 0.0) / max(n_large, 1)


def _sum_overhead(mesh: Any, bandwidth: float, op_overhead: float, repeats: int) -> float:
    """Seconds each tensor summed over the micro-batches costs beyond an op's overhead and its bytes.

    A pipeline's sums are one program per unit task adding each of its k summed tensors into its sum
    (``runtime.accumulate``): k kernels and k results, which cost more than k ops inside a stage's program,
    where XLA fuses them (measured: 11-16 us a tensor on simulated CPU devices, against 3-4 us an op). The
    slope of that program's time from 2 to 18 tensors of 4 KiB per device of ``mesh`` (a stage's sub-mesh:
    one host's devices), interleaved, less an op's overhead and an add's bytes at the measured bandwidth.
    """
    import jax
    from jax.sharding import NamedSharding, PartitionSpec

    elems, few, many = 1024, 2, 18
    add = jax.jit(lambda sums, xs: [s + x for s, x in zip(sums, xs)])
    # every other tensor split over the mesh, the rest replicated, as a stage's gradients are (weights split,
    # biases and norms often whole): 4 KiB per device either way
    layouts = (NamedSharding(mesh, PartitionSpec(("x", "y"))), NamedSharding(mesh, PartitionSpec()))
    rng = np.random.default_rng(3)
    tensors = [jax.device_put(rng.standard_normal((elems * (mesh.size if i % 2 == 0 else 1),), dtype=np.float32), layouts[i % 2])
               for i in range(2 * many)]
    t_few, t_many = _paired_medians(lambda: add(tensors[:few], tensors[many:many + few]),
                                    lambda: add(tensors[:many], tensors[many:]), 8 * repeats)
    per_tensor = (t_many - t_few) / (many - few)
    return max(per_tensor - op_overhead - 3 * 4 * elems / bandwidth, 0.0)


def fit_transfer(sizes: list[int], seconds: list[float]) -> tuple[float, float]:
    """(latency, bandwidth) of a link from transfer times at several sizes: the line t = alpha + n / bw.

    Fitted on relative errors (weights 1/t), so the small sizes, where latency shows, count as much as the
    large ones, and one slow large transfer cannot make every prediction slow.
    """
    t = np.asarray(seconds, dtype=float)
    slope, intercept = np.polyfit(np.asarray(sizes, dtype=float), t, 1, w=1.0 / np.maximum(t, 1e-9))
    bandwidth = 1.0 / slope if slope > 0 else max(sizes) / max(min(seconds), 1e-9)
    return max(float(intercept), 0.0), float(bandwidth)
