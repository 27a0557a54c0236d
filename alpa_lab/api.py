"""The public entry point: ``parallelize(train_step, cluster=...)``.

``ParallelizedStep`` ties the pure pieces together for a user: trace (cached per argument
shapes), plan (one ILP per candidate logical mesh shape, the cheapest kept), run (the
current plan, compiled once). It holds the *current plan*; editing returns new plans and
``use`` makes one current, so a failed edit never loses the plan that works.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import threading
import time
import warnings
import weakref
from typing import TYPE_CHECKING, Any, Callable, Iterator, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from alpa_lab._gc import quiet_gc
from alpa_lab.cost.cluster import ClusterError, ClusterSpec, LogicalMesh, parse_bytes
from alpa_lab.graph.analysis import Leaf, batch_dimension, find_aliases, state_aliases
from alpa_lab.graph.markers import auto_layers, forward_layers
from alpa_lab.graph.opgraph import OpGraph
from alpa_lab.graph.trace import (
    LostUpdatesError, TraceError, _path_str, args_signature, leaf_aval, static_hint, trace, with_nnx_changes, write_back_nnx,
)
from alpa_lab.passes.intra_op import OUTPUT_PIN, StrategyGraph, build_strategy_graph
from alpa_lab.passes.ilp import InfeasibleError
from alpa_lab.passes.methods import METHODS, MethodError, MethodSolution, make_plan, solve_tied
from alpa_lab.parallel_method import CreateStateParallel, FollowParallel, MethodOptionError, ParallelMethod, PlanMethod
from alpa_lab.passes.pipeline import LOGICAL_MESH_SPACES, PipelineProblem, in_flight_rule, plan_pipeline, stage_schedule
from alpa_lab.passes.schedule import INFERENCE, SCHEDULES
from alpa_lab.passes.stages import APPLY
from alpa_lab.passes.submesh import check_submesh_space
from alpa_lab.plan import PinError, PipelinePlan, Plan, PlanFormatError
from alpa_lab.sharding.constraints import DeviceError
from alpa_lab.sharding.spec import ShardingSpec
from alpa_lab.runtime.apply import CompiledPlan, call_compiled, compile_plan
from alpa_lab.runtime.pipeline import CompiledPipeline, compile_pipeline
from alpa_lab.runtime.program import mesh_placements

if TYPE_CHECKING:
    from alpa_lab.runtime.ray_cluster import RayCluster

COST_MODELS = ("analytic", "profile")
"""``analytic``: FLOPs, bytes and link speeds (``ClusterSpec``); ``profile``: each planned stage compiled and
timed on this process's devices (``runtime.stage_profile``, Alpa's profiling model), cached on disk."""

DEFAULT_LAYERS = 8
"""Layers the automatic layering cuts a step into when pipelining (``layers=`` overrides)."""
OWN_PLANS_KEPT = 8
"""plans a step keeps for the argument shapes it was called with (as jax.jit keeps its traces)"""
TRACES_KEPT = 8
"""argument shapes a step keeps the trace, planner state and compiled program of, as ``jax.jit`` keeps
its traces: alternating shapes (an epoch's last, smaller batch) compile once each; the least recently
used goes first"""


def _keep(cache: dict, key: Any, value: Any, limit: int = TRACES_KEPT) -> Any:
    """Put ``key`` last in ``cache`` (insertion order is its age) and drop the oldest beyond ``limit``.

    Callers hold the step's ``_cache_lock``: a training run's thread traces and compiles too."""
    cache.pop(key, None)
    cache[key] = value
    for old in list(cache)[: max(len(cache) - limit, 0)]:
        cache.pop(old, None)
    return value


def _pure_data_parallel(mesh: LogicalMesh) -> LogicalMesh | None:
    """Data parallelism on a line of devices issues the gradients' all-reduces and nothing else (Alpa's
    ``force_data_parallel`` forbids all-gathers and all-to-alls): without this an MoE layer's weight gradient priced
    cheaper from its inputs resharded over the experts by all-to-alls and then gathered, which is not data
    parallelism. A grid keeps them: the cost model prices an all-reduce over both axes at the slower axis's
    bandwidth, and a reduce-scatter, all-reduce, all-gather over the two axes is how an all-reduce runs there."""
    if sum(n > 1 for n in mesh.shape) != 1:
        return None
    kinds = tuple(sorted(set(mesh.forbidden) | {"all-gather", "all-to-all"}))
    return None if kinds == tuple(sorted(mesh.forbidden)) else dataclasses.replace(mesh, forbidden=kinds)


@quiet_gc()
def plan_graph(
    graph: OpGraph,
    cluster: ClusterSpec,
    *,
    mesh_shape: tuple[int, int] | None = None,
    method: str = "alpa",
    memory_budget: float | None = None,
    pins: Mapping[str, str] | None = None,
    progress: Callable[[str], None] | None = None,
    batch_vars: frozenset[int] | None = None,
    batch_mesh_axis: int | None = None,
    forbidden: tuple[str, ...] = (),
    weight_update_sharding: bool = True,
) -> Plan:
    """Plan ``graph`` on ``cluster``: the cheapest plan over the candidate mesh shapes (``batch_vars``: the
    arguments the data-parallel methods split, where the user named them; ``batch_mesh_axis``: Alpa's
    ``force_batch_dim_to_mesh_dim``, the mesh axis every batch tensor stays split over; ``forbidden``: collective
    kinds no strategy or resharding may issue, Alpa's ``allow_all_gather=False`` / ``allow_all_to_all=False``;
    ``weight_update_sharding=False``: the ILP's own method leaves the weight update as the ILP placed it, as Alpa's
    ``ShardParallel`` does without ``prefer_reduce_scatter``)."""
    if method not in METHODS:
        raise MethodError(f"unknown planning method {method!r}; choose one of {', '.join(METHODS)}")
    shapes = [tuple(mesh_shape)] if mesh_shape is not None else cluster.logical_mesh_shapes()
    if mesh_shape is None and batch_mesh_axis is not None:  # the forced axis splits the batch: grids where it can
        shapes = [s for s in shapes if s[batch_mesh_axis] > 1] or shapes
    meshes = [dataclasses.replace(cluster.logical_mesh(s), forbidden=tuple(forbidden)) for s in shapes]  # validates a given shape
    best: Plan | None = None
    tried = []
    errors = []
    for mesh in meshes:
        t0 = time.perf_counter()

        def solve(mesh: LogicalMesh) -> tuple[StrategyGraph, MethodSolution]:
            return solve_tied(
                lambda period: dataclasses.replace(
                    build_strategy_graph(graph, mesh, tie_period=period), batch_vars=batch_vars, batch_mesh_axis=batch_mesh_axis,
                    weight_update_sharding=weight_update_sharding),
                method, pins, memory_budget=memory_budget,
            )

        pure = _pure_data_parallel(mesh) if method == "data_parallel" else None
        try:
            try:
                sg, solved = solve(pure or mesh)
            except InfeasibleError:
                if pure is None:
                    raise
                sg, solved = solve(mesh)  # a program pure data parallelism cannot plan: what it needs besides
        except MethodError as exc:
            errors.append(str(exc))
            continue
        except InfeasibleError as exc:
            if not forbidden:
                raise
            errors.append(f"on the {mesh.shape[0]}x{mesh.shape[1]} mesh no plan avoids {' and '.join(forbidden)} ({exc})")
            continue
        plan = make_plan(sg, solved, method=method, cluster=cluster.to_dict(), pins=dict(pins or {}), memory_budget=memory_budget)
        tried.append((mesh.shape, plan.objective))
        if progress:
            progress(f"mesh {mesh.shape[0]}x{mesh.shape[1]}: {plan.objective * 1e3:.3f} ms ({time.perf_counter() - t0:.2f}s)")
        if best is None or plan.objective < best.objective:
            best = plan
    if best is None:
        hint = (f"; allow {' and '.join(forbidden)} again (AutoShardingOption(allow_all_gather=True, allow_all_to_all=True)) "
                "or give another mesh" if forbidden else "")
        raise MethodError("; ".join(errors) + hint)
    return dataclasses.replace(best, mesh_candidates=tuple(tried))


@dataclasses.dataclass
class _Session:
    """What ``init`` set up: the cluster kind asked for, its arguments, and the Ray cluster (None: "local")."""

    kind: str | None = None
    asked: tuple = ()
    ray: Any = None
    joined: bool = False
    """the Ray was running in this process before ``init`` (the user's own): ``shutdown`` leaves it running"""
    generation: int = 0
    """counts ``init``, ``shutdown`` and ``set_global_virtual_physical_mesh`` calls: a step settled before settles again"""
    virtual_mesh: Any = None
    """``set_global_virtual_physical_mesh``'s part of the Ray cluster (None: all of it)"""


_SESSION = _Session()
_SESSION_LOCK = threading.RLock()
_STEPS: weakref.WeakSet = weakref.WeakSet()  # every ParallelizedStep alive: for shutdown and clear_executable_cache
_RUNS: weakref.WeakSet = weakref.WeakSet()  # every RayRun and TrainingRun a step started: shutdown ends those on its cluster
CLUSTER_KINDS = ("ray", "local")


def _session_cluster() -> tuple[int, Any]:
    """(generation, the session's open Ray cluster or None: then steps without a cluster plan for this process's)."""
    with _SESSION_LOCK:
        ray_cluster = _SESSION.ray if _SESSION.ray is not None and not _SESSION.ray._closed else None
        return _SESSION.generation, ray_cluster


def _session_spec(ray_cluster: Any) -> ClusterSpec:
    """What steps without a cluster plan for: the session's Ray cluster (the part ``set_global_virtual_physical_mesh``
    chose), else this process's devices."""
    if ray_cluster is None:
        return ClusterSpec.default()
    mesh = _SESSION.virtual_mesh
    return mesh.spec if mesh is not None and mesh.cluster is ray_cluster else ray_cluster.spec


class _CallTimer:
    """Each call's seconds, from its dispatch to its results being ready, without making the call wait: a
    daemon thread waits for the results instead (as Alpa's executables time their runs). A call's seconds
    start when it was dispatched or when the call before it finished, whichever is later, so calls queued
    behind each other are not counted twice."""

    def __init__(self) -> None:
        import queue

        self._queue: Any = queue.Queue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def record(self, costs: Any, t0: float, results: Any) -> None:
        with self._lock:
            if self._thread is None:
                import atexit

                self._thread = threading.Thread(target=self._wait_for_results, name="alpa_lab-call-timer", daemon=True)
                self._thread.start()
                atexit.register(self._stop)  # before JAX's own clean-up (registered earlier, run later)
        self._queue.put((costs, t0, results))

    def _stop(self) -> None:
        self._queue.put(None)
        if self._thread is not None:
            self._thread.join(timeout=10.0)

    def sync(self) -> None:
        """Wait until every call recorded so far has finished."""
        self._queue.join()

    def _wait_for_results(self) -> None:
        last_end = 0.0
        while True:
            item = self._queue.get()
            if item is None:  # the interpreter is exiting
                self._queue.task_done()
                return
            costs, t0, results = item
            try:
                jax.block_until_ready(results)
            except Exception:  # noqa: BLE001 - a failed call has no time; the caller got its error
                pass
            else:
                end = time.perf_counter()
                costs.append(end - max(t0, last_end))
                last_end = end
            finally:
                del results
                self._queue.task_done()


_TIMER = _CallTimer()
CALL_COSTS_KEPT = 1000
"""per plan, the seconds of its last this many calls (``Executable.get_execution_time_costs``)"""


def init(
    cluster: str = "ray", cluster_address: str | None = None, num_nodes: int | None = None,
    num_devices_per_node: int | None = None, namespace: str | None = None, *, dashboard: bool = False,
) -> Any:
    """Alpa's ``alpa.init``: choose where parallelized steps run, for the steps that were given no cluster.

    ``"ray"``: on the mesh workers of a Ray cluster. It joins ``cluster_address`` (or ``RAY_ADDRESS``, or the
    Ray this process already runs: ``RayCluster.connect``), else starts a local Ray on 127.0.0.1 with
    ``num_nodes`` x ``num_devices_per_node`` simulated CPU devices (2 x 4 by default: ``RayCluster.local``).
    Such steps plan for that cluster and their calls run there. ``"local"``: in this process, on its devices
    (as without ``init``). Returns the ``RayCluster`` (None for "local"). Called again with the same
    arguments it does nothing, as Alpa's; with others it says to ``shutdown()`` first. ``namespace`` (Alpa's
    Ray namespace for its named actors) is accepted and unused: mesh workers are not named.
    """
    if cluster not in CLUSTER_KINDS:
        raise ValueError(
            f"unknown cluster {cluster!r} for alpa_lab.init: choose 'ray' (mesh workers on a Ray cluster) or 'local' "
            "(this process's devices)")
    for name, v in (("num_nodes", num_nodes), ("num_devices_per_node", num_devices_per_node)):
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1):
            raise ValueError(f"{name} must be a positive integer, got {v!r}")
    asked = (cluster, cluster_address, num_nodes, num_devices_per_node, dashboard)
    with _SESSION_LOCK:
        if _SESSION.kind is not None and _SESSION.ray is not None and _SESSION.ray._closed:
            _end_session()  # its Ray was stopped by other means: start afresh
        if _SESSION.kind is not None:
            if _SESSION.asked != asked:  # as Alpa's: the first init stands
                warnings.warn(
                    f"alpa_lab.init was already called ({_SESSION.asked[0]!r}) and stands; call alpa_lab.shutdown() before "
                    f"init({cluster!r}, ...) to change it", stacklevel=2)
            return _SESSION.ray
        if cluster == "local":
            if num_nodes not in (None, 1) or cluster_address is not None:
                raise ValueError(
                    "init('local') is this process's devices (one host): drop num_nodes and cluster_address, or use init('ray')")
            if num_devices_per_node is not None and num_devices_per_node != jax.device_count():
                raise ValueError(
                    f"this process has {jax.device_count()} devices, not {num_devices_per_node}: set ALPA_LAB_CPU_DEVICES before "
                    "importing alpa_lab (simulated devices), or use init('ray', num_devices_per_node=...)")
            ray_cluster, joined = None, False
        else:
            ray_cluster, joined = _start_or_join(cluster_address, num_nodes, num_devices_per_node, dashboard)
        _SESSION.kind, _SESSION.asked, _SESSION.ray, _SESSION.joined = cluster, asked, ray_cluster, joined
        _SESSION.virtual_mesh = None
        _SESSION.generation += 1
        return ray_cluster


def _start_or_join(address: str | None, num_nodes: int | None, num_devices_per_node: int | None, dashboard: bool) -> tuple[Any, bool]:
    """``init("ray")``'s cluster, and whether it is a Ray this process already ran (left running by ``shutdown``)."""
    import os

    from alpa_lab.runtime.ray_cluster import RayCluster, RayClusterError, _ray

    running = _ray().is_initialized()
    address = address or os.environ.get("RAY_ADDRESS") or ("auto" if running else None)
    if address is None:
        return RayCluster.local(num_nodes or 2, num_devices_per_node or 4, dashboard=dashboard), False
    ray_cluster = RayCluster.connect(address, devices_per_host=num_devices_per_node)
    wrong = []
    if num_nodes is not None and num_nodes != ray_cluster.hosts:
        wrong.append(f"{ray_cluster.hosts} nodes, not num_nodes={num_nodes} (a subset of its nodes is not supported)")
    if num_devices_per_node is not None and num_devices_per_node != ray_cluster.devices_per_host:
        wrong.append(f"{ray_cluster.devices_per_host} devices per node, not num_devices_per_node={num_devices_per_node}")
    if wrong:
        if not running:  # joined here: leave it as it was
            _ray().shutdown()
        raise RayClusterError(f"the Ray cluster at {address!r} has {' and '.join(wrong)}: drop the argument")
    return ray_cluster, running


def shutdown() -> None:
    """Alpa's ``alpa.shutdown``: close the runs of the steps on ``init``'s Ray cluster and stop it (a Ray this
    process started; one it joined is only left). Steps bound to it then say so when called."""
    with _SESSION_LOCK:
        if _SESSION.kind is None:
            raise RuntimeError("alpa_lab.shutdown() without alpa_lab.init(): there is nothing to shut down")
        _end_session()


def _end_session() -> None:
    """Stop the training runs on the session's Ray cluster (each keeps its last state), close its Ray runs, stop
    the Ray if ``init`` started or joined it (not one this process ran before), and forget the session."""
    ray_cluster, joined = _SESSION.ray, _SESSION.joined
    _SESSION.kind, _SESSION.asked, _SESSION.ray, _SESSION.joined = None, (), None, False
    _SESSION.virtual_mesh = None
    _SESSION.generation += 1
    if ray_cluster is None:
        return
    runs = list(_RUNS)
    training = [r for r in runs if getattr(r, "on_ray", False) and r.step._ray_cluster is ray_cluster]
    for run in training:
        run.stop()
    for run in training:
        run.wait(60.0)
    for run in [r for r in runs if getattr(r, "cluster", None) is ray_cluster]:
        try:
            run.close()
        except Exception:  # noqa: BLE001 - a run whose workers already died: nothing left to close
            pass
    if joined:
        ray_cluster._closed = True  # the session's view of the user's Ray: closed; the Ray itself runs on
    else:
        ray_cluster.shutdown()


def get_global_cluster() -> Any:
    """Alpa's name: the ``RayCluster`` of ``init("ray")``; None without one (steps run in this process)."""
    return _SESSION.ray


def get_global_virtual_physical_mesh() -> Any:
    """Alpa's name: the part of ``init("ray")``'s cluster steps without devices plan for and run on (all of it unless
    ``set_global_virtual_physical_mesh`` chose a part); None without a Ray cluster."""
    with _SESSION_LOCK:
        ray_cluster = _session_cluster()[1]
        if ray_cluster is None:
            return None
        mesh = _SESSION.virtual_mesh
        return mesh if mesh is not None and mesh.cluster is ray_cluster else ray_cluster.get_virtual_physical_mesh()


_PHYSICAL_MESH: list = [None, None]
"""[session generation, the mesh ``get_global_physical_mesh`` made in it]"""


def get_global_physical_mesh(create_if_not_exist: bool = False) -> Any:
    """Alpa's name: the devices steps without a cluster of their own run on, made once per session as Alpa's is.
    Under ``init("ray")`` the global virtual mesh (``get_global_virtual_physical_mesh``), whose mesh workers run
    them, once asked for (``create_if_not_exist``); under ``init("local")`` this process's devices as a
    ``LocalPhysicalDeviceMesh``; before ``init``, that too once asked for. Otherwise None."""
    from alpa_lab.parallel_method import LocalPhysicalDeviceMesh

    with _SESSION_LOCK:
        generation, ray_cluster = _session_cluster()
        if _PHYSICAL_MESH[0] == generation and _PHYSICAL_MESH[1] is not None:
            return _PHYSICAL_MESH[1]
        if ray_cluster is not None:
            mesh = get_global_virtual_physical_mesh() if create_if_not_exist else None
        else:
            mesh = LocalPhysicalDeviceMesh() if create_if_not_exist or _SESSION.kind == "local" else None
        _PHYSICAL_MESH[:] = [generation, mesh]
        return mesh


def set_global_virtual_physical_mesh(mesh: Any) -> None:
    """Alpa's name: steps without a cluster of their own plan for ``mesh`` (part of ``init("ray")``'s cluster,
    ``get_global_cluster().get_virtual_physical_mesh(host_ids, num_devices_per_host)``) and run on its mesh
    workers, from their next call; None: the whole cluster again. Steps that planned for another part plan again."""
    from alpa_lab.runtime.ray_cluster import VirtualPhysicalMesh

    with _SESSION_LOCK:
        ray_cluster = _session_cluster()[1]
        if mesh is not None:
            if not isinstance(mesh, VirtualPhysicalMesh):
                raise TypeError("set_global_virtual_physical_mesh takes get_global_cluster().get_virtual_physical_mesh(...), "
                                f"got {type(mesh).__name__}")
            if ray_cluster is None or mesh.cluster is not ray_cluster:
                raise RuntimeError(
                    "set_global_virtual_physical_mesh: that mesh is not of this session's Ray cluster; call alpa_lab.init('ray') "
                    "and take the mesh from alpa_lab.get_global_cluster().get_virtual_physical_mesh(...)")
        _SESSION.virtual_mesh = mesh
        _SESSION.generation += 1


def get_global_num_devices() -> int:
    """Alpa's name: the devices steps without a cluster plan for: ``init("ray")``'s cluster's (its global virtual
    mesh's), else this process's."""
    if _SESSION.ray is not None:
        mesh = get_global_virtual_physical_mesh()
        return mesh.num_devices if mesh is not None else _SESSION.ray.num_devices
    return jax.device_count()


def clear_executable_cache() -> None:
    """Alpa's name: the next call of every step compiles again, and plans again where the step's plan is its
    own (unedited); a plan a user edited, pinned or loaded stays current. Traces go too."""
    for step in list(_STEPS):
        step._forget_own_plans()


def _not_defaults(given: Mapping[str, Any], fn: Callable) -> list[str]:
    """The names in ``given`` whose value is not ``fn``'s default for that parameter (options passed), sorted."""
    defaults = inspect.signature(fn).parameters
    return sorted(k for k, v in given.items() if v != defaults[k].default)


@dataclasses.dataclass(frozen=True)
class StaticArgs:
    """Arguments bound into the traced function, not passed to the program (Alpa's ``static_argnums``): a function
    (``model.apply``), a string, a flag the step branches on in Python. Their values key the traces, so a call with
    other values traces (and plans) anew, as ``jax.jit`` compiles anew."""

    positions: tuple[int, ...]
    values: tuple[Any, ...]

    @property
    def key(self) -> tuple:
        """The values as a trace key: each by equality where it hashes, else by identity."""
        out = []
        for p, v in zip(self.positions, self.values):
            try:
                hash(v)
                out.append((p, "value", v))
            except TypeError:
                out.append((p, "id", id(v)))
        return tuple(out)

    def dynamic(self, args: tuple) -> tuple:
        return tuple(a for i, a in enumerate(args) if i not in self.positions)

    def bind(self, fn: Callable) -> Callable:
        """``fn`` taking the other arguments only, in order, with these put back at their positions."""
        at = dict(zip(self.positions, self.values))

        def bound(*dynamic: Any) -> Any:
            rest = iter(dynamic)
            return fn(*(at[i] if i in at else next(rest) for i in range(len(dynamic) + len(at))))

        return functools.wraps(fn)(bound)


def check_static_argnums(static_argnums: Any) -> str | tuple[int, ...]:
    """Alpa's ``static_argnums``: "auto", None / () (none), or argument positions (an int or a sequence)."""
    if static_argnums == "auto":
        return "auto"
    if static_argnums is None:
        return ()
    nums = (static_argnums,) if isinstance(static_argnums, (int, np.integer)) else static_argnums
    try:
        nums = tuple(nums)
    except TypeError:
        nums = None
    if nums is None or any(isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 0 for n in nums):
        raise ValueError(f"static_argnums must be 'auto' or argument positions (e.g. 2 or (2, 3)), got {static_argnums!r}")
    return tuple(sorted(set(int(n) for n in nums)))


def _not_an_array(x: Any) -> bool:
    return not (hasattr(x, "shape") and hasattr(x, "dtype")) and not isinstance(x, (bool, int, float, complex, np.generic))


def static_positions(args: tuple, static_argnums: str | tuple[int, ...]) -> tuple[int, ...]:
    """The static arguments of a call: those given, or with "auto" (Alpa's rule, narrowed) each argument that is a
    string, a Python bool (a flag the step branches on, ``deterministic=False``: two programs at most), or holds only
    values JAX cannot take as arrays (a function, a module, an object). An argument mixing arrays with such values is
    not made static whole (its arrays would become constants of the program): the trace names the value instead.
    Python numbers stay arguments of the program (traced, as ``jax.jit`` types them, so a new learning rate does not
    plan again): give their positions to make them static."""
    if static_argnums == "auto":
        out = []
        for i, a in enumerate(args):
            leaves = jax.tree_util.tree_leaves(a)
            if isinstance(a, (str, bool)) or (leaves and all(_not_an_array(x) for x in leaves)):
                out.append(i)
        return tuple(out)
    missing = [i for i in static_argnums if i >= len(args)]
    if missing:
        raise ValueError(f"static_argnums names argument {missing[0]} but the call passes {len(args)} arguments")
    return tuple(static_argnums)


def _static_entry(skip: int = 0) -> Callable[[Callable], Callable]:
    """A public method taking the step's arguments (after ``skip`` others): the outermost such call binds the static
    arguments (``ParallelizedStep._bind_static``) and passes the rest on; calls it makes in turn get those as they are."""

    def decorate(method: Callable) -> Callable:
        @functools.wraps(method)
        def wrapper(self: ParallelizedStep, *args: Any, **kwargs: Any) -> Any:
            with self._serving(args[skip:]) as dynamic:
                return method(self, *args[:skip], *dynamic, **kwargs)

        return wrapper

    return decorate


class ParallelizedStep:
    """A training step with a plan: call it like the original function."""

    def __init__(
        self,
        fn: Callable,
        cluster: ClusterSpec | str | RayCluster | None = None,
        *,
        mesh_shape: tuple[int, int] | None = None,
        method: str | ParallelMethod = "alpa",
        memory_budget: float | str | None = None,
        microbatches: int | None = None,
        schedule: str = "1f1b",
        layers: int | None = None,
        max_stages: int | None = None,
        cost_model: str = "analytic",
        remat: bool = False,
        submesh_space: str = "all",
        batch_argnums: int | tuple[int, ...] | None = None,
        logical_meshes: str = "all",
        stage_option: Any = None,
        static_argnums: Any = "auto",
    ):
        alpa_default = method is None
        batch_mesh_axis = None
        weight_update_sharding = True
        forbidden: tuple[str, ...] = ()
        manual_sharding = None
        stage_inputs: tuple[tuple[str, ...], ...] | None = None
        cluster, runs_on = cluster_argument(cluster)
        method = "alpa" if method is None else method  # Alpa's parallelize(method=None): ShardParallel()
        self.parallel_method = method if isinstance(method, ParallelMethod) else None
        if isinstance(method, ParallelMethod):  # Alpa's method objects: the options they mean (parallel_method)
            given = {"microbatches": microbatches, "schedule": schedule, "layers": layers, "remat": remat,
                     "submesh_space": submesh_space, "logical_meshes": logical_meshes, "stage_option": stage_option,
                     "max_stages": max_stages}
            passed = _not_defaults(given, ParallelizedStep.__init__)
            if passed:  # the method object says how to pipeline (or not): one place for it
                raise ValueError(
                    f"method={type(method).__name__}(...) says how the step is pipelined; drop "
                    f"{', '.join(f'{k}={given[k]!r}' for k in passed)} or set it in the method "
                    "(num_micro_batches, pipeline_schedule, layer_option, stage_option), or pass parallelize's own options "
                    "without a method object")
            if isinstance(method, FollowParallel) and (cluster is not None or mesh_shape is not None):
                raise ValueError("method=FollowParallel(...) plans on the mesh of the step it follows: drop cluster= and mesh_shape=")
            opts, method_class = method.options(), type(method).__name__
            method = opts.pop("method")
            microbatches, schedule = opts.get("microbatches", microbatches), opts.get("schedule", schedule)
            layers = opts.get("layers", layers)
            remat, submesh_space = opts.get("remat", remat), opts.get("submesh_space", submesh_space)
            logical_meshes, stage_option = opts.get("logical_meshes", logical_meshes), opts.get("stage_option", stage_option)
            stage_inputs = opts.get("stage_input_shardings")
            batch_mesh_axis = opts.get("batch_mesh_axis")
            weight_update_sharding = opts.get("weight_update_sharding", True)
            manual_sharding = opts.get("manual_sharding")
            forbidden = opts.get("forbidden", ())
            if "cluster" in opts:  # the method's devices= (Alpa's device meshes) say the cluster and maybe the grid
                if cluster is not None or mesh_shape is not None:
                    raise ValueError(
                        f"method={method_class}(devices=...) says which devices and mesh to plan for; drop "
                        "cluster= / mesh_shape= or drop devices=")
                cluster, mesh_shape = opts["cluster"], opts.get("mesh_shape")
                runs_on = opts.get("ray_cluster")  # a Ray cluster's virtual mesh: its mesh workers run the calls
        if not isinstance(method, str) or method not in METHODS:
            raise MethodError(f"unknown planning method {method!r}; choose one of {', '.join(METHODS)}")
        if microbatches is not None and (isinstance(microbatches, bool) or not isinstance(microbatches, int) or microbatches < 1):
            raise ValueError(f"microbatches must be a positive integer, got {microbatches!r}")
        if schedule not in SCHEDULES:
            raise ValueError(f"unknown pipeline schedule {schedule!r}; choose one of {', '.join(sorted(SCHEDULES))}")
        if microbatches is not None:
            in_flight_rule(schedule, microbatches)  # a schedule the planner can plan, or a clear error
        if layers is not None and (isinstance(layers, bool) or not isinstance(layers, int) or layers < 1):
            raise ValueError(f"layers must be a positive integer, got {layers!r}")
        if max_stages is not None and (isinstance(max_stages, bool) or not isinstance(max_stages, (int, np.integer)) or max_stages < 1):
            raise ValueError(f"max_stages must be a positive integer (or None: as many as the DP finds best), got {max_stages!r}")
        max_stages = None if max_stages is None else int(max_stages)
        if memory_budget is not None:
            memory_budget = parse_bytes(memory_budget)
        if microbatches is not None and (mesh_shape is not None or memory_budget is not None):
            raise ValueError(
                "mesh_shape and memory_budget apply to single-mesh plans; a pipelined step chooses a logical "
                "mesh per stage and checks memory per stage (eq. 5): drop them or drop microbatches"
            )
        if cost_model not in COST_MODELS:
            raise ValueError(f"unknown cost model {cost_model!r}; choose one of {', '.join(COST_MODELS)}")
        check_submesh_space(submesh_space)
        if logical_meshes not in LOGICAL_MESH_SPACES:
            raise ValueError(f"unknown logical mesh space {logical_meshes!r}; choose one of {', '.join(LOGICAL_MESH_SPACES)}")
        if stage_option is not None and (microbatches is None or not callable(getattr(stage_option, "assign", None))):
            raise ValueError(
                "stage_option= fixes a pipeline's stages: give microbatches= too, and a ManualStageOption(...) or "
                f"UniformStageOption(...), got {stage_option!r}")
        if not isinstance(remat, bool):
            raise ValueError(f"remat must be True or False, got {remat!r}")
        if remat and microbatches is None:
            raise ValueError(
                "remat=True recomputes each pipeline layer in the backward; a single-mesh plan has no layers: "
                "plan with microbatches=, or put jax.checkpoint in your step where you want it"
            )
        if cost_model == "profile" and microbatches is None:
            raise ValueError(
                "cost_model='profile' times pipeline stages on the devices; a single-mesh plan has no stages: "
                "plan with microbatches= or use the analytic model (calibrate it with ClusterSpec.calibrate)"
            )
        self.cost_model = cost_model
        self.microbatches = microbatches
        self.schedule = schedule
        self.layers = layers
        self.max_stages = max_stages
        self.submesh_space = submesh_space
        self.logical_meshes = logical_meshes
        self.stage_option = stage_option
        self.stage_input_shardings = stage_inputs
        """Alpa's ``PipeshardParallel(stage_input_shardings=...)``: each stage's inputs pinned to these specs once the
        stages are chosen (``_stage_input_pins``); None: planned"""
        self.batch_argnums = check_batch_argnums(batch_argnums)
        self._alpa_batch = (alpa_default or self.parallel_method is not None) and self.batch_argnums is None
        """a method object (or method=None) without batch_argnums: Alpa's default, the batch is argument 1 where the
        step has one, read softly (``named_batch``: leaves of another leading size go whole)"""
        self.remat = remat
        self.user_fn = fn
        self.static_argnums = check_static_argnums(static_argnums)
        """Alpa's ``static_argnums``: "auto" (arguments holding only values that are not arrays, numbers or bools: a
        function, a string, an object; ``static_positions``) or the positions given; bound into the traced function
        (``StaticArgs``)"""
        self.hands_back_nnx = False
        """the step changes Flax NNX objects among its arguments in place and returns none of it (as written for
        ``nnx.jit``): it is traced as ``with_nnx_changes(fn)``, and each call puts the new state into the caller's
        objects (``write_back_nnx``). Found by the first trace (``LostUpdatesError``)."""
        self._calls = threading.local()
        """per thread: ``static``, the static arguments of the call being served there (and of its last one), what
        ``fn`` binds; ``depth``, how deep in the step's own methods that call is (``_serving``). Per thread, so a
        training run's thread (arrays only) never changes what a call in the notebook's thread binds."""
        self._cluster_given = cluster
        self._cluster: ClusterSpec | None = None  # without a cluster given: settled on first use (``cluster``)
        self._generation = -1
        if mesh_shape is not None:  # fail early on a mesh that does not fit (the cluster is not settled by it)
            session = _session_cluster()[1]
            (cluster or _session_spec(session)).logical_mesh(mesh_shape)
        self.mesh_shape = mesh_shape
        self.method = method
        self.batch_mesh_axis: int | None = batch_mesh_axis
        self.weight_update_sharding = weight_update_sharding
        """the paper's post-ILP weight-update sharding on a single mesh (Alpa's ``ShardParallel`` asks for it with
        ``prefer_reduce_scatter``; this planner's own ``method="alpa"`` always)"""
        self.manual_sharding = manual_sharding
        """Alpa's ``ManualShardingOption``: pins of the arguments and results, on the cluster's (hosts x devices) mesh"""
        """Alpa's ``force_batch_dim_to_mesh_dim`` (a method object's ``AutoShardingOption``): the plan's mesh, or every stage's"""
        self.forbidden_collectives: tuple[str, ...] = forbidden
        """collective kinds the plan may not issue (a method object's ``AutoShardingOption(allow_all_gather=False,
        allow_all_to_all=False)``): every mesh the step is planned on prices them infinitely (``LogicalMesh.forbidden``)"""
        self.memory_budget = memory_budget
        self.current_plan: Plan | PipelinePlan | None = None
        self._graphs: dict[Any, OpGraph] = {}
        self._splits: dict[Any, tuple[bool, ...]] = {}
        self._cache_lock = threading.RLock()  # the caches below; a training run's thread uses them too
        self._compiled: list[tuple[Plan | PipelinePlan, CompiledPlan | CompiledPipeline]] = []
        """(plan, its compiled program), the most recently used last (at most ``TRACES_KEPT``)"""
        self._problems: dict[Any, Any] = {}
        self._costs: dict[int, tuple[Any, Any]] = {}
        """id(plan) -> (plan, the seconds of its last calls): ``_call_costs``"""
        self._own_plans: dict[str, Plan | PipelinePlan] = {}
        """program fingerprint -> the plan ``plan()`` made for it, unedited: a call with other shapes
        plans those (or takes their plan from here), as ``jax.jit`` traces again; an edited, pinned or
        loaded plan is the user's, and other shapes are an error for it"""
        self.__name__ = getattr(fn, "__name__", "step")
        _STEPS.add(self)
        self.__doc__ = getattr(fn, "__doc__", None)
        if runs_on is not None:
            self.on_ray(runs_on)
        if isinstance(self.parallel_method, FollowParallel) and getattr(self.parallel_method.src_func, "pipelined", False):
            self._follow_pipeline(self.parallel_method)

    def _follow_pipeline(self, method: FollowParallel) -> None:
        """``FollowParallel`` of a pipelined step: this step is Alpa's inference pipeline over the source's stages,
        each on its sub-mesh and logical mesh (``_FollowedStages``), its weights laid out as the source holds them
        (``_follow(args, pipeline=True)``), ``method.num_micro_batches`` micro-batches (default: the source's); it runs
        in this process."""
        source = method.src_func
        self.microbatches = method.num_micro_batches or source.microbatches
        self.schedule = INFERENCE
        self.layers, self.remat = source.layers, False
        self.submesh_space, self.logical_meshes = source.submesh_space, source.logical_meshes
        self.stage_option = _FollowedStages(source)

    @property
    def cluster(self) -> ClusterSpec:
        """The cluster this step plans for: the one given to ``parallelize`` (or ``recalibrate``'s). Else it is
        settled on first use (as Alpa compiles on the first call) and again in each new session: the Ray cluster
        of ``init("ray")``, whose mesh workers then run the step's calls, or this process's devices. A new
        session with another cluster drops the plans the step made itself (an edited plan stays current)."""
        if self._cluster_given is not None:
            return self._cluster_given
        if isinstance(self.parallel_method, FollowParallel) and not self._ray_chosen:
            # an evaluation following another step: that step's cluster, run in this process (the mesh workers run
            # steps that return the new state; the state a Ray step returns is fetched here)
            return self.parallel_method.src_func.cluster
        generation, session = _session_cluster()
        if self._ray_chosen:  # on_ray(...) said where it runs
            generation, session = self._generation, None
        if self._cluster is None or generation != self._generation:
            if self._ray_chosen:  # the cluster on_ray named (planned for it unless the step already planned), or this process
                spec = self._cluster or (self._ray_cluster.spec if self._ray_cluster is not None else ClusterSpec.default())
            else:
                spec = _session_spec(session)
            with self._cache_lock:
                if self._cluster is not None and spec != self._cluster:
                    self._forget_own_plans()
                if not self._ray_chosen:
                    if self.ray_run is not None and self._ray_cluster is not session:
                        try:
                            self.ray_run.close()
                        except Exception:  # noqa: BLE001 - its Ray is gone already: nothing to close
                            pass
                        self.ray_run = None
                    # an inference pipeline plans for the session's cluster and runs in this process, as an evaluation
                    # following a step does (the mesh workers run training steps, which return the new state)
                    self._ray_cluster = None if self.microbatches is not None and self.schedule == INFERENCE else session
                self._cluster, self._generation = spec, generation
        return self._cluster

    @cluster.setter
    def cluster(self, cluster: ClusterSpec) -> None:
        self._cluster_given = cluster

    @property
    def ray_cluster(self) -> Any:
        """The Ray cluster whose mesh workers run this step's calls (``on_ray``, or ``init("ray")``'s); None: this process."""
        self.cluster  # noqa: B018 - settles the session's cluster first
        return self._ray_cluster

    @ray_cluster.setter
    def ray_cluster(self, cluster: Any) -> None:
        self._ray_cluster = cluster

    def _forget_own_plans(self) -> None:
        """Drop the compiled programs, traces and the plans this step made itself (re-planned on the next call);
        a plan the user edited, pinned or loaded stays current."""
        with self._cache_lock:
            own = self.current_plan is not None and self._own_plans.get(self.current_plan.fingerprint) is self.current_plan
            self._compiled.clear()
            self._own_plans.clear()
            self._graphs.clear()
            self._splits.clear()
            self._problems.clear()
        if own:
            self.current_plan = None

    # ----- static arguments ------------------------------------------------------------
    @property
    def _static(self) -> StaticArgs | None:
        return getattr(self._calls, "static", None)

    @_static.setter
    def _static(self, binding: StaticArgs | None) -> None:
        self._calls.static = binding

    @property
    def fn(self) -> Callable:
        """The function traced: the user's, with the current call's static arguments bound into it (and returning
        the NNX objects' new state with its results, for a step that changes them in place: ``hands_back_nnx``)."""
        fn = self.user_fn if self._static is None else self._static.bind(self.user_fn)
        return with_nnx_changes(fn) if self.hands_back_nnx else fn

    def _bind_static(self, args: tuple) -> tuple:
        """``args`` less their static arguments, which become the binding ``fn`` traces with."""
        positions = static_positions(args, self.static_argnums)
        if not positions:
            self._static = None
            return args
        binding = StaticArgs(positions, tuple(args[i] for i in positions))
        if self._static is None or self._static.key != binding.key:
            self._static = binding
        return binding.dynamic(args)

    def _refuse_static_run(self, what: str) -> None:
        """A run's steps take (state, batch) of arrays: a step whose calls bind static arguments cannot make them. (A
        call of the step on Alpa's Ray session launches its run itself, inside the call: its binding holds there.)"""
        if getattr(self._calls, "depth", 0):
            return
        if self._static is not None or self.static_argnums not in ("auto", ()):
            given = "" if self._static is None else f" (argument {', '.join(map(str, self._static.positions))} of its last call)"
            raise ValueError(
                f"{what} runs the step on (state, batch) of arrays, but this step takes static arguments{given}: close over "
                "them (functools.partial(step_fn, ...)) and parallelize that to train it in a run, or call the step in a loop")

    def _refuse_nnx_run(self, what: str) -> None:
        """A run keeps its state on the devices or mesh workers and hands back what the step returns: a step that
        changes Flax NNX objects in place (``hands_back_nnx``) has its changes put into the caller's objects at each
        call, in this process only."""
        if self.hands_back_nnx:
            raise ValueError(
                f"{what} runs the step on a state it keeps and passes from step to step, but {self.__name__!r} changes Flax "
                "NNX objects among its arguments in place and returns only its results (as written for nnx.jit): call it in "
                "a loop in this process, where each call updates your objects; or return the new state for a run: split "
                "outside the step (graphdef, state = nnx.split((model, optimizer))), merge inside it (model, optimizer = "
                "nnx.merge(graphdef, state)), and return (nnx.state((model, optimizer)), loss)")

    def _static_key(self) -> tuple:
        return () if self._static is None else self._static.key

    @contextlib.contextmanager
    def _serving(self, args: tuple, passed_on: bool = False) -> Iterator[tuple]:
        """Serve one call with the user's ``args``: the outermost binds their static arguments and yields the rest;
        the step's own calls inside it (a plan tracing, a call compiling) take the arguments as they are, as do calls
        with arguments already ``passed_on`` (the last call's, ``_last_args``: the binding stays)."""
        depth = getattr(self._calls, "depth", 0)
        if depth == 0 and not passed_on:
            args = self._bind_static(tuple(args))
        self._calls.depth = depth + 1
        try:
            yield tuple(args)
        finally:
            self._calls.depth = depth

    # ----- tracing and planning ----------------------------------------------------------
    @property
    def pipelined(self) -> bool:
        return self.microbatches is not None

    @_static_entry()
    def trace(self, *args: Any) -> OpGraph:
        """The op graph of ``fn(*args)`` (traced once per argument shapes and dtypes).

        A pipelined step is traced on one micro-batch, cut into layers (``auto_layers``).
        """
        key = (args_signature(args), self._static_key())
        self._last_args = jax.tree_util.tree_map(leaf_aval, args)
        with self._cache_lock:
            graph, split = self._graphs.get(key), self._splits.get(key)
        if graph is None:
            try:
                if self.pipelined:
                    graph, split = trace_microbatched(
                        self.fn, args, self.microbatches, self.layers or DEFAULT_LAYERS, remat=self.remat,
                        layers_asked=self.layers is not None, batch_argnums=self._batch_argnums(args), soft_batch=self._alpa_batch,
                        inference=self.schedule == INFERENCE,
                    )
                else:  # as jax.jit types them (Python scalars too); one mesh: no stages
                    graph = trace(self.fn, *self._last_args, cut=False, batch_leaves=self._named_batch_leaves(args))
            except LostUpdatesError:  # written for nnx.jit: trace it returning the objects' new state, and hand that back
                if self.hands_back_nnx:
                    raise
                self.hands_back_nnx = True
                return self.trace(*args)
            except TraceError as err:
                hint = static_hint(err.__cause__, args)
                if hint:
                    raise TraceError(f"{err}{hint}") from err.__cause__
                raise
        with self._cache_lock:
            _keep(self._graphs, key, graph)
            if split is not None:
                self._splits[key] = split
            for old in [k for k in self._splits if k not in self._graphs]:
                del self._splits[old]
        return graph

    def _named_batch_leaves(self, args: tuple) -> tuple[bool, ...] | None:
        """The flat leaves ``batch_argnums`` (or Alpa's default) names as the batch, never state (``trace``'s
        ``batch_leaves``); None where none are named, or where what is named cannot be a batch (``_batch_vars``
        says why, once traced)."""
        batch_argnums = self._batch_argnums(args)
        if batch_argnums is None:
            return None
        try:
            return named_batch(args, batch_argnums, soft=self._alpa_batch)
        except ValueError:
            return None

    def _batch_vars(self, args: tuple) -> frozenset[int] | None:
        """The traced program's arguments that ``batch_argnums`` names (None: none named): a single-mesh plan's
        data-parallel methods split these."""
        batch_argnums = self._batch_argnums(args)
        if batch_argnums is None:
            return None
        graph = self.trace(*args)
        named = named_leaves(args, batch_argnums)
        _refuse_named_state(self.fn, args, batch_argnums, named, graph, inference=self.schedule == INFERENCE)
        return _cut_vars(graph, named_batch(args, batch_argnums, soft=self._alpa_batch))

    def _batch_argnums(self, args: tuple) -> tuple[int, ...] | None:
        """The batch arguments of a call with ``args``: those named, or with an Alpa method object and no
        ``batch_argnums`` Alpa's default ``(1,)`` (``train_step(state, batch)``) where the call has a second
        argument (read softly: ``named_batch``); None: found from the shapes (``trace_microbatched``). Positions
        count the user's arguments; ``args`` are those passed on after the static ones (``StaticArgs``)."""
        if self._alpa_batch:
            pos = self._passed_position(1, len(args))
            has_batch = pos is not None and pos < len(args) and any(np.ndim(x) >= 1 for x in jax.tree_util.tree_leaves(args[pos]))
            return (pos,) if has_batch else None
        if self.batch_argnums is None or self._static is None:
            return self.batch_argnums
        passed = tuple(p for p in (self._passed_position(n, len(args)) for n in self.batch_argnums) if p is not None)
        return passed or None

    def _passed_position(self, n: int, num_passed: int) -> int | None:
        """Where the user's argument ``n`` (negative: from the end) is among those passed on; None: a static one."""
        static = () if self._static is None else self._static.positions
        if n < 0:
            n += num_passed + len(static)
        return None if n in static else n - sum(1 for p in static if p < n)

    def _named_split(self, args: tuple, graph: OpGraph, split: tuple[bool, ...]) -> frozenset[int] | None:
        """A pipelined step's cut arguments as the program's vars where ``batch_argnums`` named them (None: the rule's,
        which the data-parallel methods find per piece)."""
        return None if self._batch_argnums(args) is None else _cut_vars(graph, split)

    def _split(self, *args: Any) -> tuple[bool, ...]:
        """Which flat arguments a pipelined step cuts into micro-batches (found when tracing)."""
        key = (args_signature(args), self._static_key())
        while True:  # traced again if another thread's trace evicted these shapes meanwhile
            self.trace(*args)
            with self._cache_lock:
                if key in self._splits:
                    return self._splits[key]

    def _plan_pipeline(self, args: tuple, pins: Mapping[str, str] | None, progress: Callable[[str], None] | None) -> PipelinePlan:
        results = [k for k in pins or {} if k.startswith(OUTPUT_PIN)]
        if results:  # each stage returns its own results: there is no one program output to lay out
            raise PinError(f"{results[0]!r}: a pipeline's results cannot be pinned to a layout (that is a single-mesh "
                           "plan's pin); pin the op that makes it in its stage", tuple(results))
        t0 = time.perf_counter()
        graph = self.trace(*args)
        split = self._split(*args)
        if isinstance(self.stage_option, _FollowedStages):  # the source's weights where the source holds them
            followed = self._follow(args, pipeline=True)[2]
            pins = {**followed, **(pins or {})} or None
        traced = time.perf_counter() - t0
        problem, stages, timeline = plan_pipeline(
            graph,
            self.cluster,
            num_microbatches=self.microbatches,
            schedule=self.schedule,
            method=self.method,
            max_stages=self.max_stages,
            problem=self._problems.get(graph.fingerprint),
            progress=progress,
            stage_timer=self._stage_timer(split),
            submesh_space=self.submesh_space,
            batch_vars=self._named_split(args, graph, split),
            split_vars=_cut_vars(graph, split),
            logical_meshes=self.logical_meshes,
            fixed=None if self.stage_option is None else self.stage_option.assign,
            batch_mesh_axis=self.batch_mesh_axis,
            stage_axes=getattr(self.stage_option, "batch_axes", None),
            forbidden=self.forbidden_collectives,
            weight_update_sharding=self.weight_update_sharding,
        )
        with self._cache_lock:
            _keep(self._problems, graph.fingerprint, problem)
        plan = PipelinePlan(
            fingerprint=graph.fingerprint,
            method=self.method,
            cluster=self.cluster.to_dict(),
            num_microbatches=self.microbatches,
            schedule=self.schedule,
            num_layers=problem.slicing.num_layers,
            stages=stages,
            timeline=timeline,
            split_inputs=tuple(p for p, s in zip(graph.in_paths, split) if s),
            planning_seconds={"trace": traced, **problem.seconds},
            problem=problem,
            max_stages=self.max_stages,
            submesh_space=self.submesh_space,
            stage_pins=self.stage_option is not None,
        )
        if self.stage_input_shardings is not None:
            pins = {**_stage_input_pins(plan, self.stage_input_shardings), **(pins or {})}
        if self.manual_sharding is not None:  # each stage holds the arguments it reads as the resources say
            read = [[t.path for t in st.plan.inputs] for st in plan.stages]
            manual = self.manual_sharding.stage_pins(
                graph.in_paths, [graph.vars[v].shape for v in graph.invars], args,
                [(tuple(st.plan.mesh_shape), paths) for st, paths in zip(plan.stages, read)])
            pins = {**manual, **(pins or {})}
        if pins:
            plan = plan._replan(plan._current_stages(), pins, plan.stage_pins)
        if isinstance(self.stage_option, _FollowedStages):
            self.stage_option.check(plan)
        return plan

    def _stage_timer(self, split: tuple[bool, ...]) -> Any:
        """The profiling cost model's stage timer (``cost_model="profile"``), or None for the analytic model."""
        if self.cost_model != "profile":
            return None
        from alpa_lab.runtime.stage_profile import stage_timer

        return stage_timer(split)

    @_static_entry()
    def plan(self, *args: Any, pins: Mapping[str, str] | None = None, progress: Callable[[str], None] | None = None) -> Plan:
        """Trace with ``args`` (arrays or ShapeDtypeStructs) and plan; the plan becomes current. A step made with
        ``method=plan_to_method(plan)`` uses that plan instead (with ``pins`` it plans anew, on the plan's cluster
        and options)."""
        if isinstance(self.parallel_method, PlanMethod) and not pins:
            return self.use(self.parallel_method.plan, *args)
        if progress:
            t0 = time.perf_counter()
            progress("tracing the step")
            graph = self.trace(*args)
            progress(f"traced {len(graph.ops)} ops ({time.perf_counter() - t0:.1f}s)")
        if self.pipelined:
            plan = self._plan_pipeline(args, pins, progress)
        else:
            cluster, mesh_shape, followed = self.cluster, self.mesh_shape, {}
            if isinstance(self.parallel_method, FollowParallel):
                cluster, mesh_shape, followed = self._follow(args)
            if self.manual_sharding is not None:  # its axis names are of one mesh: Alpa's, the cluster's hosts x devices
                mesh_shape = mesh_shape or (cluster.hosts, cluster.devices_per_host)
                followed = self._manual_pins(args, mesh_shape)
            plan = plan_graph(
                self.trace(*args),
                cluster,
                mesh_shape=mesh_shape,
                method=self.method,
                memory_budget=self.memory_budget,
                pins={**followed, **(pins or {})} or None,
                progress=progress,
                batch_vars=self._batch_vars(args),
                batch_mesh_axis=self.batch_mesh_axis,
                forbidden=self.forbidden_collectives,
                weight_update_sharding=self.weight_update_sharding,
            )
        if not pins:
            with self._cache_lock:
                _keep(self._own_plans, plan.fingerprint, plan, OWN_PLANS_KEPT)
        self.current_plan = plan
        return plan

    def _manual_pins(self, args: tuple, mesh_shape: tuple[int, int]) -> dict[str, str]:
        """``ManualShardingOption``'s resources as pins of this program's arguments and results."""
        graph = self.trace(*args)
        results = jax.tree_util.tree_unflatten(graph.out_tree, [0] * len(graph.outvars))
        outs = list(zip(graph.out_paths, graph.outvars))
        if self.hands_back_nnx:  # traced as (the NNX objects' new state, the step's result): the user's results only
            results = results[-1]
            outs = outs[len(outs) - len(jax.tree_util.tree_leaves(results)):]
        return self.manual_sharding.pins(
            graph.in_paths, [graph.vars[v].shape for v in graph.invars], args,
            [p for p, _ in outs], [graph.vars[v].shape for _, v in outs], results, mesh_shape)

    def _follow(self, args: tuple, pipeline: bool = False) -> tuple[ClusterSpec, tuple[int, int] | None, dict[str, str]]:
        """``FollowParallel``: the source's cluster and mesh, and a pin per argument leaf holding it as the
        source's plan holds the matching leaf (where that spec fits the leaf's shape; otherwise it is planned).
        ``pipeline``: the source is pipelined and this step its inference pipeline (``_follow_pipeline``): each
        weight gets the layout of the source's first stage reading it (the batch, cut into micro-batches, is
        planned), and the mesh is None (each stage has its own)."""
        method = self.parallel_method
        source = method.src_func
        if not isinstance(source, ParallelizedStep):
            raise MethodOptionError(f"FollowParallel(src_func): src_func must be a parallelized step, got {type(source).__name__}")
        if source.current_plan is None or getattr(source, "_last_args", None) is None:
            raise MethodOptionError("FollowParallel: the step it follows was never run or planned: call it (or "
                                    "step.plan(state, batch)) first")
        src_plan = source.current_plan
        if isinstance(src_plan, PipelinePlan) != pipeline:
            raise MethodOptionError(
                f"FollowParallel: the step followed was {'not ' if pipeline else ''}pipelined when this step was made, and "
                f"{'is not' if pipeline else 'is'} now: parallelize this step again with FollowParallel")
        if method.get_input_placement_specs is not None:
            candidates = [method.get_input_placement_specs()]
        else:  # Alpa's default: the source's (state.params, batch); a step taking (state, batch) follows the whole state
            followed = src_plan.placement_specs(*source._last_args)[0]
            if not isinstance(followed, (tuple, list)) or len(followed) != 2:
                raise MethodOptionError(
                    "FollowParallel without get_input_placement_specs follows (state.params, batch) or (state, batch) of a "
                    "step taking (state, batch); pass get_input_placement_specs=lambda: ... for others")
            candidates = ([(followed[0].params, followed[1])] if hasattr(followed[0], "params") else []) + [tuple(followed)]
        leaves = jax.tree_util.tree_leaves(args)
        is_spec = lambda x: x is None or hasattr(x, "mesh_ids")  # noqa: E731 - a PlacementSpec, or None: planned freely
        for i, specs in enumerate(candidates):
            specs = tuple(specs) if isinstance(specs, list) else specs
            try:  # a None stands for its whole subtree
                per_subtree = jax.tree_util.tree_map(lambda spec, sub: _Group([spec] * len(jax.tree_util.tree_leaves(sub))), specs,
                                                     tuple(args), is_leaf=is_spec)
                break
            except (ValueError, TypeError) as exc:
                if i + 1 < len(candidates):
                    continue
                given = jax.tree_util.tree_structure(specs, is_leaf=is_spec)
                raise MethodOptionError(
                    f"FollowParallel: the placements followed ({given.num_leaves} leaves) do not have the structure of this "
                    f"step's arguments ({len(leaves)} leaves); by default they are (state.params, batch) or (state, batch) "
                    f"of the step followed: {str(exc).splitlines()[0]}") from exc
        spec_leaves = [s for group in jax.tree_util.tree_leaves(per_subtree) for s in group]
        graph = self.trace(*args)
        cut = self._split(*args) if pipeline else (False,) * len(leaves)
        pins = {}
        for name, x, spec, is_cut in zip((graph.vars[v].name for v in graph.invars), leaves, spec_leaves, cut):
            if spec is None or is_cut:
                continue
            text = spec.sharding_specs[0]
            if pipeline:  # a weight: as the source's first stage reading it holds it
                if tuple(spec.aval.shape) == tuple(np.shape(x)):
                    pins[name] = text
            elif tuple(spec.aval.shape) == tuple(np.shape(x)) or ShardingSpec.parse(text).is_valid_for(np.shape(x), src_plan.mesh_shape):
                pins[name] = text  # another size (an evaluation batch) keeps the layout where it fits
        self._followed = src_plan
        return source.cluster, None if pipeline else src_plan.mesh_shape, pins

    def _refollow(self) -> None:
        """``FollowParallel``: forget the step's own plans once the source's plan changed (re-planned on the next call)."""
        if isinstance(self.parallel_method, FollowParallel) and getattr(self, "_followed", None) is not None:
            if self.parallel_method.src_func.current_plan is not self._followed:
                self._forget_own_plans()
                self._followed = None

    @_static_entry(skip=1)
    def use(self, plan: Plan | PipelinePlan, *args: Any) -> Plan | PipelinePlan:
        """Make ``plan`` current (e.g. an edited or loaded one) after checking it fits.

        A plan loaded from JSON gets the planner state back, so it can be edited again.
        With ``args`` the plan is checked against their program now; otherwise at the next call.
        Returns the plan made current (for a loaded plan: the one with its planner state,
        which is the one to edit). On any error the previous plan stays current.
        """
        if not isinstance(plan, (Plan, PipelinePlan)):
            raise TypeError(
                f"use() takes a Plan or a PipelinePlan (al.Plan.load(path) reads a saved one), got {type(plan).__name__}"
            )
        if isinstance(plan, Plan) and self.pipelined:
            raise PlanFormatError(
                f"this step is pipelined (microbatches={self.microbatches}), so it runs pipeline plans; a single-mesh plan "
                "runs on a step made without microbatches: parallelize(fn, cluster=...)"
            )
        if isinstance(plan, PipelinePlan):
            if not self.pipelined:
                raise PlanFormatError(
                    "this step is not pipelined, so it cannot run a pipeline plan: make it with "
                    f"parallelize(fn, cluster=..., microbatches={plan.num_microbatches})"
                )
            if plan.num_microbatches != self.microbatches:
                raise PlanFormatError(
                    f"this pipeline plan cuts the batch into {plan.num_microbatches} micro-batches but the step into "
                    f"{self.microbatches}: make the step with microbatches={plan.num_microbatches}, or re-plan"
                )
            if args:
                graph = self.trace(*args)
                plan.check_program(graph)
                if plan.problem is None:  # loaded: attach the planner state of this program
                    split = tuple(p for p, s in zip(graph.in_paths, self._split(*args)) if s)
                    if split != tuple(plan.split_inputs):
                        raise PlanFormatError(
                            f"this pipeline plan cuts {list(plan.split_inputs)} into micro-batches but the step cuts "
                            f"{list(split)}: make the step with the plan's batch (parallelize(..., batch_argnums=...) "
                            "names it), or re-plan with step.plan(...)"
                        )
                    problem = self._problems.get(graph.fingerprint)
                    forbidden = plan.stages[0].plan.forbidden_collectives  # every stage's mesh had them
                    if problem is None or problem.cluster.to_dict() != dict(plan.cluster) or problem.forbidden != forbidden:
                        cut = self._split(*args)
                        problem = PipelineProblem.build(
                            graph, ClusterSpec(**plan.cluster), inference=plan.schedule == INFERENCE, batch=_cut_vars(graph, cut))
                        problem.batch_vars = self._named_split(args, graph, cut)
                        problem.forbidden = forbidden
                        if dict(plan.cluster) == self.cluster.to_dict():
                            with self._cache_lock:
                                _keep(self._problems, graph.fingerprint, problem)
                    plan = plan.attach(problem)
            self.current_plan = plan
            return plan
        if args:
            graph = self.trace(*args)
            plan.check_program(graph)
            if plan.problem is None:
                mesh = dataclasses.replace(self.cluster.logical_mesh(plan.mesh_shape, plan.device_ids),
                                           forbidden=plan.forbidden_collectives)
                sg = build_strategy_graph(graph, mesh, tie_period=int(plan.solver.get("tie_period", 1)))
                if plan.batch_inputs is not None:  # the batch the plan was made with (batch_argnums), for its re-solves
                    batch = frozenset(v for p, v in zip(graph.in_paths, graph.invars) if p in plan.batch_inputs)
                else:
                    batch = self._batch_vars(args)
                plan = dataclasses.replace(plan, problem=dataclasses.replace(
                    sg, batch_vars=batch, batch_mesh_axis=plan.batch_mesh_axis, weight_update_sharding=plan.weight_update_sharding))
        self.current_plan = plan
        return plan

    def pin(self, op: str, strategy: str) -> Plan:
        """Pin on the current plan; the re-solved plan becomes current only if it succeeds."""
        plan = self._require_plan().pin(op, strategy)
        self.current_plan = plan
        return plan

    def _require_plan(self) -> Plan:
        if self.current_plan is None:
            raise ValueError("this step has no plan yet: call step.plan(*example_args) or run it once")
        return self.current_plan

    # ----- running ---------------------------------------------------------------------
    @_static_entry()
    def compiled(self, *args: Any) -> CompiledPlan | CompiledPipeline:
        """The current plan compiled for ``args`` (planned first if there is no plan yet)."""
        graph = self.trace(*args)
        if self.current_plan is None:
            self.plan(*args)
        plan = self._require_plan()
        if isinstance(plan, PipelinePlan):
            if plan.problem is None:  # loaded and made current without arguments: attach it now
                plan = self.use(plan, *args)
            plan.check_program(graph)  # other shapes are another program: say so, run nothing
            compiled = self._compiled_for(plan)
            if compiled is None:
                sched = stage_schedule(plan._current_stages(), plan.schedule, plan.num_microbatches)
                with self._cache_lock:
                    old = self._compiled[-1][1] if self._compiled else None
                if (
                    isinstance(old, CompiledPipeline)
                    and old.schedule.split_backward == sched.split_backward
                    and [st.plan for st in old.stages] == [st.plan for st in plan.stages]
                    and [st.device_ids for st in old.stages] == [st.device_ids for st in plan.stages]
                ):
                    compiled = dataclasses.replace(old, schedule=sched, stages=plan.stages, plan=plan)  # same tasks
                else:
                    pieces = [plan.problem.piece(st.layers) for st in plan.stages]
                    compiled = compile_pipeline(graph, plan.problem.slicing, plan.stages, sched, self._split(*args), pieces=pieces)
                    compiled.plan = plan
                self._keep_compiled(plan, compiled)
            return compiled
        plan.check_program(graph)  # other shapes are another program: say so, run nothing
        compiled = self._compiled_for(plan)
        if compiled is None:
            compiled = self._keep_compiled(plan, compile_plan(graph, plan))
        return compiled

    def _compiled_for(self, plan: Plan | PipelinePlan) -> CompiledPlan | CompiledPipeline | None:
        """``plan``'s compiled program if the step still keeps it (then it becomes the most recent)."""
        with self._cache_lock:
            for i, (p, compiled) in enumerate(self._compiled):
                if p is plan:
                    self._compiled.append(self._compiled.pop(i))
                    return compiled
        return None

    def _keep_compiled(self, plan: Plan | PipelinePlan, compiled: Any) -> Any:
        with self._cache_lock:
            self._compiled[:] = [(p, c) for p, c in self._compiled if p is not plan] + [(plan, compiled)]
            del self._compiled[:-TRACES_KEPT]
        return compiled

    def on_ray(self, cluster: Any | None, **launch_options: Any) -> ParallelizedStep:
        """Make calls of this step run on ``cluster``'s mesh workers (None: back in this process).

        ``step(state, batch)`` then launches the current plan with ``state`` (again when the
        plan changes or a state other than the last one returned is passed), runs one step
        there and returns the new state fetched to the driver, as the in-process step does.
        """
        if self.ray_run is not None:
            self.ray_run.close()
        self.ray_run = None
        self.ray_cluster = cluster
        self._ray_chosen = True  # the session's cluster (``init``) no longer applies to this step
        self._ray_options = dict(launch_options)
        return self

    _ray_cluster: Any = None
    ray_run: Any = None
    _ray_state: Any = None
    _ray_chosen = False
    _ray_options: dict = {}

    def _call_on_ray(self, args: tuple) -> Any:
        state, rest = args[0], args[1:]
        if self.ray_cluster._closed:
            from alpa_lab.runtime.ray_run import LaunchError

            raise LaunchError(
                f"the Ray cluster step {self.__name__!r} runs on was shut down (alpa_lab.shutdown() or RayCluster.shutdown()): "
                "start one (alpa_lab.init('ray')) and parallelize the step again, or step.on_ray(None) to run it in this process"
            )
        if self.current_plan is None:  # the first call plans, as in this process
            self.plan(*args)
        self._refuse_nnx_run("a step on Ray mesh workers")
        run = self.ray_run
        if run is None or run.closed or run.plan is not self.current_plan or state is not self._ray_state:
            if run is not None:
                run.close()
            options = {"keep_state_every": 1, **self._ray_options}  # the step returns the state: keep it every step
            self.ray_run = run = self.launch(self.ray_cluster, state, *rest, **options)
        out = run.step(*rest)
        self._ray_state = run.last_state if run.last_state_step == run.steps_done else run.state()
        if self.trace(*args).returns_state_alone:
            return self._ray_state
        others = out if isinstance(out, tuple) and len(out) != 1 else (out,)
        return (self._ray_state, *others)

    def _own_plan_for(self, args: tuple, *, plan_new: bool) -> OpGraph | None:
        """If the current plan is one the step made itself (unedited) and ``args`` have other shapes, make the
        step's own plan for those shapes current: the one it keeps, or (``plan_new``) a new one, as ``jax.jit``
        traces again. A plan the user edited, pinned or loaded stays. Returns ``args``' graph if traced."""
        plan = self.current_plan
        if plan is None or self._own_plans.get(plan.fingerprint) is not plan:
            return None
        graph = self.trace(*args)
        if graph.fingerprint != plan.fingerprint:
            with self._cache_lock:
                kept = self._own_plans.get(graph.fingerprint)
                if kept is not None:
                    _keep(self._own_plans, graph.fingerprint, kept, OWN_PLANS_KEPT)  # used: the last to go
            if kept is not None:
                self.current_plan = kept
            elif plan_new:
                self.current_plan = self.plan(*args)
        return graph

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if kwargs:  # as jax.jit takes them: by the step's signature, then as if passed in place
            args = self._positional(args, kwargs)
        return self._call(*args)

    @_static_entry()
    def _call(self, *args: Any) -> Any:
        self.cluster  # noqa: B018 - settles the cluster (and the session's Ray, if any) before the first call
        self._refollow()
        # the step's own plan, made for other shapes (the last, smaller batch of an epoch): plan these too, as
        # jax.jit traces again (only a call plans anew: a launch or a run takes a kept plan for its shapes, or fails)
        graph = self._own_plan_for(args, plan_new=True)
        if self.ray_cluster is not None:
            t0 = time.perf_counter()
            out = self._call_on_ray(args)  # the run's step waits for the workers: the results are here
            self._call_costs(self.current_plan).append(time.perf_counter() - t0)
            return out
        return self._run(self.compiled(*args), graph if graph is not None else self.trace(*args), args)

    def _positional(self, args: tuple, kwargs: dict) -> tuple:
        """A call's arguments in the step's positional order: keywords moved to their places, and the defaults of
        any skipped before them filled in (a flag given by name, ``step(state, batch, deterministic=False)``, is then
        the argument it names, static by the "auto" rule as a bool is)."""
        import inspect

        try:
            sig = inspect.signature(self.user_fn)
            bound = sig.bind(*args, **kwargs)
        except (TypeError, ValueError) as e:
            raise TypeError(f"{getattr(self.user_fn, '__name__', 'the step')}: {e}") from None
        bound.apply_defaults()
        named = set(kwargs)
        out = []
        for p in sig.parameters.values():
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
                out.append(bound.arguments[p.name])
            elif p.kind is p.VAR_POSITIONAL:
                out.extend(bound.arguments.get(p.name, ()))
            elif p.name in named:
                raise TypeError(
                    f"{getattr(self.user_fn, '__name__', 'the step')} takes {p.name!r} by keyword only; a parallelized "
                    f"step passes its arguments by position: make {p.name!r} a positional parameter, or bind it with "
                    "functools.partial before parallelizing")
        # the parameters after the last one given keep their defaults, as a call without them would
        last = max((i for i, p in enumerate(sig.parameters.values()) if p.name in named), default=len(args) - 1)
        return tuple(out[: max(last + 1, len(args))])

    def _run(self, compiled: CompiledPlan | CompiledPipeline, graph: OpGraph, args: tuple) -> Any:
        """Call a compiled plan in this process, timed as a call of its plan (``get_execution_time_costs``)."""
        t0 = time.perf_counter()
        out = call_compiled(compiled, graph, args)
        _TIMER.record(self._call_costs(compiled.plan), t0, out)
        return write_back_nnx(args, out) if self.hands_back_nnx else out

    def _call_costs(self, plan: Any) -> Any:
        """The seconds of ``plan``'s calls (the last ``CALL_COSTS_KEPT``); a step keeps them for its last few plans."""
        from collections import deque

        with self._cache_lock:
            entry = self._costs.get(id(plan))
            if entry is None or entry[0] is not plan:  # the plan holds its id while kept here
                entry = _keep(self._costs, id(plan), (plan, deque(maxlen=CALL_COSTS_KEPT)))
            return entry[1]

    def last_args(self, state: Any) -> tuple:
        """``state`` and the other arguments (shapes only) the step was last traced with."""
        if getattr(self, "_last_args", None) is None:
            raise ValueError("this step was never traced: call step.plan(state, batch) first, or pass the batch")
        return (state, *self._last_args[1:])

    def launch(
        self, cluster: Any = None, state: Any = None, *example: Any, backend: str = "ray", address: str | None = None,
        keep_state_every: int | None = None, step_timeout: float | None = None,
    ) -> Any:
        """Run a plan on a Ray cluster's mesh workers; returns the ``RayRun``.

        ``step.launch(ray_cluster, state)`` runs the current plan on ``ray_cluster`` (a ``RayCluster``).
        ``step.launch(plan, state)`` makes ``plan`` current first (``use``), then runs it on the step's
        Ray cluster (``on_ray``), else on the one at ``address`` (``RayCluster.connect``: "auto" joins
        the running one), else on a local Ray of the plan's shape started for this run and stopped
        when the run closes. ``backend`` is "ray", the only one off this process (in it: call the step,
        or ``train``).

        The state goes to the workers once and stays there; ``run.step(batch)`` trains,
        ``run.state()`` fetches the state. ``example``: the step's other arguments (shapes only) if
        the plan was not made with them. The driver keeps a copy every ``keep_state_every`` steps
        (``run.last_state``), to launch again from if a worker dies; by default every step for
        states up to 256 MiB, every 100 steps for bigger ones. ``step_timeout``: seconds a step (and a
        fetch of the state) may take before the run is closed with a ``MeshWorkerError`` naming the
        workers still busy; the first step, which compiles the programs on the workers, is not timed.
        """
        self._refuse_static_run("step.launch")
        self._refuse_nnx_run("step.launch")
        with self._serving((), passed_on=True):  # the run's (state, example) are the program's arguments, all of them
            run = self._launch(cluster, state, *example, backend=backend, address=address,
                               keep_state_every=keep_state_every, step_timeout=step_timeout)
        _RUNS.add(run)  # alpa_lab.shutdown() closes it if it runs on the session's cluster
        return run

    def _launch(
        self, cluster: Any, state: Any, *example: Any, backend: str, address: str | None, keep_state_every: int | None,
        step_timeout: float | None,
    ) -> Any:
        """``launch`` without registering the run."""
        from alpa_lab.runtime.ray_cluster import RayCluster
        from alpa_lab.runtime.ray_run import LaunchError, launch

        if backend != "ray":
            raise ValueError(
                f"backend must be 'ray' (mesh workers on a Ray cluster), got {backend!r}; to run in this process, "
                "call the step (step(state, batch)) or step.train(state, batches)"
            )
        if state is None:
            raise LaunchError(
                "launch needs the training state to put on the mesh workers: step.launch(ray_cluster, state) "
                "or step.launch(plan, state)"
            )
        options = {"keep_state_every": keep_state_every, "step_timeout": step_timeout}
        if isinstance(cluster, RayCluster):
            if address is not None:
                raise ValueError("give a RayCluster or an address to launch on, not both")
            if example:  # the step's own plan for these shapes, if it keeps one (the full batch after a smaller one)
                self._own_plan_for((state, *example), plan_new=False)
            return launch(self, cluster, state, *example, **options)
        if cluster is not None and not isinstance(cluster, (Plan, PipelinePlan)):
            raise TypeError(
                f"launch takes a RayCluster or a plan (Plan, PipelinePlan) first, got {type(cluster).__name__}: "
                "step.launch(RayCluster.local(2, 4), state) or step.launch(plan, state)"
            )
        if address is None and self.ray_cluster is not None and self.ray_cluster._closed:
            raise LaunchError(
                "the step's Ray cluster (on_ray) was shut down; start one with RayCluster.local(...) and call "
                "step.on_ray(cluster), or step.on_ray(None) to launch on a Ray started for the run"
            )
        previous = self.current_plan
        if cluster is not None:
            self.use(cluster)
        elif example:  # the step's own plan for these shapes, if it keeps one (the full batch after a smaller one)
            self._own_plan_for((state, *example), plan_new=False)
        plan = self.current_plan
        if plan is None:
            raise LaunchError("the step has no plan yet: call step.plan(state, batch) first, or launch a plan")
        owned = None
        try:
            if address is not None:
                target = RayCluster.connect(address)
            elif self.ray_cluster is not None:
                target = self.ray_cluster
            else:
                shape = (plan.cluster.get("hosts"), plan.cluster.get("devices_per_host"))
                owned = target = RayCluster.local(*shape, platform="cpu" if plan.cluster.get("simulated", True) else "gpu")
            run = launch(self, target, state, *example, **options)
        except BaseException:  # nothing launched: the plan that was current stays, a Ray started here stops
            if owned is not None:
                owned.shutdown()
            self.current_plan = previous
            raise
        run.owns_cluster = owned is not None
        return run

    def train(self, state: Any, batches: Any, *, steps: int = 100, **options: Any) -> Any:
        """Train the current plan for ``steps`` steps in a background thread; returns the ``TrainingRun``.

        On the step's Ray cluster (``on_ray``) when it has one, else in this process. ``batches``:
        one batch, a list of them (cycled), an iterator, or a function of the step index.
        ``run.stop()``, ``run.wait()``, ``run.state``, ``run.profile()``.
        """
        from alpa_lab.runtime.training import TrainingRun

        self._refuse_static_run("a training run")  # before its first batch is traced (the run checks it too)
        self._refuse_nnx_run("a training run")
        if self.current_plan is None:
            raise ValueError("this step has no plan yet: call step.plan(state, batch) first")
        if getattr(self.current_plan, "schedule", None) == INFERENCE:
            raise ValueError("this step is an inference pipeline (a step without gradients): it has no state to train; "
                             "call it, step(params, batch), for its results")
        if isinstance(batches, (list, tuple, Mapping)) or hasattr(batches, "shape"):  # its first batch, unconsumed
            from alpa_lab.runtime.training import batch_stream

            num_args = len(getattr(self, "_last_args", None) or (None, None)) - 1
            self._own_plan_for((state, *batch_stream(batches, max(num_args, 1))(0)), plan_new=False)
        run = TrainingRun(self, state, batches, steps=steps, **options)
        _RUNS.add(run)  # alpa_lab.shutdown() stops it if it runs on the session's cluster
        return run

    @_static_entry(skip=1)
    def recalibrate(self, profile: Any, *args: Any) -> Plan | PipelinePlan:
        """Plan again, from scratch, with the costs ``profile`` measured (``run.profile()``); the plan becomes current.

        The step's cluster becomes ``profile.cluster()``. A pipeline plan is re-solved by
        ``PipelinePlan.recalibrated`` (its ``max_stages``, stage pins and cost model kept); a
        single-mesh plan is planned again with the last arguments (or ``args``) over the same
        mesh shapes, with its own method, memory budget and pins. On an error nothing changes.
        """
        plan = self._require_plan()
        if isinstance(plan, PipelinePlan):
            new = plan.recalibrated(profile)
            self.cluster = ClusterSpec(**new.cluster)
            with self._cache_lock:
                _keep(self._problems, new.fingerprint, new.problem)
            self.current_plan = new
            return new
        from alpa_lab.cost.profile import ProfileError

        have = (self.cluster.hosts, self.cluster.devices_per_host)
        if (profile.cluster_spec["hosts"], profile.cluster_spec["devices_per_host"]) != have:
            raise ProfileError(f"the profile was measured for another cluster shape than this step's {have[0]}x{have[1]}")
        if not args and getattr(self, "_last_args", None) is None:
            raise ValueError("this step was never traced: pass its arguments, step.recalibrate(profile, state, batch)")
        cluster = profile.cluster()
        graph = self.trace(*(args or tuple(self._last_args)))
        new = plan_graph(  # manual shardings name the axes of the plan's mesh: that one
            graph, cluster, mesh_shape=tuple(plan.mesh_shape) if self.manual_sharding is not None else self.mesh_shape,
            method=plan.method, memory_budget=plan.memory_budget,
            pins=dict(plan.pins) or None, batch_vars=self._batch_vars(args or tuple(self._last_args)),
            batch_mesh_axis=plan.batch_mesh_axis, forbidden=plan.forbidden_collectives,
            weight_update_sharding=plan.weight_update_sharding,
        )
        self.cluster = cluster  # only once planned: a failed re-plan leaves the step as it was
        self.current_plan = new
        return new

    @_static_entry()
    def compiled_hlo(self, *args: Any) -> str:
        """XLA's optimised HLO of the current plan (what XLA really runs); a pipeline's: every unit task's, each
        under a ``// stage s phase`` line."""
        return self.compiled(*args).lower_text(*jax.tree_util.tree_leaves(args))

    @_static_entry()
    def get_executable(self, *args: Any) -> Executable:
        """Alpa's name: the current plan compiled for ``args``, whose ``get_hlo_text()`` is XLA's HLO."""
        self._refollow()
        self._own_plan_for(args, plan_new=True)
        leaves, tree = jax.tree_util.tree_flatten(args)
        return Executable(self.compiled(*args), tuple(leaves), self, tree)

    @_static_entry()
    def preshard_dynamic_args(self, *args: Any) -> tuple:
        """Alpa's name: ``args`` placed on the devices as the current single-mesh plan takes them."""
        return self.get_executable(*args).preshard_dynamic_args(*args)

    def get_last_executable(self) -> Executable:
        """Alpa's name: ``get_executable`` for the arguments of the last call or plan."""
        if getattr(self, "_last_args", None) is None:
            raise ValueError("nothing was planned or run yet: call the step (or step.plan(...)) first, or use get_executable(*args)")
        with self._serving(self._last_args, passed_on=True) as args:
            return self.get_executable(*args)


@dataclasses.dataclass(frozen=True, eq=False)
class Executable:
    """A compiled plan as Alpa's tests look at it: ``get_hlo_text()`` is XLA's optimised HLO (a single mesh's
    program; a pipeline's unit tasks, one text each, in (stage, phase) order)."""

    compiled: CompiledPlan | CompiledPipeline
    flat_args: tuple
    step: Any = None
    in_tree: Any = None
    """the arguments' tree (``get_executable`` keeps it): ``get_input_placement_specs`` takes its structure"""

    def get_execution_time_costs(self, warmup: int = 0, timer_name: str | None = None, return_all_costs: bool = False) -> list[float]:
        """Seconds of each call of the step with this plan, oldest first, less the first ``warmup`` (Alpa's
        name): from dispatch to results ready (``sync()`` first to include calls still running). Alpa's other
        timers (``timer_name``) and per-mesh costs (``return_all_costs``) are not kept: the run dashboard and
        ``run.profile()`` have the per-stage figures."""
        if timer_name not in (None, "overall") or return_all_costs:
            raise ValueError(
                "only the whole call is timed (timer_name='overall'); per stage and phase, train with step.train(...) "
                "and read run.profile() or the dashboard")
        if self.step is None:
            return []
        return list(self.step._call_costs(self.plan))[warmup:]

    def profile_with_dummy_inputs(self, warmup: int = 2, repeat: int = 10) -> list[float]:
        """Seconds of each of ``repeat`` runs of this program on dummy arguments (zeros of the compiled shapes and
        dtypes; Alpa's name), after ``warmup`` untimed runs, each waited for: the program's own time, without the
        user's data, the step's other calls' timer (``get_execution_time_costs``) or any write-back. A single mesh's
        arguments are put on its devices first (outside the timing), as Alpa's device buffers are; a pipeline's
        step places its micro-batches itself, so that is in each figure, as it is in every step."""
        if isinstance(warmup, bool) or isinstance(repeat, bool) or not isinstance(warmup, int) or not isinstance(repeat, int) \
                or warmup < 0 or repeat < 1:
            raise ValueError(f"warmup must be a whole number >= 0 and repeat one >= 1, got warmup={warmup!r}, repeat={repeat!r}")
        placed = not isinstance(self.compiled, CompiledPipeline)
        costs = []
        for i in range(warmup + repeat):
            args = [_dummy_like(x) for x in self.flat_args]  # fresh each run: the program may donate them
            if placed:
                args = jax.block_until_ready([jax.device_put(x, sh) for x, sh in zip(args, self.compiled.in_shardings)])
            t0 = time.perf_counter()
            jax.block_until_ready(self.compiled(*args))
            if i >= warmup:
                costs.append(time.perf_counter() - t0)
        return costs

    def sync(self) -> None:
        """Wait until every call dispatched so far has finished (Alpa's name)."""
        _TIMER.sync()

    def __call__(self, *args: Any) -> Any:
        """Run this compiled program on ``args`` (Alpa's fast call: no re-planning, whatever the step's current plan
        now is); ``args`` must have the shapes it was compiled for."""
        if self.step is None:
            raise ValueError("this executable does not know its step: get it with step.get_executable(*args)")
        with self.step._serving(args) as args:
            graph = self.step.trace(*args)
            self.plan.check_program(graph)  # other shapes are another program: say so, run nothing
            return self.step._run(self.compiled, graph, args)

    def preshard_dynamic_args(self, *args: Any) -> Any:
        """``args`` placed on the devices as the single-mesh program takes them (Alpa's name): a call with them
        copies nothing first."""
        if isinstance(self.compiled, CompiledPipeline):
            raise ValueError("a pipeline's arguments are placed per stage and micro-batch each step; pass them as they are")
        if self.step is not None:  # the static arguments (a function, a flag) are not the program's
            with self.step._serving(args) as args:
                return self._preshard(args)
        return self._preshard(args)

    def _preshard(self, args: tuple) -> Any:
        leaves, tree = jax.tree_util.tree_flatten(args)
        if len(leaves) != len(self.compiled.in_shardings):
            raise ValueError(
                f"the program takes {len(self.compiled.in_shardings)} array leaves, got {len(leaves)}: pass the step's arguments")
        placed = [jax.device_put(x, sh) for x, sh in zip(leaves, self.compiled.in_shardings)]
        return jax.tree_util.tree_unflatten(tree, placed)

    def _args(self) -> tuple:
        if self.in_tree is None:
            raise ValueError("this executable does not know its arguments' structure: get it with step.get_executable(*args)")
        return jax.tree_util.tree_unflatten(self.in_tree, list(self.flat_args))

    def get_input_placement_specs(self) -> Any:
        """Where the plan keeps each argument (Alpa's name): a ``PlacementSpec`` per leaf, in the arguments'
        structure (the meshes holding it and its sharding spec on each)."""
        return self.plan.placement_specs(*self._args())[0]

    @property
    def stage_input_shard_specs(self) -> list[list[str]]:
        """Per pipeline stage, the sharding spec of each of its inputs in order (Alpa's name): what
        ``PipeshardParallel(stage_input_shardings=...)`` takes to plan another step (another batch size) with them."""
        if not isinstance(self.plan, PipelinePlan):
            raise ValueError("a single-mesh plan has no stages: its inputs' layouts are get_input_placement_specs()")
        return [[t.spec for t in st.plan.inputs] for st in self.plan.stages]

    def get_output_placement_specs(self) -> Any:
        """Where the plan leaves each result (Alpa's name): a ``PlacementSpec`` per leaf, in the results' structure."""
        if self.step is None:
            raise ValueError("this executable does not know its step: get it with step.get_executable(*args)")
        args = self._args()
        return self.plan.placement_specs(*args, results=jax.eval_shape(self.step.fn, *args))[1]

    def get_hlo_text(self) -> str | list[str]:
        """XLA's optimised HLO: the single-mesh program's text; a pipeline's unit tasks in Alpa's order, the
        forward stages first to last, the backward stages in the order they run (last to first), then each
        stage's update (Alpa's tests index them so: ``texts[0]`` is stage 0's forward, ``texts[-1]`` the last update)."""
        if isinstance(self.compiled, CompiledPipeline):
            return [text for _, text in sorted(self.compiled.task_hlo().items(), key=lambda kv: _alpa_task_order(kv[0]))]
        return self.compiled.lower_text(*self.flat_args)

    def get_stage_execution_info(self) -> list[list[tuple[float, float, tuple[int, ...], tuple[int, ...]]]]:
        """Alpa's name: per unit task of the pipeline, in ``get_hlo_text``'s order (the stages' forwards, their
        backwards last stage first, their updates), the (start, end, hosts, devices) of its runs, in the order they
        started: ``time.time()`` seconds, the hosts and devices of its stage's sub-mesh. A step's update pieces on one
        stage count as one run (its span can hold another stage's pieces), and so do a stage's workers on several hosts.
        Runs in this process: the last calls of this plan holding ``runtime.pipeline.TRACE_RECORDS`` runs, timed from
        dispatch to dispatch unless the pipeline is profiled (``profile``: each run waited for). Runs on Ray's mesh
        workers: the current ``RayRun``'s RUN events of this plan (in the driver's clock; the driver keeps the last
        ``mesh_worker.EVENTS_KEPT`` events of all its workers); a relaunched run starts afresh."""
        if not isinstance(self.compiled, CompiledPipeline):
            raise ValueError("a single-mesh program has no pipeline stages; plan with micro-batches (a pipeline) to time its stages")
        cp = self.compiled
        keys = sorted({k for k, t in cp.tasks.items() if t.invars or t.outvars} | {(t.stage, APPLY) for t in cp.update},
                      key=_alpa_task_order)
        spans: dict[tuple, tuple[float, float]] = {}  # (call, stage, phase, micro-batch; -1: the update) -> first start, last end

        def add(tag: tuple, a: float, b: float) -> None:
            lo, hi = spans.get(tag, (a, b))
            spans[tag] = (min(lo, a), max(hi, b))

        ray_run = getattr(self.step, "ray_run", None)
        if ray_run is not None and ray_run.plan is cp.plan:  # a run of another plan is not this executable's
            for e in ray_run.events():
                if e.kind == "run":
                    add(("ray", e.step, e.stage, e.phase, -1 if e.phase == APPLY else e.microbatch), e.start, e.end)
        for call, (wall, records) in enumerate(cp.trace):
            for stage, phase, mb, a, b in records:
                add(("here", call, stage, phase, mb), wall + a, wall + b)
        where = {s: (mesh.hosts, mesh.device_ids) for mesh in mesh_placements(cp, self.plan.cluster["devices_per_host"])
                 for s in mesh.stages}
        runs: dict[tuple[int, str], list[tuple]] = {k: [] for k in keys}
        for (_, _, stage, phase, _), (a, b) in sorted(spans.items(), key=lambda kv: kv[1]):
            if (stage, phase) in runs:
                runs[(stage, phase)].append((a, b, *where[stage]))
        return [runs[k] for k in keys]

    @property
    def plan(self) -> Plan | PipelinePlan:
        """The plan this program was compiled from."""
        return self.compiled.plan

    def get_parallel_plan(self) -> Plan | PipelinePlan:
        """Alpa's name: the plan as data (read back from its JSON, without the planner state), to save
        (``plan.save(path)``) and run again with ``parallelize(fn, method=al.plan_to_method(plan))``."""
        return Plan.from_json(self.plan.to_json())

    @property
    def auto_sharding_objective(self) -> float | None:
        """The intra-op ILP's objective as Alpa reports it: communication and resharding costs (eq. 1 with every
        compute cost zero, sec. 4.2), in the cluster's units (seconds; bytes for Alpa's ``mesh_alpha = mesh_beta = 1``
        logical meshes). ``plan.objective`` adds this planner's compute costs. None for a pipeline, which has one per
        stage (``plan.stages[i].plan``)."""
        return None if isinstance(self.compiled, CompiledPipeline) else float(self.compiled.plan.communication_cost)

    def get_total_allocation_size(self) -> int:
        """Bytes XLA allocates per device to run the single-mesh program (arguments, results and temporaries,
        less results that reuse argument buffers: XLA's ``memory_analysis``), to compare with the plan's memory."""
        if isinstance(self.compiled, CompiledPipeline):
            raise ValueError(
                "a pipeline's memory is per mesh and changes while micro-batches are in flight: see plan.stages[i].memory "
                "(eq. 5) and the run's measured memory (run.profile())")
        m = self.compiled.fn.lower(*self.flat_args).compile().memory_analysis()  # jitted with the plan's shardings
        return int(m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes - m.alias_size_in_bytes)

    def dump_debug_info(self, folder: str) -> list[str]:
        """Write the plan (``plan.json``) and XLA's optimised HLO (``program.hlo``; a pipeline's per unit task,
        ``stage{s}_{phase}.hlo``) into ``folder``; returns the files written."""
        import os

        os.makedirs(folder, exist_ok=True)
        written = [os.path.join(folder, "plan.json")]
        self.plan.save(written[0])
        if isinstance(self.compiled, CompiledPipeline):
            texts = {f"stage{s}_{phase}.hlo": text for (s, phase), text in sorted(self.compiled.task_hlo().items())}
        else:
            texts = {"program.hlo": self.get_hlo_text()}
        for name, text in texts.items():
            written.append(os.path.join(folder, name))
            with open(written[-1], "w") as f:
                f.write(text)
        return written


def _dummy_like(x: Any) -> Any:
    """Zeros of ``x``'s shape and dtype (a Python number's type as ``jax.jit`` takes it); a key array: ``x`` itself,
    as its bits are not numbers to zero (keys made from abstract shapes: a key of seed 0 of that shape)."""
    dtype = getattr(x, "dtype", None)
    if dtype is None:
        return type(x)(0)
    if jax.dtypes.issubdtype(dtype, jax.dtypes.extended):
        if isinstance(x, jax.Array):
            return jnp.copy(x)
        return jnp.broadcast_to(jax.random.key(0, impl=getattr(dtype, "_impl", None)), x.shape)  # its own PRNG
    if getattr(x, "weak_type", False) and tuple(x.shape) == ():  # a Python number's place: one, or the jit compiles anew
        return np.zeros((), dtype).item()
    return jnp.zeros(x.shape, dtype)


def _alpa_task_order(key: tuple[int, str]) -> tuple[int, int]:
    """Alpa's order of a pipeline's unit tasks (``Executable.get_hlo_text``): the forwards first to last stage, the
    backwards as they run (last stage first), then the updates (Alpa's tests index them so)."""
    stage, phase = key
    rank = {"forward": 0, "backward": 1, "backward_input": 1, "backward_weight": 2, "apply": 3}.get(phase, 4)
    return rank, (-stage if rank in (1, 2) else stage)


def _cut_vars(graph: OpGraph, split: tuple[bool, ...]) -> frozenset[int]:
    """The program's argument vars whose flat leaves ``split`` marks (the ones cut into micro-batches)."""
    return frozenset(v for v, cut in zip(graph.invars, split) if cut)


class _Group(list):
    """A leaf's placements (a list subclass, so not a pytree node: ``FollowParallel``'s prefix broadcast)."""


@dataclasses.dataclass(frozen=True, eq=False)
class _FollowedStages:
    """The stages of the pipelined step ``source`` that an inference pipeline follows (``FollowParallel``): its
    current plan's layer ranges, sub-meshes and logical meshes, read when the follower plans (``plan_pipeline``'s
    ``fixed``), so the follower's stage i runs on the devices where the source's stage i holds its weights."""

    source: Any

    def plan(self) -> PipelinePlan:
        plan = self.source.current_plan
        if not isinstance(plan, PipelinePlan):
            raise MethodOptionError("FollowParallel: the pipelined step it follows was never run or planned: call it (or "
                                    "step.plan(state, batch)) first")
        if plan.num_meshes != plan.num_stages:
            raise MethodOptionError(
                f"FollowParallel: the step followed interleaves {plan.num_stages} stages over {plan.num_meshes} meshes "
                "(interleaved_1f1b); an inference pipeline follows one stage per mesh: follow a step planned with 1f1b or gpipe")
        return plan

    def assign(self, problem: Any) -> tuple[list[list[int]], list[tuple[int, int]], list[tuple[int, int]]]:
        plan = self.plan()
        if problem.slicing.num_layers != plan.num_layers:
            raise MethodOptionError(
                f"FollowParallel: this step has {problem.slicing.num_layers} layers but the pipelined step it follows has "
                f"{plan.num_layers}: evaluate the model the train step pipelines, with the same boundaries "
                "(mark_pipeline_boundary() calls, or the same AutoLayerOption layer_num)")
        return ([[st.layers[0], st.layers[1] - 1] for st in plan.stages], [tuple(st.submesh_shape) for st in plan.stages],
                [tuple(st.logical_shape) for st in plan.stages])

    def check(self, plan: PipelinePlan) -> None:
        """Raise unless ``plan``'s stages run on the devices of the source's."""
        source = self.plan()
        mine, theirs = [tuple(st.device_ids) for st in plan.stages], [tuple(st.device_ids) for st in source.stages]
        if mine != theirs:
            raise MethodOptionError(
                f"FollowParallel: the stages were placed on devices {mine} but the step followed runs them on {theirs}")


class StateCreator:
    """``parallelize(create_state, method=CreateStateParallel(train_step, other_args))`` (Alpa's): a call makes
    the state on the devices where ``train_step``'s plan reads it (its first argument), each mesh computing
    only its own leaves (one ``jax.jit`` per mesh with the plan's shardings as results; XLA drops the rest),
    so no device holds more of the state than the plan gives it. A leaf that several stages read is made on
    the first (where the runtime keeps it). ``train_step`` is planned for the state's shapes and
    ``other_args`` first if it was not. A step that runs on Ray gets the state made here, on this process's
    devices; its launch places it on the mesh workers."""

    def __init__(self, fn: Callable, method: CreateStateParallel):
        if not isinstance(method.train_step, ParallelizedStep):
            raise MethodOptionError(
                f"CreateStateParallel(train_step, other_args): train_step must be a parallelized step "
                f"(al.parallelize(train_step, ...)), got {type(method.train_step).__name__}")
        self.fn = fn
        self.method = method
        self._programs: tuple[Any, Any, list[tuple[list[int], Any]]] | None = None
        self._last: tuple | None = None

    def _plan(self, args: tuple) -> tuple[Any, tuple]:
        """The train step's plan for the state ``fn(*args)`` makes, and the step's arguments (abstract)."""
        step = self.method.train_step
        state = jax.eval_shape(self.fn, *args)
        train_args = (state, *self.method.step_args())
        step.cluster  # noqa: B018 - settles the cluster (and the session's Ray) as a call of the step does
        step._own_plan_for(train_args, plan_new=True)
        if step.current_plan is None:
            step.plan(*train_args)
        plan = step._require_plan()
        plan.check_program(step.trace(*train_args))  # a plan the user made for other shapes: say so
        step._last_args = train_args
        return plan, train_args

    def _programs_for(self, plan: Any, train_args: tuple) -> list[tuple[list[int], Any]]:
        """One jitted program per mesh holding part of the state: (the state leaves it makes, the program)."""
        tree = jax.tree_util.tree_structure(train_args[0])
        if self._programs is None or self._programs[0] is not plan or self._programs[1] != tree:
            shardings = jax.tree_util.tree_leaves(plan.shardings(*train_args)[0][0])
            groups: dict[Any, list[int]] = {}
            for i, sh in enumerate(shardings):
                groups.setdefault(sh.mesh, []).append(i)

            def part(idx: list[int]) -> Callable:
                return lambda *a: [jax.tree_util.tree_leaves(self.fn(*a))[i] for i in idx]

            self._programs = (plan, tree, [(idx, jax.jit(part(idx), out_shardings=[shardings[i] for i in idx]))
                                           for idx in groups.values()])
        return self._programs[2]

    def __call__(self, *args: Any) -> Any:
        plan, train_args = self._plan(args)
        tree = jax.tree_util.tree_structure(train_args[0])
        try:
            programs = self._programs_for(plan, train_args)
        except DeviceError:
            if self.method.train_step.ray_cluster is None:
                raise
            self._last = args  # a Ray cluster's plan on devices this driver lacks: made here whole, placed at launch
            return jax.jit(self.fn)(*args)
        leaves: list[Any] = [None] * tree.num_leaves
        for idx, program in programs:
            for i, x in zip(idx, program(*args)):
                leaves[i] = x
        self._last = args
        return jax.tree_util.tree_unflatten(tree, leaves)

    def get_executable(self, *args: Any) -> StateExecutable:
        """Alpa's name: the programs making the state for ``args`` and where they leave it."""
        plan, train_args = self._plan(args)
        return StateExecutable(self, args, plan, train_args)

    def get_last_executable(self) -> StateExecutable:
        """Alpa's name: ``get_executable`` for the arguments of the last call."""
        if self._last is None:
            raise ValueError("the state was never made: call it first, or use get_executable(*args)")
        return self.get_executable(*self._last)


@dataclasses.dataclass(frozen=True, eq=False)
class StateExecutable:
    """What ``StateCreator`` runs, as Alpa's tests look at it: where the state is made (``get_output_placement_specs``,
    the train step's ``get_input_placement_specs()[0]``) and each mesh's program (``get_hlo_text``)."""

    creator: StateCreator
    args: tuple
    plan: Plan | PipelinePlan
    train_args: tuple

    def get_output_placement_specs(self) -> Any:
        return self.plan.placement_specs(*self.train_args)[0][0]

    def get_hlo_text(self) -> str | list[str]:
        """XLA's optimised HLO of each mesh's program (one text where the state is on one mesh); compiled, not run."""
        texts = [program.lower(*self.args).compile().as_text() for _, program in self.creator._programs_for(self.plan, self.train_args)]
        return texts[0] if len(texts) == 1 else texts

    def sync(self) -> None:
        _TIMER.sync()


def _stage_input_pins(plan: PipelinePlan, given: tuple[tuple[str, ...], ...]) -> dict[str, str]:
    """Pins holding each stage's inputs in the given specs (Alpa's ``stage_input_shardings``), checked against the
    planned stages: as many stages, as many inputs each, and one spec for an input several stages read."""
    if len(given) != len(plan.stages):
        raise MethodOptionError(
            f"stage_input_shardings gives {len(given)} stages' input specs but the plan has {len(plan.stages)} stages: give "
            "one list per stage (an executable's stage_input_shard_specs of a step with the same stages)")
    pins: dict[str, str] = {}
    for st, specs in zip(plan.stages, given):
        if len(specs) != len(st.plan.inputs):
            raise MethodOptionError(
                f"stage_input_shardings[{st.index}] gives {len(specs)} specs but stage {st.index} has {len(st.plan.inputs)} "
                f"inputs ({', '.join(t.path for t in st.plan.inputs[:3])}{', ...' if len(st.plan.inputs) > 3 else ''})")
        for t, spec in zip(st.plan.inputs, specs):
            if pins.setdefault(t.path, spec) != spec:
                raise MethodOptionError(
                    f"stage_input_shardings holds {t.path}, an input of several stages, as {pins[t.path]!r} and {spec!r}: "
                    "give it one spec")
    return pins


def trace_microbatched(
    fn: Callable, args: tuple, num_microbatches: int, layers: int, *, remat: bool = False, layers_asked: bool = True,
    batch_argnums: tuple[int, ...] | None = None, soft_batch: bool = False, inference: bool = False,
) -> tuple[OpGraph, tuple[bool, ...]]:
    """``fn`` traced on one micro-batch and cut into ``layers`` layers (each under ``jax.checkpoint``
    with ``remat``), and which flat leaves were split.

    ``batch_argnums`` (as Alpa's): the arguments that are the batch, every array leaf of them cut along
    its leading dimension; without it the batch is found by the rule below.

    Once, not twice, in the usual case: the batch is guessed from the arguments' shapes (the
    arguments whose array leaves share one leading dimension), the micro-batch traced, and the
    guess checked against that trace's results by ``microbatch_args``' rule (a leaf returned in
    place is state, every other leaf with the batch's leading dimension is batch). A step that returns no
    state (an evaluation, a step returning gradients) gives that rule nothing to tell the weights from the batch
    by, so for it the guess stands. A wrong guess costs the full-batch trace ``microbatch_args`` does, then the
    trace again.

    ``inference``: a step without gradients (``schedule="inference"``), cut at its boundaries or into layers as a
    loss function is (``forward_layers``). It returns what it computes per example (put back together over the
    micro-batches) and no state, so the results cannot tell the batch from the weights: the guess stands.
    """
    if inference:
        fn = forward_layers(fn)
    flat = jax.tree_util.tree_flatten_with_path(args)[0]
    if batch_argnums is not None:
        named = named_leaves(args, batch_argnums)
        try:
            split = named_batch(args, batch_argnums, num_microbatches, soft=soft_batch)
        except ValueError:  # naming the state is the likelier mistake (its step counter has no batch dimension): say that
            _refuse_named_state(fn, args, batch_argnums, named, inference=inference)
            raise
        micro = [leaf_aval(x, (x.shape[0] // num_microbatches, *x.shape[1:]) if s else None) for (_, x), s in zip(flat, split)]
        try:
            with auto_layers(layers, remat=remat, asked=layers_asked):
                graph = trace(fn, *jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(args), micro), batch_leaves=split)
        except LostUpdatesError:
            raise
        except TraceError as err:  # cutting the state (a weight) into micro-batches breaks the step: say that, if so
            _refuse_named_state(fn, args, batch_argnums, split, inference=inference)
            raise _on_one_microbatch(err, fn, args, split, f"batch_argnums={batch_argnums}: is a per-example argument "
                                     "missing from it?") from err
        _refuse_named_state(fn, args, batch_argnums, split, graph, inference=inference)
        _refuse_per_example_results(fn, args, graph, split, num_microbatches, stacked=inference)
        return graph, split
    guess = _guess_split(args, num_microbatches)
    if guess is not None:
        micro = [
            leaf_aval(x, (x.shape[0] // num_microbatches, *x.shape[1:]) if s else None)
            for (_, x), s in zip(flat, guess)
        ]
        try:
            with auto_layers(layers, remat=remat, asked=layers_asked):
                graph = trace(fn, *jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(args), micro))
        except LostUpdatesError:
            raise
        except TraceError:
            graph = None  # the guess made shapes the step cannot take: ask the full-batch trace
        if graph is not None and (inference or not find_aliases(graph)):
            # no state returned (an evaluation, a step returning gradients): its results cannot tell the batch from
            # the weights, while the arguments whose leaves share one leading size can
            _refuse_per_example_results(fn, args, graph, guess, num_microbatches, stacked=inference)
            return graph, guess
        if graph is not None:  # the rule on the micro-batch's trace: its batch leaves, scaled back up
            results = [(p, tuple(graph.vars[v].shape), str(graph.vars[v].dtype)) for p, v in zip(graph.out_paths, graph.outvars)]
            leaves = [(_path_str(p), tuple(m.shape), str(m.dtype)) for (p, _), m in zip(flat, micro)]
            split = _batch_leaves(leaves, results, [tuple(np.shape(x)) for _, x in flat])
            if split is not None and split == guess:
                _refuse_per_example_results(fn, args, graph, guess, num_microbatches)
                _warn_if_ambiguous(fn, args, graph, guess)
                return graph, guess
    if inference and not any(np.ndim(x) >= 1 for x in jax.tree_util.tree_leaves(args)):  # nothing to cut (Alpa's test_output)
        if num_microbatches != 1:
            raise ValueError(f"this inference step has no batch argument to cut into {num_microbatches} micro-batches: "
                             "use num_micro_batches=1 (microbatches=1)")
        with auto_layers(layers, remat=remat, asked=layers_asked):
            return trace(fn, *args), (False,) * len(flat)
    micro_args, split = microbatch_args(fn, args, num_microbatches)
    try:
        with auto_layers(layers, remat=remat, asked=layers_asked):
            graph = trace(fn, *micro_args)
    except LostUpdatesError:
        raise
    except TraceError as err:
        raise _on_one_microbatch(err, fn, args, split, "the leading size most data leaves share; name the batch with "
                                 "parallelize(..., batch_argnums=(1,)) if it is other arguments") from err
    _refuse_per_example_results(fn, args, graph, split, num_microbatches, stacked=inference)
    _warn_if_ambiguous(fn, args, graph, split)
    return graph, split


def _on_one_microbatch(err: TraceError, fn: Callable, args: tuple, split: tuple[bool, ...], why: str) -> TraceError:
    """``err`` (the step failed on one micro-batch's shapes) with what was cut and which data went whole: a step
    that runs on the full batch and fails on a micro-batch was most likely cut where it should not be."""
    flat = jax.tree_util.tree_flatten_with_path(args)[0]
    try:  # the state, left out of what went whole (it always does)
        state = set(state_aliases(_argument_leaves(flat), _full_results(fn, args)).values())
    except Exception:  # the step fails on the full batch too: the error says why
        return err
    cut = [_path_str(p) for (p, _), s in zip(flat, split) if s]
    whole = [f"{_path_str(p)} {tuple(np.shape(x))}" for i, ((p, x), s) in enumerate(zip(flat, split))
             if not s and i not in state and np.ndim(x) >= 1]
    shown = ", ".join(whole[:6]) + (f" and {len(whole) - 6} more" if len(whole) > 6 else "")
    return TraceError(
        f"{err}\n(traced on one micro-batch: cut {', '.join(cut)} ({why}); passed whole: {shown or 'nothing else'})"
    )


def _warn_if_ambiguous(fn: Callable, args: tuple, graph: OpGraph, split: tuple[bool, ...]) -> None:
    """Warn where the batch rule may have taken side inputs for the batch: RoPE's sin and cos tables passed
    beside the tokens outnumber them, so the tables were cut, the tokens passed whole, and the numbers were
    silently others. Two signs: argument 1 (Alpa's default batch) has data leaves and none was cut, or what was
    cut spans several arguments while other data leaves lead with another size. ``batch_argnums`` settles it."""
    flat = jax.tree_util.tree_flatten_with_path(args)[0]
    state = _state_positions(graph)
    cut = [i for i, s in enumerate(split) if s]

    def raw_key(x: Any) -> bool:  # jax.random.PRNGKey's uint32[2] (or a stack of them): never the batch
        return str(leaf_aval(x).dtype) == "uint32" and np.ndim(x) <= 2 and np.shape(x)[-1] == 2

    whole = [i for i, (_, x) in enumerate(flat) if not split[i] and i not in state and np.ndim(x) >= 1 and not raw_key(x)]
    if not whole:
        return
    position = [getattr(p[0], "idx", None) for p, _ in flat]
    second_passed_whole = any(position[i] == 1 for i in whole) and not any(position[i] == 1 for i in cut)
    if not second_passed_whole and len({position[i] for i in cut}) < 2:
        return
    warnings.warn(
        f"{getattr(fn, '__name__', 'the step')}: the batch cut into micro-batches is {', '.join(_path_str(flat[i][0]) for i in cut)} "
        f"(the leading size most data leaves share), and {', '.join(_path_str(flat[i][0]) for i in whole)} go whole to "
        "every micro-batch; if the batch is elsewhere, name it: parallelize(..., batch_argnums=(1,))",
        stacklevel=4,
    )


def _full_results(fn: Callable, args: tuple) -> list[Leaf]:
    """The step's results on the full arguments (``jax.eval_shape``), as ``state_aliases`` reads them."""
    out = jax.eval_shape(fn, *args)
    return [(_path_str(p), tuple(x.shape), str(x.dtype)) for p, x in jax.tree_util.tree_flatten_with_path(out)[0]]


def _argument_leaves(flat: list) -> list[Leaf]:
    """The arguments' flat leaves (``tree_flatten_with_path``) as ``state_aliases`` reads them."""
    return [(_path_str(p), tuple(np.shape(x)), str(leaf_aval(x).dtype)) for p, x in flat]


def _state_positions(graph: OpGraph, *, named_batch: bool = False) -> set[int]:
    """Positions among the traced arguments of those the step returns in place (``find_aliases``; ``named_batch``:
    the named batch too, where the shapes alone take it for state)."""
    position = {v: i for i, v in enumerate(graph.invars)}
    return {position[v] for v in find_aliases(graph, named_batch=named_batch).values()}


def _refuse_named_state(
    fn: Callable, args: tuple, batch_argnums: tuple[int, ...], named: tuple[bool, ...], graph: OpGraph | None = None,
    *, inference: bool = False,
) -> None:
    """Raise if ``batch_argnums`` names the step's state. What the shapes alone take for state (results with an
    argument's path, shape and dtype: ``find_aliases(named_batch=True)``) is found in ``graph`` (the micro-batch's
    trace) or, without one, in the full arguments' ``jax.eval_shape``; the named leaves are state where that is
    all among them, or where a named argument of several leaves comes back whole (an optimizer state, Adam's
    moments in ``step(params, opt_state, batch)`` under Alpa's default ``(1,)``). A single array named beside
    other state (``step(state, batch) -> (state, reconstruction)``), or any argument of an inference step (which
    returns no state), is taken at the user's word: a result shaped like it is per example."""
    if inference:
        return
    flat = jax.tree_util.tree_flatten_with_path(args)[0]
    if graph is not None:
        state = _state_positions(graph, named_batch=True)
    else:
        try:
            results = _full_results(fn, args)
        except Exception:  # the step cannot take these arguments at all: the caller's error says more
            return
        state = set(state_aliases(_argument_leaves(flat), results).values())
    returned = [_path_str(p) for i, ((p, _), s) in enumerate(zip(flat, named)) if s and i in state]
    leaves_of: dict[Any, list[int]] = {}
    for i, (p, _) in enumerate(flat):
        leaves_of.setdefault(getattr(p[0], "idx", None) if p else None, []).append(i)
    named_args = {getattr(p[0], "idx", None) for (p, _), s in zip(flat, named) if s and p}
    whole = any(len(leaves_of[k]) >= 2 and all(i in state for i in leaves_of[k]) for k in named_args)
    if returned and (whole or all(named[i] for i in state)):
        shown = ", ".join(returned[:3]) + (f" and {len(returned) - 3} more" if len(returned) > 3 else "")
        raise ValueError(
            f"batch_argnums={batch_argnums} names {shown}, which the step returns in place as its state: the batch "
            "is what the step reads and does not return; name the batch's argument positions"
        )


def _refuse_per_example_results(
    fn: Callable, args: tuple, graph: OpGraph, split: tuple[bool, ...], num_microbatches: int, *, stacked: bool = False,
) -> None:
    """Raise if a result other than the state is per example (it has the batch's rows): a pipelined step
    returns one value per result and step (a float's average over the micro-batches, an integer's last
    value), so it would come back with a micro-batch's rows, not the batch's. Only a result leading with a
    micro-batch's row count is checked, against the full batch's trace (``jax.eval_shape``, then only).
    ``stacked``: an inference step, whose per-example results are put back together (``ProgramSlicing.stacked``):
    nothing to refuse."""
    if stacked:
        return
    flat = jax.tree_util.tree_leaves(args)
    rows = next((np.shape(x)[0] // num_microbatches for x, s in zip(flat, split) if s), None)
    state = find_aliases(graph)
    suspects = [  # an argument returned as it came in is returned whole (``runtime.pipeline``): not one
        pos for pos, v in enumerate(graph.outvars)
        if pos not in state and graph.vars[v].kind != "input" and graph.vars[v].shape and graph.vars[v].shape[0] == rows
    ]
    if not suspects:
        return
    full = {path: shape for path, shape, _ in _full_results(fn, args)}
    for pos in suspects:
        path, shape = graph.out_paths[pos], tuple(graph.vars[graph.outvars[pos]].shape)
        if full.get(path, shape) != shape:
            raise TraceError(
                f"{getattr(fn, '__name__', 'the step')} returns {path} per example ({full[path]} for the batch, {shape} for "
                f"one of its {num_microbatches} micro-batches): a pipelined step returns one value per result and step "
                "besides the state (a float's average over the micro-batches, an integer's last value); return a "
                "reduction of it (a mean), or plan the step without microbatches"
            )


def _batch_leaves(args: list[Leaf], results: list[Leaf], shapes: list[tuple[int, ...]] | None = None) -> tuple[bool, ...] | None:
    """Which argument leaves are the batch: not returned in place (``state_aliases``: the train state),
    with a dimension, and leading with the batch size (``batch_dimension``, of the full batch's ``shapes``
    when ``args`` are a micro-batch's); None if there are none."""
    shapes = shapes or [shape for _, shape, _ in args]
    state = set(state_aliases(args, results).values())
    data = [i for i, shape in enumerate(shapes) if i not in state and len(shape) >= 1]
    batch = batch_dimension([shapes[i] for i in data])
    if batch is None:
        return None
    return tuple(i in data and shapes[i][0] == batch for i in range(len(args)))


def check_batch_argnums(batch_argnums: Any) -> tuple[int, ...] | None:
    """``batch_argnums`` (an int or a sequence of them, as Alpa's) as a tuple, or a ValueError saying what is wrong."""
    if batch_argnums is None:
        return None
    nums = (batch_argnums,) if isinstance(batch_argnums, (int, np.integer)) and not isinstance(batch_argnums, bool) else batch_argnums
    try:
        nums = tuple(nums)
    except TypeError:
        nums = None
    if not nums or any(isinstance(n, bool) or not isinstance(n, (int, np.integer)) for n in nums) or len(set(nums)) != len(nums):
        raise ValueError(
            f"batch_argnums must be an argument position or a sequence of distinct ones (e.g. 1 or (1,)), got {batch_argnums!r}"
        )
    return tuple(int(n) for n in nums)


def named_leaves(args: tuple, batch_argnums: tuple[int, ...]) -> tuple[bool, ...]:
    """Which flat leaves of ``args`` belong to the arguments at ``batch_argnums`` (negative positions count from
    the end, as Python's); a ValueError for a position the call does not have."""
    positions = set()
    for n in batch_argnums:
        if not -len(args) <= n < len(args):
            raise ValueError(
                f"batch_argnums={batch_argnums} names argument {n}, but the step was called with {len(args)} argument(s)"
            )
        positions.add(n % len(args))
    return tuple(getattr(p[0], "idx", None) in positions for p, _ in jax.tree_util.tree_flatten_with_path(args)[0])


def named_batch(
    args: tuple, batch_argnums: tuple[int, ...], num_microbatches: int | None = None, *, soft: bool = False
) -> tuple[bool, ...]:
    """Which flat leaves of ``args`` are the batch ``batch_argnums`` names: every leaf of those arguments
    (``named_leaves``). Each must have a leading dimension, the same for all, that ``num_microbatches``
    divides; a ValueError names the leaf that does not. ``soft`` (Alpa's default ``(1,)``, not named by the
    user): of those leaves, the ones leading with the size most of them share (``batch_dimension``) are the
    batch and the others (a PRNG key in the batch dict, per-class weights) are passed whole."""
    split = named_leaves(args, batch_argnums)
    flat = jax.tree_util.tree_flatten_with_path(args)[0]
    if soft:
        batch = batch_dimension([tuple(np.shape(x)) for (_, x), s in zip(flat, split) if s and np.ndim(x) >= 1])
        split = tuple(s and np.ndim(x) >= 1 and np.shape(x)[0] == batch for (_, x), s in zip(flat, split))
    named = [(_path_str(p), tuple(np.shape(x))) for (p, x), s in zip(flat, split) if s]
    if not named:
        raise ValueError(f"batch_argnums={batch_argnums} names arguments without arrays: there is no batch to cut")
    scalars = [p for p, shape in named if not shape]
    if scalars:
        raise ValueError(
            f"batch_argnums={batch_argnums} names {', '.join(scalars)}, which has no leading (batch) dimension: "
            "pass what every example shares (a learning rate, a key) as another argument"
        )
    sizes = {shape[0] for _, shape in named}
    if len(sizes) > 1:
        raise ValueError(
            f"the batch batch_argnums={batch_argnums} names has leaves of different leading sizes: "
            + ", ".join(f"{p} {shape}" for p, shape in named)
        )
    (batch,) = sizes
    if num_microbatches is not None and batch % num_microbatches:
        raise ValueError(
            f"microbatches={num_microbatches} does not divide the batch size {batch} (leading dimension of "
            f"{', '.join(p for p, _ in named)}); choose a divisor of {batch}"
        )
    return split


def _guess_split(args: tuple, num_microbatches: int) -> tuple[bool, ...] | None:
    """Which flat leaves are likely the batch: those of the arguments whose array leaves all share one
    leading dimension (a batch dict; not a train state), at the largest such dimension; None: no guess."""
    shared = []
    for arg in args:
        dims = {np.shape(x)[0] for x in jax.tree_util.tree_leaves(arg) if np.ndim(x) >= 1}
        shared.append(dims.pop() if len(dims) == 1 else None)
    batch = max((d for d in shared if d is not None), default=None)
    if not batch or batch % num_microbatches:
        return None
    return tuple(
        d == batch and np.ndim(x) >= 1 and np.shape(x)[0] == batch
        for arg, d in zip(args, shared)
        for x in jax.tree_util.tree_leaves(arg)
    )


def microbatch_args(fn: Callable, args: tuple, num_microbatches: int) -> tuple[tuple, tuple[bool, ...]]:
    """``args`` as one micro-batch (ShapeDtypeStructs), and which flat leaves were split.

    The batch is every argument leaf that the step does not return in place (not train
    state, ``state_aliases``: ``return state, loss`` or ``return loss, state``) whose leading
    dimension is the batch size (the one most such leaves share, ``batch_dimension``); other
    data (a scalar learning rate, a raw key, per-class weights) is passed whole to every
    micro-batch. ``plan.split_inputs`` lists what was split.
    """
    flat, tree = jax.tree_util.tree_flatten_with_path(args)
    try:
        results = _full_results(fn, args)
    except Exception as exc:  # the user's own code failed: say so, keep their traceback
        raise TraceError(
            f"could not trace {getattr(fn, '__name__', fn)!r} with the given example arguments: {type(exc).__name__}: {exc}"
        ) from exc
    split = _batch_leaves(_argument_leaves(flat), results)
    if split is None:
        raise ValueError("the step has no batch to split into micro-batches: every argument is returned as state")
    batch = next(x.shape[0] for (_, x), s in zip(flat, split) if s)
    data = [i for i, s in enumerate(split) if s]
    if batch % num_microbatches:
        raise ValueError(
            f"microbatches={num_microbatches} does not divide the batch size {batch} "
            f"(leading dimension of {', '.join(_path_str(flat[i][0]) for i in data if split[i])}); "
            f"choose a divisor of {batch}"
        )
    micro = [
        leaf_aval(x, (x.shape[0] // num_microbatches, *x.shape[1:]) if s else None)
        for (_, x), s in zip(flat, split)
    ]
    return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(args), micro), split


def cluster_argument(cluster: Any) -> tuple[ClusterSpec | None, Any]:
    """(the ClusterSpec to plan for, the Ray cluster to run on or None) of ``parallelize``'s ``cluster=``: a
    ``ClusterSpec``, the text the command line takes (``"local:2x4"``, ``"p3.16xlarge:2"``: ``ClusterSpec.parse``),
    or a ``RayCluster`` (planned for its devices, run on its mesh workers, as ``step.on_ray(cluster)``)."""
    if cluster is None or isinstance(cluster, ClusterSpec):
        return cluster, None
    if isinstance(cluster, str):
        return ClusterSpec.parse(cluster), None
    from alpa_lab.runtime.ray_cluster import RayCluster

    if isinstance(cluster, RayCluster):
        return cluster.spec, cluster
    raise ClusterError(
        f"cluster= takes a ClusterSpec (al.ClusterSpec.local(2, 4)), a text such as 'local:2x4' or 'p3.16xlarge:2', or a "
        f"RayCluster; got {type(cluster).__name__} {cluster!r}")


def parallelize(
    fn: Callable | None = None,
    *,
    cluster: ClusterSpec | str | RayCluster | None = None,
    mesh_shape: tuple[int, int] | None = None,
    method: str | ParallelMethod = "alpa",
    memory_budget: float | str | None = None,
    microbatches: int | None = None,
    schedule: str = "1f1b",
    layers: int | None = None,
    max_stages: int | None = None,
    cost_model: str = "analytic",
    remat: bool = False,
    submesh_space: str = "all",
    batch_argnums: int | tuple[int, ...] | None = None,
    logical_meshes: str = "all",
    stage_option: Any = None,
    static_argnums: Any = "auto",
    donate_argnums: Any = "auto",
) -> ParallelizedStep | Callable[[Callable], ParallelizedStep]:
    """Wrap a training step for planning and sharded execution (usable as a decorator).

    ``cluster``: what to plan for: a ``ClusterSpec``, its text (``"local:2x4"``, ``"p3.16xlarge:2"``, as
    ``alpa-lab demo --cluster`` takes it), or a ``RayCluster``, whose mesh workers then run the calls
    (``step.on_ray``); by default this process's devices, or the session's (``init``).

    With ``microbatches`` the step is pipelined: cut into ``layers`` layers (default 8, or
    the hand-placed ``mark_stage_boundary`` cuts), sliced into stages on sub-meshes by the
    inter-op DP, each stage sharded by the intra-op ILP, run with ``schedule``.
    ``cost_model="profile"`` times the planned stages on this process's devices instead of
    pricing them (Alpa's profiling cost model; ``runtime.stage_profile``). ``remat=True`` runs
    each layer under ``jax.checkpoint`` (as Alpa's benchmarks did): eq. 5 then holds only the
    layers' inputs per micro-batch in flight, and each backward pays for recomputing its forward.
    ``submesh_space="power_of_two"`` lets the stage DP try whole-host sub-meshes of 2, 4, 8, ... hosts
    only (Alpa's default; "all" tries every host count, as the paper): far faster on many hosts.
    ``batch_argnums`` (as Alpa's, e.g. ``(1,)``): the arguments that are the batch, every leaf of them
    cut into micro-batches and split by the data-parallel methods; by default the batch is the data
    leaves that lead with the size most of them share (``plan.split_inputs`` shows what was cut).
    ``logical_meshes``: the logical meshes the stage DP tries per sub-mesh (``passes.pipeline.LOGICAL_MESH_SPACES``).
    ``stage_option``: the stages given instead of searched (``ManualStageOption`` / ``UniformStageOption``).
    ``method`` may also be one of Alpa's method objects (``ShardParallel()``, ``PipeshardParallel(...)``,
    ``DataParallel()``, ...: ``parallel_method``), which set the options above they mean; ``None`` is "alpa".
    ``static_argnums`` and ``donate_argnums`` are Alpa's: static arguments (by default "auto": a function such as
    ``model.apply``, a string, an object; or the positions given, e.g. a flag the step branches on) are bound into
    the traced function, and a call with other values plans anew (``StaticArgs``); donation is accepted and not done
    (the results are the same; the old state's buffers are kept).
    """
    check_static_argnums(static_argnums)  # fail at the decorator, not at the first call

    def wrap(f: Callable) -> ParallelizedStep | StateCreator:
        if isinstance(method, CreateStateParallel):
            given = {"cluster": cluster, "mesh_shape": mesh_shape, "memory_budget": memory_budget, "microbatches": microbatches,
                     "schedule": schedule, "layers": layers, "max_stages": max_stages, "cost_model": cost_model, "remat": remat,
                     "submesh_space": submesh_space, "batch_argnums": batch_argnums, "logical_meshes": logical_meshes,
                     "stage_option": stage_option}
            passed = _not_defaults(given, parallelize)
            if passed:
                raise ValueError("method=CreateStateParallel(...) makes the state where its train step's plan reads it: "
                                 f"drop {', '.join(f'{k}=' for k in passed)} (the train step has them)")
            return StateCreator(f, method)
        return ParallelizedStep(
            f,
            cluster,
            mesh_shape=mesh_shape,
            method=method,
            memory_budget=memory_budget,
            microbatches=microbatches,
            schedule=schedule,
            layers=layers,
            max_stages=max_stages,
            cost_model=cost_model,
            remat=remat,
            submesh_space=submesh_space,
            batch_argnums=batch_argnums,
            logical_meshes=logical_meshes,
            stage_option=stage_option,
            static_argnums=static_argnums,
        )

    return wrap(fn) if fn is not None else wrap
