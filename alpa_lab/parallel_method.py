"""Alpa's parallel methods (``ShardParallel``, ``PipeshardParallel``, ...) as ``parallelize`` options.

Code written for Alpa chooses how to parallelize with a method object::

    method = al.PipeshardParallel(num_micro_batches=16, layer_option=al.AutoLayerOption(layer_num=2),
                                  stage_option="auto")
    p_train_step = al.parallelize(train_step, method=method)

Each class takes the arguments Alpa's takes (Alpa 0.2's names, order and defaults; also
``ManualPipeshardParallel`` and ``AutoLayerOption(layer_num, remat_layer)`` of earlier releases)
and says which of ``parallelize``'s own options it means (``options``), so there is one planner
behind both spellings. ``devices=`` takes Alpa's device meshes: a logical mesh
(``LocalPhysicalDeviceMesh().get_logical_mesh(shape, mesh_alpha, mesh_beta)``: that grid, priced by
Alpa's alpha-beta numbers; a pipeline's stages choose their own views of it), a local physical mesh, or
a Ray cluster's virtual mesh (``get_global_cluster().get_virtual_physical_mesh(host_ids, num_devices_per_host)``:
planned for that part of the cluster and run on its mesh workers), or a list of JAX devices (a local physical mesh of
them). What Alpa does that this planner does not (fine-grained remat, a profiling database, devices other than the
first ones JAX lists, options that forbid strategies) is refused by name; options that only tune Alpa's own solver (its combiner
thresholds, ``eps``) are accepted and change nothing, as each class says (``force_batch_dim_to_mesh_dim``
is honoured on one mesh and in a pipeline's planned stages). Alpa's defaults are kept because code relies on
them: ``PipeshardParallel`` cuts 2 layers and, without ``stage_option``, places stages uniformly (one stage per layer on equal
sub-meshes, each viewed as its own shape: ``UniformStageOption``), not by the stage DP
(``stage_option="auto"``, over ``"power_of_two"`` sub-meshes with ``"single_node_model_parallel"``
logical meshes); ``layer_option="manual"`` cuts only at ``mark_pipeline_boundary()``.

``CreateStateParallel(train_step, other_args)`` makes a state where another step's plan reads it
(``api.StateCreator``), and ``FollowParallel(src_func)`` plans a step on another step's mesh with its
arguments held as that step holds them (``ParallelizedStep._follow``).

Pure data: nothing here plans; ``api.parallelize`` reads ``options()`` and the stage options
give ``passes.pipeline.plan_pipeline`` its fixed stages (``assign``, sharing ``passes.submesh.even_submesh``
with ``fixed_stages``' default split) and their forced batch axes (``batch_axes``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import numpy as np

__all__ = [
    "AutoLayerOption",
    "AutoShardingOption",
    "AutoStageOption",
    "CreateStateParallel",
    "DataParallel",
    "FollowParallel",
    "ManualLayerOption",
    "ManualPipeshardParallel",
    "ManualShardingOption",
    "UNSPECIFIED",
    "LocalPhysicalDeviceMesh",
    "LocalPipelineParallel",
    "LogicalDeviceMesh",
    "ManualStageOption",
    "MethodOptionError",
    "ParallelMethod",
    "PipeshardParallel",
    "ShardParallel",
    "UniformStageOption",
    "Zero2Parallel",
    "Zero3Parallel",
    "PlanMethod",
    "get_3d_parallel_method",
    "plan_to_method",
]


class MethodOptionError(ValueError):
    """An Alpa method or option this planner cannot honour (what, and what to pass instead)."""


# ----- options ---------------------------------------------------------------------------------
@dataclass
class AutoShardingOption:
    """Alpa's intra-op options (its fields, order and defaults). Mutable, as Alpa's: its tests set
    ``method.as_option.prefer_reduce_scatter = True`` before ``parallelize`` reads it.

    Those that choose a method are read (``method_name``). ``allow_recompute_heavy_op`` and
    ``allow_mixed_mesh_shape`` are this planner's rule at their defaults (False): a matmul or
    convolution is split over every device of its mesh where its shapes allow (``sharding.rules``).
    ``force_batch_dim_to_mesh_dim`` is honoured for a single-mesh plan (``ShardParallel``): every op making a
    tensor with a batch dimension keeps it split over that mesh axis alone (``passes.methods.batch_dims``; a
    pinned op, or one with no such strategy, excepted), and grids where that axis has one device are not tried
    unless ``devices`` gives one. In a pipeline (``PipeshardParallel``'s ``default_auto_sharding_option``, a
    ``ManualStageOption``'s per-stage dicts) each stage's plan keeps it so on that stage's logical mesh, and the
    stage DP prices each layer so (the default option's axis), as Alpa profiles its stages with the option.
    ``force_data_parallel`` keeps the batch split over every device, and takes precedence over it.
    ``allow_all_gather=False`` / ``allow_all_to_all=False``: no strategy and no resharding of the plan issues that
    collective (the mesh prices it infinitely; planning says so where no plan avoids it), for the plan's mesh or
    every stage's. Those that only tune Alpa's own solver or its collective combiners (the thresholds,
    ``prefer_reduce_scatter`` without ``force_data_parallel``) are accepted and change nothing;
    ``allow_replicated_parameters=False`` is refused."""

    enable_auto_sharding: bool = True
    allow_all_gather: bool = True
    allow_all_to_all: bool = True
    allow_replicated_parameters: bool = True
    force_data_parallel: bool = False
    force_batch_dim_to_mesh_dim: int | None = None
    force_zero_stage_3: bool = False
    force_zero_stage_3_all_gather_threshold: int = 1 << 25
    prefer_reduce_scatter: bool = False
    allow_mixed_mesh_shape: bool = False
    allow_recompute_heavy_op: bool = False
    force_simple_heuristic: str = ""
    all_reduce_threshold: int = 1 << 60

    def method_name(self, manual: bool = False) -> str:
        """This planner's method for these options: zero3, zero2, data_parallel, or the ILP ("alpa").

        ``manual``: the method has a ``ManualShardingOption``. Alpa then runs ``enable_auto_sharding=False`` with those
        shardings alone, XLA propagating them; here the ILP plans the rest around them (pins), as with auto-sharding:
        the given layouts hold either way."""
        if not self.enable_auto_sharding and not manual:
            raise MethodOptionError(
                "AutoShardingOption(enable_auto_sharding=False) runs the step with your own sharding annotations only; "
                "this planner always plans: give them as a ManualShardingOption (the planner plans around them), use "
                "jax.jit with your shardings, or drop the option")
        if not self.enable_auto_sharding:
            return "alpa"
        if self.force_simple_heuristic:
            raise MethodOptionError(
                f"AutoShardingOption(force_simple_heuristic={self.force_simple_heuristic!r}) is not supported: choose a "
                "method instead (al.DataParallel(), al.Zero2Parallel(), al.Zero3Parallel(), or parallelize(method='megatron'))")
        if self.force_zero_stage_3:
            return "zero3"
        if self.force_data_parallel:  # Alpa then lifts the restrictions below itself
            return "zero2" if self.prefer_reduce_scatter else "data_parallel"
        if not self.allow_replicated_parameters:
            raise MethodOptionError(
                "AutoShardingOption(allow_replicated_parameters=False) is not supported: the ILP here considers every "
                "layout of a parameter; pin the parameters' layouts on the plan instead (plan.pin(name, spec))")
        return "alpa"

    def forbidden_collectives(self) -> tuple[str, ...]:
        """The collective kinds these options forbid the ILP's own method (``LogicalMesh.forbidden``): Alpa's
        ``allow_all_gather=False`` / ``allow_all_to_all=False``. The other methods fix the layouts themselves (Alpa
        lifts both restrictions under ``force_data_parallel`` too), so they forbid nothing."""
        if not self.enable_auto_sharding or self.method_name() != "alpa":
            return ()
        return tuple(k for k, allowed in (("all-gather", self.allow_all_gather), ("all-to-all", self.allow_all_to_all))
                     if not allowed)


@dataclass(frozen=True)
class AutoLayerOption:
    """Cut the step into ``layer_num`` layers of balanced cost (this planner's ``layers=``).

    ``remat_mode``: "none", or "coarse_grained_remat" (each layer under ``jax.checkpoint``: ``remat=True``);
    Alpa's older ``AutoLayerOption(layer_num, remat_layer)`` is read too. ``eps`` (Alpa's layer-balance
    tolerance) is accepted; this planner's layering balances on its own terms.
    """

    layer_num: int
    remat_mode: Any = "none"
    fine_grained_remat_layer_num: int | None = None
    static_argnums: Sequence[int] = ()
    eps: float = 0.5
    remat_layer: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.layer_num, bool) or not isinstance(self.layer_num, (int, np.integer)) or self.layer_num < 1:
            raise MethodOptionError(f"AutoLayerOption(layer_num=...) must be a positive integer, got {self.layer_num!r}")
        if isinstance(self.remat_mode, bool):  # Alpa's older signature: AutoLayerOption(layer_num, remat_layer)
            object.__setattr__(self, "remat_layer", self.remat_mode or self.remat_layer)
            object.__setattr__(self, "remat_mode", "coarse_grained_remat" if self.remat_layer else "none")
        elif self.remat_layer:
            object.__setattr__(self, "remat_mode", "coarse_grained_remat")
        if self.remat_mode not in ("none", "coarse_grained_remat", "fine_grained_remat"):
            raise MethodOptionError(
                f"AutoLayerOption(remat_mode={self.remat_mode!r}): choose 'none' or 'coarse_grained_remat'")
        if self.remat_mode == "fine_grained_remat" or self.fine_grained_remat_layer_num is not None:
            raise MethodOptionError(
                "fine-grained remat is not supported: use remat_mode='coarse_grained_remat' (each layer recomputed in "
                "the backward), or put jax.checkpoint in your step where you want it")
        _no_static(self.static_argnums, "AutoLayerOption")


@dataclass(frozen=True)
class ManualLayerOption:
    """Layers at your ``mark_pipeline_boundary()`` calls (one layer if there are none); ``remat_layer``: each
    under ``jax.checkpoint``."""

    remat_layer: bool = False
    static_argnums: Sequence[int] = ()

    def __post_init__(self) -> None:
        _no_static(self.static_argnums, "ManualLayerOption")


def _no_static(static_argnums: Any, where: str) -> None:
    if tuple(static_argnums or ()):
        raise MethodOptionError(
            f"{where}(static_argnums={tuple(static_argnums)}) is not supported: pass Python values of the loss function "
            "positionally as they are (they are kept static), or close over them")


@dataclass(frozen=True)
class AutoStageOption:
    """Stages and sub-meshes chosen by the stage DP (sec. 5.2), over Alpa's search spaces."""

    submesh_physical_shape_space: str = "power_of_two"
    submesh_logical_shape_space: str = "single_node_model_parallel"
    stage_imbalance_tolerance: float = math.inf
    use_hlo_cost_model: bool = False
    profiling_database_filename: str | None = None
    cached_profile_result: str | None = None
    manually_specified_submeshes: Sequence[Sequence[int]] | None = None
    layer_profile_mode: str = "composition"
    cached_compute_cost: str | None = None
    """Alpa's older name of ``cached_profile_result``"""

    def __post_init__(self) -> None:
        manual = self.submesh_physical_shape_space == "manual"
        if manual != (self.manually_specified_submeshes is not None):
            raise MethodOptionError(
                "AutoStageOption: submesh_physical_shape_space='manual' and manually_specified_submeshes=((1, 2), ...) "
                "go together (the stage DP then tries only those sub-mesh shapes); otherwise choose the space with "
                "submesh_physical_shape_space ('power_of_two', 'small_power_of_two', 'all')")
        if self.stage_imbalance_tolerance != math.inf:
            raise MethodOptionError(
                "AutoStageOption(stage_imbalance_tolerance=...) is not supported: the DP here searches every stage "
                "(it is fast enough not to prune); pin the stages you want with plan.pin_stages(...)")
        for name in ("profiling_database_filename", "cached_profile_result", "cached_compute_cost"):
            if getattr(self, name) is not None:
                raise MethodOptionError(
                    f"AutoStageOption({name}=...) reads Alpa's profiling files, which this planner does not use: stage "
                    "costs come from parallelize(cost_model=...) ('analytic', calibrated by ClusterSpec.calibrate(), or "
                    "'profile', cached on disk)")


@dataclass(frozen=True)
class ManualStageOption:
    """Stages as you give them: each stage's layer ids (in order, covering every layer once), its sub-mesh,
    its logical mesh (default, as Alpa: the sub-mesh's own shape). The per-stage auto-sharding dicts may hold
    only ``force_batch_dim_to_mesh_dim`` (as Alpa's stage DP writes them): that stage keeps its batch split over
    that mesh axis (``AutoShardingOption``), over the method's default; ``{}`` leaves the stage to the default."""

    forward_stage_layer_ids: Sequence[Sequence[int]]
    submesh_physical_shapes: Sequence[Sequence[int]]
    submesh_logical_shapes: Sequence[Sequence[int]] | None = None
    submesh_autosharding_option_dicts: Sequence[dict] | None = None

    def __post_init__(self) -> None:
        n = len(self.forward_stage_layer_ids)
        if len(self.submesh_physical_shapes) != n:
            raise MethodOptionError(f"ManualStageOption: {n} stages but {len(self.submesh_physical_shapes)} sub-mesh shapes")
        if self.submesh_logical_shapes is not None and len(self.submesh_logical_shapes) != n:
            raise MethodOptionError(f"ManualStageOption: {n} stages but {len(self.submesh_logical_shapes)} logical mesh shapes")
        dicts = self.submesh_autosharding_option_dicts
        if dicts is not None and len(dicts) != n:
            raise MethodOptionError(f"ManualStageOption: {n} stages but {len(dicts)} submesh_autosharding_option_dicts")
        for d in dicts or ():
            _check_option_dict(d)

    def batch_axes(self, num_stages: int) -> list[int | None]:
        """Per stage, the mesh axis its dict forces the batch onto (-1: not forced); None: the method's default."""
        return [_dict_axis(d) for d in self.submesh_autosharding_option_dicts or [{}] * num_stages]

    def assign(self, problem: Any) -> tuple[list[list[int]], list[tuple[int, int]], list[tuple[int, int]] | None]:
        """([first, last] layers, sub-mesh, logical mesh) per stage, as ``plan_pipeline(fixed=...)`` takes them."""
        ranges, expect = [], 0
        for ids in self.forward_stage_layer_ids:
            ids = [int(i) for i in ids]
            if not ids or ids != list(range(expect, expect + len(ids))):
                raise MethodOptionError(
                    f"ManualStageOption: forward_stage_layer_ids must list the layers 0, 1, ... in order, each once, "
                    f"every stage at least one; got {[list(x) for x in self.forward_stage_layer_ids]}")
            ranges.append([ids[0], ids[-1]])
            expect += len(ids)
        num_layers = problem.slicing.num_layers
        if expect != num_layers:
            raise MethodOptionError(
                f"ManualStageOption names {expect} layers but the step has {num_layers} (mark_pipeline_boundary() calls, "
                "or layer_num of AutoLayerOption)")
        submeshes = [tuple(s) for s in self.submesh_physical_shapes]
        logical = submeshes if self.submesh_logical_shapes is None else [tuple(s) for s in self.submesh_logical_shapes]
        return ranges, submeshes, logical


@dataclass(frozen=True)
class UniformStageOption:
    """Equal stages on equal sub-meshes: ``num_stages`` (default: one per layer) stages of contiguous layers with
    balanced FLOPs, each on devices / ``num_stages`` devices (or ``submesh_physical_shape``), viewed as
    ``submesh_logical_shape`` (default, as Alpa: the sub-mesh's own shape)."""

    num_stages: int | None = None
    submesh_physical_shape: Sequence[int] | None = None
    submesh_logical_shape: Sequence[int] | None = None
    submesh_autosharding_option: dict | None = None

    def __post_init__(self) -> None:
        if self.num_stages is not None and (isinstance(self.num_stages, bool) or not isinstance(self.num_stages, (int, np.integer))
                                            or self.num_stages < 1):
            raise MethodOptionError(f"UniformStageOption(num_stages=...) must be a positive integer, got {self.num_stages!r}")
        if self.submesh_physical_shape is not None and self.submesh_logical_shape is None:
            raise MethodOptionError("UniformStageOption: give submesh_logical_shape with submesh_physical_shape (as Alpa asks)")
        if self.submesh_autosharding_option is not None:
            _check_option_dict(self.submesh_autosharding_option)

    def assign(self, problem: Any) -> tuple[list[list[int]], list[tuple[int, int]] | None, list[tuple[int, int]] | None]:
        num_layers = problem.slicing.num_layers
        stages = self.num_stages or num_layers
        if stages > num_layers:
            raise MethodOptionError(f"UniformStageOption(num_stages={stages}) but the step has {num_layers} layers")
        devices = problem.cluster.num_devices
        if self.submesh_physical_shape is None and devices % stages:
            raise MethodOptionError(
                f"uniform stages: {devices} devices do not split evenly over {stages} stages (one per layer unless "
                "num_stages says): use AutoLayerOption(layer_num=...) with a divisor of the device count, or "
                "stage_option='auto'")
        from alpa_lab.passes.submesh import even_submesh  # here: importing this module (alpa_lab's does) loads no pass

        flops = [sum(problem.graph.ops[i].flops for i in problem.slicing.ops_of([layer])) for layer in range(num_layers)]
        ranges = balanced_ranges(flops, stages)
        if self.submesh_physical_shape is not None:
            shape = tuple(self.submesh_physical_shape)
        else:
            shape = even_submesh(problem.cluster.hosts, problem.cluster.devices_per_host, stages)
        logical = shape if self.submesh_logical_shape is None else tuple(self.submesh_logical_shape)
        return ranges, [shape] * stages, [logical] * stages

    def batch_axes(self, num_stages: int) -> list[int | None]:
        """Every stage's forced batch axis from ``submesh_autosharding_option`` (None: the method's default)."""
        return [_dict_axis(self.submesh_autosharding_option or {})] * num_stages


def balanced_ranges(costs: Sequence[float], parts: int) -> list[list[int]]:
    """``costs`` cut into ``parts`` contiguous non-empty [first, last] ranges whose largest sum is least (a DP)."""
    n = len(costs)
    prefix = np.concatenate([[0.0], np.cumsum(np.asarray(costs, dtype=float))])
    # best[k][i]: the least largest sum cutting the first i items into k ranges; cut[k][i]: where the last starts
    best = np.full((parts + 1, n + 1), np.inf)
    cut = np.zeros((parts + 1, n + 1), dtype=int)
    best[0][0] = 0.0
    for k in range(1, parts + 1):
        for i in range(k, n - (parts - k) + 1):
            for j in range(k - 1, i):
                value = max(best[k - 1][j], prefix[i] - prefix[j])
                if value < best[k][i]:
                    best[k][i], cut[k][i] = value, j
    ranges, i = [], n
    for k in range(parts, 0, -1):
        j = cut[k][i]
        ranges.append([int(j), int(i - 1)])
        i = j
    return ranges[::-1]


def _check_option_dict(d: Any) -> None:
    """A per-stage auto-sharding dict of Alpa's (``{}`` or ``{"force_batch_dim_to_mesh_dim": 0}`` as its DP writes
    them): the forced batch axis is honoured for that stage; anything else is refused, so no per-stage method is
    silently dropped."""
    if not isinstance(d, dict):
        raise MethodOptionError(f"a stage's auto-sharding option must be a dict, got {d!r}")
    other = sorted(set(d) - {"force_batch_dim_to_mesh_dim"})
    if other:
        raise MethodOptionError(
            f"per-stage auto-sharding option(s) {other} are not supported (only force_batch_dim_to_mesh_dim): "
            "choose one method for every stage with default_auto_sharding_option, or pin a stage's ops on the plan")
    _dict_axis(d)


def _dict_axis(d: Mapping[str, Any]) -> int | None:
    """A per-stage dict's forced batch axis: 0 or 1, -1 where it says "not forced" (Alpa's -1 or None), None without
    the key (the method's default applies)."""
    if "force_batch_dim_to_mesh_dim" not in d:
        return None
    return _mesh_axis_option(d["force_batch_dim_to_mesh_dim"], "a stage's force_batch_dim_to_mesh_dim")


_FORCE_OPTION = "AutoShardingOption(force_batch_dim_to_mesh_dim=...)"


def _mesh_axis_option(axis: Any, what: str) -> int:
    """Alpa's ``force_batch_dim_to_mesh_dim`` value: 0 or 1, or -1 (also for None): not forced."""
    if axis is None:
        return -1
    if isinstance(axis, bool) or not isinstance(axis, (int, np.integer)) or axis not in (-1, 0, 1):
        raise MethodOptionError(f"{what} must be a mesh axis, 0 or 1 (or -1: not forced), got {axis!r}")
    return int(axis)


# ----- methods ---------------------------------------------------------------------------------
class ParallelMethod:
    """A way to parallelize a step: ``options()`` are the ``parallelize`` keyword arguments it means.

    ``ShardParallel`` (and its data-parallel kin) and ``PipeshardParallel`` are mutable, as Alpa's: its tests set
    ``method.devices = ...`` or ``method.as_option = ...`` before ``parallelize``, which reads them once.
    """

    def options(self) -> dict[str, Any]:  # pragma: no cover - every method overrides it
        raise NotImplementedError


class _Unspecified:
    """A placement left to the planner (pjit's and Alpa's ``UNSPECIFIED``; ``None`` there means replicated)."""

    def __repr__(self) -> str:
        return "UNSPECIFIED"


UNSPECIFIED = _Unspecified()


def _is_unspecified(x: Any) -> bool:
    return x is UNSPECIFIED or type(x).__name__ in ("UnspecifiedValue", "_UnspecifiedValue")


@dataclass(frozen=True)
class ManualShardingOption:
    """Alpa's manual shardings, in pjit's terms: ``mesh_axis_names`` name the axes of the plan's logical mesh (rows,
    columns); ``in_axis_resources`` gives, per argument (a prefix of the arguments' tree), a
    ``jax.sharding.PartitionSpec`` over those names, ``None`` for replicated or ``UNSPECIFIED`` for the planner's
    choice; ``out_axis_resources`` the same for the results. They become pins (``plan.pins``: an argument's path, a
    result's ``output <path>``), so the ILP plans everything else around them and a later ``plan.unpin`` can free one.

    In a pipeline (``PipeshardParallel``), ``submesh_axis_names`` name each stage's logical mesh axes (one tuple per
    stage; without it every stage's are ``mesh_axis_names``): each argument is held as its resource says by every
    stage that reads it, in that stage's names. A pipeline's results are each stage's own: ``out_axis_resources``
    is for one mesh."""

    mesh_axis_names: Sequence[str] | None = None
    submesh_axis_names: Any = None
    in_axis_resources: Any = UNSPECIFIED
    out_axis_resources: Any = UNSPECIFIED

    def __post_init__(self) -> None:
        if self.submesh_axis_names is not None:
            stages = self.submesh_axis_names
            if isinstance(stages, str) or not isinstance(stages, (tuple, list)) or not stages:
                raise MethodOptionError(
                    f"ManualShardingOption(submesh_axis_names=...) names each pipeline stage's mesh axes, one tuple of one or "
                    f"two distinct strings per stage (e.g. (('dummy', 'model'), ('dummy', 'data'))), got {stages!r}")
            for i, names in enumerate(stages):
                _check_axis_names(names, f"submesh_axis_names[{i}]")
        if self.mesh_axis_names is not None or self.submesh_axis_names is None:
            _check_axis_names(self.mesh_axis_names, "mesh_axis_names")

    def stage_axis_names(self, num_stages: int) -> list[tuple[str, ...]]:
        """Each pipeline stage's mesh axis names (``submesh_axis_names``, else ``mesh_axis_names`` for all)."""
        if self.submesh_axis_names is None:
            return [tuple(self.mesh_axis_names)] * num_stages
        if len(self.submesh_axis_names) != num_stages:
            raise MethodOptionError(
                f"ManualShardingOption(submesh_axis_names=...) names {len(self.submesh_axis_names)} stages' mesh axes but the "
                f"pipeline has {num_stages} stages: give one tuple per stage (fix the stages with a ManualStageOption)")
        return [tuple(n) for n in self.submesh_axis_names]

    def mesh_axes(self, mesh_shape: tuple[int, int], names: Sequence[str] | None = None) -> dict[str, int]:
        """Each name's axis of the plan's ``mesh_shape`` (``names``: a stage's, else ``mesh_axis_names``): two names
        are (rows, columns); one is the mesh's axis of more than one device (the columns of a 1 x n mesh)."""
        if names is None and self.mesh_axis_names is None:
            raise MethodOptionError("this ManualShardingOption names only pipeline stages' axes (submesh_axis_names): "
                                    "give mesh_axis_names for a plan on one mesh (ShardParallel)")
        names = tuple(self.mesh_axis_names if names is None else names)
        if len(names) == 2:
            return {names[0]: 0, names[1]: 1}
        wide = [a for a in (0, 1) if mesh_shape[a] > 1]
        if len(wide) > 1:
            raise MethodOptionError(
                f"ManualShardingOption names one mesh axis ({names[0]!r}) but the plan's mesh is {mesh_shape[0]}x{mesh_shape[1]}: "
                "name both axes (rows, columns)")
        return {names[0]: wide[0] if wide else 1}

    def pins(self, in_paths: Sequence[str], in_shapes: Sequence[tuple[int, ...]], args: tuple,
             out_paths: Sequence[str], out_shapes: Sequence[tuple[int, ...]], results: Any,
             mesh_shape: tuple[int, int]) -> dict[str, str]:
        """The pins these resources mean for a step called with ``args`` (whose flat leaves are ``in_paths`` of
        ``in_shapes``) returning ``results`` (``out_paths`` of ``out_shapes``), planned on ``mesh_shape``."""
        axes = self.mesh_axes(mesh_shape)
        pins: dict[str, str] = {}
        for what, resources, tree, paths, shapes, key in (
                ("in_axis_resources", self.in_axis_resources, tuple(args), in_paths, in_shapes, ""),
                ("out_axis_resources", self.out_axis_resources, results, out_paths, out_shapes, "output ")):
            flat = _per_leaf(resources, tree, what)
            if len(flat) != len(paths):  # the tree given is not the traced program's (a bug of ours, said)
                raise MethodOptionError(f"ManualShardingOption({what}=...): {len(flat)} places for {len(paths)} tensors")
            for path, shape, spec in zip(paths, shapes, flat):
                if not _is_unspecified(spec):
                    pins[key + path] = _spec_text(spec, shape, axes, mesh_shape, f"{what} for {path}")
        return pins

    def stage_pins(self, in_paths: Sequence[str], in_shapes: Sequence[tuple[int, ...]], args: tuple,
                   stages: Sequence[tuple[tuple[int, int], Sequence[str]]]) -> dict[str, str]:
        """The pins ``in_axis_resources`` mean in a pipeline: ``stages`` gives each stage's logical mesh shape and the
        argument paths it reads; an argument read by several stages must come out the same spec in each."""
        if not _is_unspecified(self.out_axis_resources):
            raise MethodOptionError(
                "ManualShardingOption(out_axis_resources=...) lays out a single mesh's results; a pipeline's results are "
                "each stage's own: drop it (or pin the op that makes a result in its stage)")
        flat = _per_leaf(self.in_axis_resources, tuple(args), "in_axis_resources")
        if len(flat) != len(in_paths):
            raise MethodOptionError(f"ManualShardingOption(in_axis_resources=...): {len(flat)} places for {len(in_paths)} tensors")
        given = {p: (shape, spec) for p, shape, spec in zip(in_paths, in_shapes, flat) if not _is_unspecified(spec)}
        pins: dict[str, str] = {}
        owner: dict[str, int] = {}
        for i, (names, (mesh_shape, reads)) in enumerate(zip(self.stage_axis_names(len(stages)), stages)):
            axes = self.mesh_axes(mesh_shape, names)
            for path in reads:
                if path not in given:
                    continue
                shape, spec = given[path]
                text = _spec_text(spec, shape, axes, mesh_shape, f"in_axis_resources for {path} on stage {i}")
                if pins.setdefault(path, text) != text:
                    raise MethodOptionError(
                        f"in_axis_resources for {path}: stages {owner[path]} and {i} both read it, and {spec} means "
                        f"{pins[path]!r} on stage {owner[path]}'s mesh but {text!r} on stage {i}'s: give it a resource that "
                        "means one layout on both (their axis names), or leave it UNSPECIFIED")
                owner.setdefault(path, i)
        return pins


def _check_axis_names(names: Any, what: str) -> None:
    if names is None or isinstance(names, str) or not all(isinstance(n, str) for n in names) or not 1 <= len(names) <= 2 \
            or len(set(names)) != len(names):
        raise MethodOptionError(
            f"ManualShardingOption({what}=...) names a logical mesh's axes, one or two distinct strings "
            f"(e.g. ('data', 'model')), got {names!r}")


def _is_resource(x: Any) -> bool:
    import jax

    return x is None or _is_unspecified(x) or isinstance(x, jax.sharding.PartitionSpec)


def _per_leaf(resources: Any, tree: Any, what: str) -> list[Any]:
    """``resources`` (a prefix of ``tree``: one entry may stand for a whole subtree) as one entry per leaf of ``tree``."""
    import jax

    n = len(jax.tree_util.tree_leaves(tree))
    if _is_resource(resources):  # one for everything (a function of one argument passes it bare, as pjit allows)
        return [resources] * n
    if isinstance(tree, tuple) and isinstance(resources, list):
        resources = tuple(resources)
    try:
        groups = jax.tree_util.tree_map(lambda r, sub: _Leaves(r, len(jax.tree_util.tree_leaves(sub))), resources, tree,
                                        is_leaf=_is_resource)
    except (ValueError, TypeError) as exc:
        raise MethodOptionError(
            f"ManualShardingOption({what}=...) must have the structure of the step's "
            f"{'arguments' if what.startswith('in') else 'results'} (or a prefix of it), with a PartitionSpec, None "
            f"(replicated) or UNSPECIFIED at each place; they are {jax.tree_util.tree_structure(tree)} "
            f"({str(exc).splitlines()[0]})") from exc
    flat = jax.tree_util.tree_leaves(groups, is_leaf=lambda x: isinstance(x, _Leaves))
    return [g.resource for g in flat for _ in range(g.count)]


class _Leaves:
    """One resource standing for ``count`` leaves (a pytree leaf itself, unlike a list the user may have written)."""

    def __init__(self, resource: Any, count: int) -> None:
        self.resource, self.count = resource, count


def _spec_text(spec: Any, shape: tuple[int, ...], axes: Mapping[str, int], mesh_shape: tuple[int, int], where: str) -> str:
    """A PartitionSpec over named mesh axes as this planner's sharding spec text (``P(None, 'model')`` -> ``"RS1"``).
    An axis of one device splits nothing: it is left out (a 1 x 8 mesh's ``P('data')`` is replicated)."""
    if spec is None or len(spec) == 0:
        return "R" * len(shape) or "-"
    if len(spec) > len(shape):
        raise MethodOptionError(f"{where}: {spec} has {len(spec)} entries for a tensor of rank {len(shape)} {tuple(shape)}")
    tokens, used = [], []
    for dim, entry in enumerate(tuple(spec) + (None,) * (len(shape) - len(spec))):
        if entry is not None and not isinstance(entry, (str, tuple, list)):  # P.UNCONSTRAINED and the like
            raise MethodOptionError(f"{where}: {spec} has {entry!r} for dimension {dim}; give mesh axis names, None "
                                    "(not split) or UNSPECIFIED for the whole tensor (the planner's choice)")
        names = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
        unknown = [n for n in names if n not in axes]
        if unknown:
            raise MethodOptionError(f"{where}: {spec} names mesh axis {unknown[0]!r}; the mesh's axes are {', '.join(map(repr, axes))}")
        if any(n in used for n in names) or len(set(names)) != len(names):
            raise MethodOptionError(f"{where}: {spec} splits over a mesh axis twice; each axis can split one dimension once")
        used += names
        split = [axes[n] for n in names if mesh_shape[axes[n]] > 1]
        ways = math.prod(mesh_shape[a] for a in split)
        if shape[dim] % ways:
            raise MethodOptionError(f"{where}: {spec} splits dimension {dim} (of {shape[dim]}) {ways} ways, which does not "
                                    f"divide it on the {mesh_shape[0]}x{mesh_shape[1]} mesh")
        tokens.append("S" + "".join(map(str, split)) if split else "R")
    return "".join(tokens)


# ----- devices ---------------------------------------------------------------------------------
def _first_devices(devices: Sequence[Any], what: str) -> None:
    """Plans place mesh device ``i`` on ``jax.devices()[i]``: a device set must be the first ones JAX lists."""
    import jax

    have, ids = list(jax.devices()), [getattr(d, "id", d) for d in devices]
    if ids != [d.id for d in have[: len(devices)]]:
        raise MethodOptionError(
            f"{what}: devices {ids} are not the first {len(devices)} of "
            f"jax.devices() ({[d.id for d in have]}); a plan runs on the first devices of its cluster: pass "
            f"jax.devices()[:{len(devices)}]")


@dataclass(frozen=True)
class LogicalDeviceMesh:
    """Alpa's logical mesh: devices viewed as a 2-D grid whose axis ``i`` costs ``mesh_alpha[i] +
    mesh_beta[i] * bytes`` per collective (Alpa's alpha-beta model, in whatever unit the numbers are).

    As ``ShardParallel(devices=...)`` it plans on exactly this grid with these costs: the cluster it means
    (``cluster_spec``) has ``shape[0]`` "hosts" of ``shape[1]`` devices, axis 0 priced by ``mesh_alpha[0]`` /
    ``mesh_beta[0]`` and axis 1 by the others. Alpa's tests use ``mesh_alpha = mesh_beta = [1, 1]``: costs
    in bytes, next to which every compute cost is nil, as in Alpa's ILP.
    """

    devices: tuple[Any, ...]
    shape: tuple[int, int]
    mesh_alpha: tuple[float, float] = (1.0, 1.0)
    mesh_beta: tuple[float, float] = (1.0, 1.0)

    def __post_init__(self) -> None:
        shape = tuple(int(n) for n in self.shape)
        if len(shape) != 2 or min(shape) < 1:
            raise MethodOptionError(f"a logical mesh is 2-D with positive sizes, got shape {self.shape!r}")
        if math.prod(shape) != len(self.devices):
            raise MethodOptionError(f"a {shape[0]}x{shape[1]} logical mesh needs {math.prod(shape)} devices, given {len(self.devices)}")
        for name in ("mesh_alpha", "mesh_beta"):
            value = tuple(float(x) for x in getattr(self, name))
            if len(value) != 2 or min(value) < 0:
                raise MethodOptionError(f"{name} must be two non-negative numbers (one per mesh axis), got {getattr(self, name)!r}")
            object.__setattr__(self, name, value)
        if min(self.mesh_beta) <= 0:
            raise MethodOptionError(f"mesh_beta must be positive (seconds or cost per byte), got {self.mesh_beta!r}")
        object.__setattr__(self, "shape", shape)
        object.__setattr__(self, "devices", tuple(self.devices))

    @property
    def num_devices(self) -> int:
        return len(self.devices)

    @property
    def flatten_ids(self) -> tuple[int, ...]:
        return tuple(getattr(d, "id", d) for d in self.devices)

    def _collective_cost(self, kind: str, num_bytes: float, mesh_dim: int) -> float:
        if mesh_dim not in (0, 1):
            raise MethodOptionError(f"mesh_dim must be 0 or 1 (the mesh's axes), got {mesh_dim!r}")
        return self.cluster_spec().logical_mesh(self.shape).collective_cost(kind, float(num_bytes), (mesh_dim,))

    def all_reduce_cost(self, num_bytes: float, mesh_dim: int) -> float:
        """What the planner charges an all-reduce of ``num_bytes`` over mesh axis ``mesh_dim``: alpha + beta * 2 (n - 1)
        / n * bytes (Alpa's tests build their expected objectives from it)."""
        return self._collective_cost("all-reduce", num_bytes, mesh_dim)

    def all_gather_cost(self, num_bytes: float, mesh_dim: int) -> float:
        """An all-gather producing ``num_bytes`` over ``mesh_dim``: alpha + beta * (n - 1) / n * bytes."""
        return self._collective_cost("all-gather", num_bytes, mesh_dim)

    def reduce_scatter_cost(self, num_bytes: float, mesh_dim: int) -> float:
        """A reduce-scatter of ``num_bytes`` over ``mesh_dim``: alpha + beta * (n - 1) / n * bytes."""
        return self._collective_cost("reduce-scatter", num_bytes, mesh_dim)

    def all_to_all_cost(self, num_bytes: float, mesh_dim: int) -> float:
        """An all-to-all of a tensor of ``num_bytes`` (all of it, as Alpa's tests count) over ``mesh_dim``, as the planner
        prices it: each device sends (n - 1) / n of its tile, ``num_bytes / n`` (alpha + beta * (n - 1) / n * tile; Alpa's
        implementation multiplies the bytes term by an empirical n / 2, which the paper's Table 2 does not)."""
        n = self.shape[mesh_dim] if mesh_dim in (0, 1) else 1
        return self._collective_cost("all-to-all", num_bytes / max(n, 1), mesh_dim)

    def flatten(self) -> LogicalDeviceMesh:
        """The same devices as one line (an n x 1 grid), each axis priced as the slower of this grid's: a collective
        over all of them crosses the slower links."""
        return LogicalDeviceMesh(self.devices, (self.num_devices, 1), (max(self.mesh_alpha),) * 2, (max(self.mesh_beta),) * 2)

    def cluster_spec(self) -> Any:
        """The cluster this grid means to the planner (see the class docstring)."""
        from alpa_lab.cost.cluster import ClusterSpec

        return ClusterSpec(
            hosts=self.shape[0], devices_per_host=self.shape[1],
            inter_host_latency=self.mesh_alpha[0], inter_host_bandwidth=1.0 / self.mesh_beta[0],
            intra_host_latency=self.mesh_alpha[1], intra_host_bandwidth=1.0 / self.mesh_beta[1],
            name=f"logical mesh {self.shape[0]}x{self.shape[1]}, alpha {list(self.mesh_alpha)}, beta {list(self.mesh_beta)}")


@dataclass(frozen=True)
class LocalPhysicalDeviceMesh:
    """Alpa's mesh of this process's devices (default: all of them), for ``get_logical_mesh``."""

    devices: tuple[Any, ...] | None = None

    def __post_init__(self) -> None:
        import jax

        devices = tuple(jax.local_devices() if self.devices is None else self.devices)
        if not devices:
            raise MethodOptionError("LocalPhysicalDeviceMesh needs at least one device")
        object.__setattr__(self, "devices", devices)

    @property
    def num_devices(self) -> int:
        return len(self.devices)

    @property
    def num_hosts(self) -> int:
        return 1

    @property
    def num_devices_per_host(self) -> int:
        return len(self.devices)

    def get_logical_mesh(
        self, mesh_shape: Sequence[int] | None = None, mesh_alpha: Sequence[float] | None = None,
        mesh_beta: Sequence[float] | None = None, mesh_topology: Any = None,
        intra_host_bandwidth: float | None = None, inter_host_bandwidth: float | None = None,
    ) -> LogicalDeviceMesh:
        """These devices as a ``mesh_shape`` grid (default 1 x all) with Alpa's per-axis costs (default 1 and 1)."""
        if mesh_topology is not None or intra_host_bandwidth is not None or inter_host_bandwidth is not None:
            raise MethodOptionError(
                "get_logical_mesh(mesh_topology / *_host_bandwidth) is not supported: give mesh_alpha and mesh_beta, or "
                "plan with parallelize(cluster=al.ClusterSpec(...)) for a cluster's measured links")
        shape = (1, self.num_devices) if mesh_shape is None else tuple(mesh_shape)
        return LogicalDeviceMesh(self.devices, shape, tuple(mesh_alpha or (1.0, 1.0)), tuple(mesh_beta or (1.0, 1.0)))


def _stage_input_shardings(given: Any) -> tuple[tuple[str, ...], ...]:
    """Alpa's ``stage_input_shardings``: per stage, the sharding spec of each of its inputs in order (what an
    executable's ``stage_input_shard_specs`` gives), as spec strings; checked against the stages once planned."""
    try:
        if isinstance(given, str) or any(isinstance(stage, str) for stage in given):
            raise TypeError  # a spec where a stage's list belongs
        return tuple(tuple(str(spec) for spec in stage) for stage in given)
    except TypeError:
        raise MethodOptionError(
            "PipeshardParallel(stage_input_shardings=...) takes one list of sharding specs per stage (an executable's "
            f"stage_input_shard_specs), got {type(given).__name__}") from None


def _mesh_options(devices: Any, name: str) -> dict[str, Any]:
    """``parallelize``'s cluster (and mesh shape) for Alpa's ``devices=``: a logical mesh plans on that grid with its
    costs; a physical mesh is its devices with this machine's cost model, every grid tried."""
    if devices is None:
        return {}
    if isinstance(devices, (list, tuple)) and devices and all(hasattr(d, "platform") and hasattr(d, "id") for d in devices):
        devices = LocalPhysicalDeviceMesh(tuple(devices))  # Alpa's tests pass jax.local_devices()[:4] as it is
    if isinstance(devices, LogicalDeviceMesh):
        _first_devices(devices.devices, f"{name}(devices=<{devices.shape[0]}x{devices.shape[1]} logical mesh>)")
        return {"cluster": devices.cluster_spec(), "mesh_shape": devices.shape}
    if isinstance(devices, LocalPhysicalDeviceMesh):
        from alpa_lab.cost.cluster import ClusterSpec

        _first_devices(devices.devices, f"{name}(devices=<physical mesh>)")
        return {"cluster": ClusterSpec.local(1, devices.num_devices)}
    from alpa_lab.runtime.ray_cluster import VirtualPhysicalMesh  # loads no Ray

    if isinstance(devices, VirtualPhysicalMesh):
        if getattr(devices.cluster, "_closed", False):
            raise MethodOptionError(f"{name}(devices=...): that virtual mesh's Ray cluster was shut down; take one of the "
                                    "running cluster's (get_global_cluster().get_virtual_physical_mesh())")
        return {"cluster": devices.spec, "ray_cluster": devices.cluster}
    raise MethodOptionError(
        f"{name}(devices=...) takes a list of JAX devices, a LogicalDeviceMesh, a LocalPhysicalDeviceMesh or a Ray "
        "cluster's VirtualPhysicalMesh "
        f"(get_global_cluster().get_virtual_physical_mesh()), got {type(devices).__name__}; or leave it out and pass "
        "parallelize(cluster=al.ClusterSpec.local(hosts, devices_per_host))")


@dataclass
class ShardParallel(ParallelMethod):
    """Intra-op parallelism only: one mesh of every device, sharded by the ILP (Alpa's default method).

    ``devices``: a ``LogicalDeviceMesh`` (``LocalPhysicalDeviceMesh().get_logical_mesh(shape, alpha, beta)``)
    plans on that grid with its costs; a ``LocalPhysicalDeviceMesh`` on its devices; a ``VirtualPhysicalMesh``
    for that part of its Ray cluster, where the step then runs. ``num_micro_batches``:
    gradient accumulation over that many micro-batches (one pipeline stage on every device, each
    micro-batch's gradients summed). ``as_option`` is the ``AutoShardingOption``, as in Alpa.
    """

    devices: Any = None
    num_micro_batches: int | None = None
    auto_sharding_option: AutoShardingOption | None = None
    manual_sharding_option: Any = None

    def __post_init__(self) -> None:
        if self.auto_sharding_option is None:  # one object to mutate, as Alpa's method.as_option
            object.__setattr__(self, "auto_sharding_option", AutoShardingOption())

    @property
    def as_option(self) -> AutoShardingOption:
        return self.auto_sharding_option

    @as_option.setter
    def as_option(self, option: AutoShardingOption) -> None:
        self.auto_sharding_option = option

    def options(self) -> dict[str, Any]:
        out: dict[str, Any] = {  # never None: __post_init__
            "method": self.auto_sharding_option.method_name(manual=self.manual_sharding_option is not None)}
        if self.manual_sharding_option is not None:
            if not isinstance(self.manual_sharding_option, ManualShardingOption):
                raise MethodOptionError(f"ShardParallel(manual_sharding_option=...) takes a ManualShardingOption, got "
                                        f"{type(self.manual_sharding_option).__name__}")
            if self.num_micro_batches not in (None, 1):
                raise MethodOptionError("ShardParallel(manual_sharding_option=...) with num_micro_batches is not supported: "
                                        "drop one of them")
            out["manual_sharding"] = self.manual_sharding_option
        out.update(_mesh_options(self.devices, type(self).__name__))
        axis = _mesh_axis_option(self.auto_sharding_option.force_batch_dim_to_mesh_dim, _FORCE_OPTION)
        if axis != -1 and out["method"] == "alpa":  # force_data_parallel / ZeRO: the batch over every device
            out["batch_mesh_axis"] = axis
        if out["method"] == "alpa" and not self.auto_sharding_option.prefer_reduce_scatter:
            out["weight_update_sharding"] = False  # Alpa's ShardParallel splits the weight update only when asked
        if self.auto_sharding_option.forbidden_collectives():
            out["forbidden"] = self.auto_sharding_option.forbidden_collectives()
        if self.num_micro_batches is not None and self.num_micro_batches != 1:
            # a logical mesh as devices: the one stage is viewed as that grid (its costs are the cluster's)
            stage = _WholeCluster(out.pop("mesh_shape", None))
            out.update(microbatches=self.num_micro_batches, layers=1, stage_option=stage)
        return out


@dataclass(frozen=True, eq=False)
class CreateStateParallel(ParallelMethod):
    """Alpa's: ``parallelize(create_state, method=CreateStateParallel(p_train_step, other_args))`` makes the
    training state where ``p_train_step``'s plan reads it, each mesh computing only its own part of it.

    ``train_step``: the parallelized step the state is for (``parallelize(train_step, ...)``); ``other_args``:
    its argument after the state (the batch: arrays or ``jax.ShapeDtypeStruct``s), as Alpa calls
    ``train_step.get_executable(state, other_args)``: a step of more arguments gets them as a tuple in
    ``other_args=al.CreateStateParallel.Args(batch, rng)``. ``api.StateCreator`` runs it."""

    train_step: Any
    other_args: Any

    @dataclass(frozen=True)
    class Args:
        """Several arguments after the state: ``CreateStateParallel(step, CreateStateParallel.Args(batch, rng))``."""

        values: tuple

        def __init__(self, *values: Any) -> None:
            object.__setattr__(self, "values", values)

    def step_args(self) -> tuple:
        """The train step's arguments after the state."""
        return self.other_args.values if isinstance(self.other_args, CreateStateParallel.Args) else (self.other_args,)

    def options(self) -> dict[str, Any]:
        raise MethodOptionError(
            "CreateStateParallel makes a state for another step's plan; it has no planning options of its own: "
            "pass it to parallelize(create_state, method=...)")


@dataclass(frozen=True, eq=False)
class FollowParallel(ParallelMethod):
    """Alpa's: ``parallelize(eval_step, method=FollowParallel(p_train_step))`` plans a step (an evaluation) on
    the mesh of another step's single-mesh plan, its arguments held where that plan holds them, so the
    state passes between the two without being moved.

    ``get_input_placement_specs``: a function returning the ``PlacementSpec`` pytree of this step's
    arguments (None: Alpa's default, the source's last executable's ``(state.params, batch)``). A leaf whose
    spec is None is planned freely, and so is one whose followed spec does not fit its shape (an evaluation
    batch of another size). The step re-plans when the source's plan changes. Following a pipelined step makes
    this one Alpa's inference pipeline over the source's stages (the same layers, sub-meshes, logical meshes and
    devices; each weight in the source's layout; ``num_micro_batches`` micro-batches, default the source's), run in
    this process (``ParallelizedStep._follow_pipeline``). ``pipeline_schedule`` and ``layer_option`` are accepted
    for Alpa's signature (the layers are the source's); on one mesh ``num_micro_batches`` changes nothing (an
    evaluation has no gradients to accumulate). ``ParallelizedStep._follow`` reads the placements."""

    src_func: Any
    num_micro_batches: int | None = None
    get_input_placement_specs: Any = None
    pipeline_schedule: str = "inference"
    layer_option: Any = "follow"

    def __post_init__(self) -> None:
        if self.get_input_placement_specs is not None and not callable(self.get_input_placement_specs):
            raise MethodOptionError("FollowParallel(get_input_placement_specs=...) must be a function returning the "
                                    "arguments' PlacementSpec pytree")

    def options(self) -> dict[str, Any]:
        return {"method": "alpa"}


@dataclass(frozen=True, eq=False)
class PlanMethod(ParallelMethod):
    """A step that runs a plan made before (Alpa's ``plan_to_method(executable.get_parallel_plan())``): the plan's
    cluster, mesh and, for a pipeline, its micro-batches, layers and schedule; the step uses the plan as
    ``step.use(plan)`` does (checked against the step's program on the first call) instead of planning. A
    plan made with ``remat=True`` needs the step traced so too: use ``parallelize(fn, ..., remat=True)``
    and ``step.use(plan)`` for it."""

    plan: Any

    def __post_init__(self) -> None:
        if not (hasattr(self.plan, "fingerprint") and hasattr(self.plan, "cluster") and hasattr(self.plan, "to_json")):
            raise MethodOptionError(f"plan_to_method takes a Plan or a PipelinePlan (executable.get_parallel_plan(), or "
                                    f"al.Plan.load(path)), got {type(self.plan).__name__}")

    def options(self) -> dict[str, Any]:
        from alpa_lab.cost.cluster import ClusterSpec

        plan = self.plan
        out: dict[str, Any] = {"method": plan.method, "cluster": ClusterSpec(**plan.cluster)}
        if hasattr(plan, "stages"):  # a pipeline
            out.update(microbatches=plan.num_microbatches, layers=plan.num_layers, schedule=plan.schedule,
                       submesh_space=plan.submesh_space)
            if not all(st.plan.weight_update_sharding for st in plan.stages):
                out["weight_update_sharding"] = False
        else:
            out["mesh_shape"] = tuple(plan.mesh_shape)
            if plan.batch_mesh_axis is not None:
                out["batch_mesh_axis"] = plan.batch_mesh_axis
            if not plan.weight_update_sharding:
                out["weight_update_sharding"] = False
        return out


def plan_to_method(plan: Any) -> PlanMethod:
    """Alpa's name: the method that runs ``plan`` (a ``Plan`` or ``PipelinePlan``, e.g. loaded from JSON)."""
    return PlanMethod(plan)


@dataclass
class DataParallel(ShardParallel):
    """Data parallelism: weights replicated, the batch split over every device, gradients all-reduced.

    The method fixes how the arguments are stored, and every op making a tensor with a batch dimension keeps it
    split over the devices where it can (``passes.methods``: ops you pin excepted); the ILP chooses the rest (how
    a weight's gradient is summed)."""

    auto_sharding_option: AutoShardingOption | None = field(
        default_factory=lambda: AutoShardingOption(force_data_parallel=True, prefer_reduce_scatter=False), init=False)


@dataclass
class Zero2Parallel(ShardParallel):
    """ZeRO-2: gradients reduce-scattered, optimizer state partitioned."""

    auto_sharding_option: AutoShardingOption | None = field(
        default_factory=lambda: AutoShardingOption(force_data_parallel=True, prefer_reduce_scatter=True), init=False)


@dataclass
class Zero3Parallel(ShardParallel):
    """ZeRO-3: weights partitioned too, gathered where used."""

    auto_sharding_option: AutoShardingOption | None = field(
        default_factory=lambda: AutoShardingOption(force_zero_stage_3=True), init=False)


@dataclass
class PipeshardParallel(ParallelMethod):
    """Inter- and intra-op parallelism: layers grouped into pipeline stages on sub-meshes, each stage sharded.

    ``layer_option``: ``AutoLayerOption(layer_num=...)`` (default 2 layers, as Alpa 0.2), or "manual" /
    ``ManualLayerOption()`` for your ``mark_pipeline_boundary()`` calls. ``stage_option``: "auto" /
    ``AutoStageOption()`` (the stage DP), ``ManualStageOption(...)``, or "uniform" / ``UniformStageOption()``
    (Alpa's default). ``pipeline_schedule``: "1f1b" or "gpipe" (and this planner's others), or "inference" for a
    step without gradients (an evaluation: its forward pipelined over the stages). ``devices``: the
    cluster to plan for, as ``ShardParallel``'s (a ``VirtualPhysicalMesh``: part of a Ray cluster, run there).
    ``stage_input_shardings``: per stage, a sharding spec for each of its inputs (an executable's
    ``stage_input_shard_specs``, to plan another batch size with the same layouts): pinned once the stages are
    chosen, and refused by name where the stages or their inputs do not match.
    """

    devices: Any = None
    num_micro_batches: int = 1
    default_auto_sharding_option: AutoShardingOption | None = None
    pipeline_schedule: str = "1f1b"
    layer_option: Any = None
    stage_option: Any = None
    stage_input_shardings: Any = None
    manual_sharding_option: Any = None

    def __post_init__(self) -> None:
        if self.default_auto_sharding_option is None:  # Alpa's default, one object to mutate through as_option
            object.__setattr__(self, "default_auto_sharding_option", AutoShardingOption(prefer_reduce_scatter=True))

    @property
    def as_option(self) -> AutoShardingOption:
        """Every stage's ``AutoShardingOption`` (Alpa's name; its tests set fields on it before planning)."""
        return self.default_auto_sharding_option

    @as_option.setter
    def as_option(self, option: AutoShardingOption) -> None:
        self.default_auto_sharding_option = option

    def options(self) -> dict[str, Any]:
        option = self.default_auto_sharding_option  # never None: __post_init__
        out: dict[str, Any] = {
            "method": option.method_name(manual=self.manual_sharding_option is not None),
            "microbatches": self.num_micro_batches,
            "schedule": self.pipeline_schedule,
        }
        # the devices' cluster (a logical mesh's grid is its hosts x devices: each stage chooses its own view)
        out.update({k: v for k, v in _mesh_options(self.devices, type(self).__name__).items() if k != "mesh_shape"})
        axis = _mesh_axis_option(option.force_batch_dim_to_mesh_dim, _FORCE_OPTION)
        if axis != -1 and out["method"] == "alpa":  # every stage keeps its batch split over that axis (a stage's dict may differ)
            out["batch_mesh_axis"] = axis
        if out["method"] == "alpa" and not option.prefer_reduce_scatter:
            out["weight_update_sharding"] = False  # Alpa's default option asks for it; an option without it does not
        if option.forbidden_collectives():
            out["forbidden"] = option.forbidden_collectives()
        if self.stage_input_shardings is not None:
            out["stage_input_shardings"] = _stage_input_shardings(self.stage_input_shardings)
        if self.manual_sharding_option is not None:
            if not isinstance(self.manual_sharding_option, ManualShardingOption):
                raise MethodOptionError(f"{type(self).__name__}(manual_sharding_option=...) takes a ManualShardingOption, got "
                                        f"{type(self.manual_sharding_option).__name__}")
            out["manual_sharding"] = self.manual_sharding_option
        layer = self.layer_option
        if layer is None:
            layer = AutoLayerOption(layer_num=2)
        elif layer == "manual":
            layer = ManualLayerOption()
        if isinstance(layer, AutoLayerOption):
            out.update(layers=int(layer.layer_num), remat=layer.remat_mode == "coarse_grained_remat")
        elif isinstance(layer, ManualLayerOption):  # your boundaries; none: the step is one layer, as in Alpa
            out.update(layers=1, remat=bool(layer.remat_layer))
        else:
            raise MethodOptionError(
                f"layer_option must be AutoLayerOption(layer_num=...), 'manual' or ManualLayerOption(), got {layer!r}")
        stage = self.stage_option
        if stage is None or stage == "uniform":
            stage = UniformStageOption()
        elif stage == "auto":
            stage = AutoStageOption()
        if isinstance(stage, AutoStageOption):  # its use_hlo_cost_model: parallelize(cost_model=...) says how stages are priced
            space = stage.submesh_physical_shape_space
            if space == "manual":  # the DP's sub-mesh shapes are the ones given
                from alpa_lab.passes.submesh import manual_space  # here: importing this module loads no pass

                try:
                    space = manual_space(stage.manually_specified_submeshes)
                except ValueError as err:
                    raise MethodOptionError(f"AutoStageOption: {err}") from None
            out.update(submesh_space=space, logical_meshes=stage.submesh_logical_shape_space)
        elif isinstance(stage, (ManualStageOption, UniformStageOption)):
            out["stage_option"] = stage
        else:
            raise MethodOptionError(
                f"stage_option must be 'auto', 'uniform', AutoStageOption(), ManualStageOption(...) or "
                f"UniformStageOption(...), got {stage!r}")
        return out


def get_3d_parallel_method(
    num_micro_batches: int, data_parallel: int, operator_parallel: int, pipeline_parallel: int,
    allow_degenerate_into_shard_parallel: bool = True, manual_layer_num: int | None = None,
    manual_sharding_option: Any = None,
) -> PipeshardParallel:
    """Alpa's 3-D parallelism by hand: ``pipeline_parallel`` stages of equal sub-meshes, each viewed as a
    ``data_parallel`` x ``operator_parallel`` logical mesh with the batch on its axis 0 (``data_parallel=-1``: the
    devices left over). Layers: ``pipeline_parallel`` of them, one per stage; or, with ``manual_layer_num``, your
    ``mark_pipeline_boundary()`` layers (a multiple of the stages) grouped into stages of balanced FLOPs.

    The devices are those steps without a ``cluster=`` plan for (``init("ray")``'s cluster, else this process's),
    as Alpa's global mesh. Each stage's physical sub-mesh is the cluster's even split (whole hosts, or part of
    one), as Alpa's. With one stage, Alpa returns a ``ShardParallel`` on a ``data_parallel`` x
    ``operator_parallel`` logical mesh; here it is that mesh as a one-stage pipeline (gradient accumulation
    over ``num_micro_batches``), priced by the cluster's own links, not by Alpa's unit alpha-beta costs
    (``allow_degenerate_into_shard_parallel`` therefore changes nothing).
    """
    from alpa_lab.api import get_global_num_devices  # at call time, as Alpa reads its global mesh

    sizes = {"data_parallel": data_parallel, "operator_parallel": operator_parallel, "pipeline_parallel": pipeline_parallel}
    for name, n in sizes.items():
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or (n < 1 and not (name == "data_parallel" and n == -1)):
            raise MethodOptionError(f"get_3d_parallel_method({name}=...) must be a positive integer"
                                    f"{' or -1 (the devices left over)' if name == 'data_parallel' else ''}, got {n!r}")
    devices = get_global_num_devices()
    if data_parallel == -1:
        if devices % (operator_parallel * pipeline_parallel):
            raise MethodOptionError(f"get_3d_parallel_method(data_parallel=-1): {devices} devices do not split into "
                                    f"{operator_parallel} x {pipeline_parallel} (operator x pipeline) parallel groups")
        data_parallel = devices // (operator_parallel * pipeline_parallel)
    if data_parallel * operator_parallel * pipeline_parallel != devices:
        raise MethodOptionError(
            f"get_3d_parallel_method: data x operator x pipeline parallel = {data_parallel} x {operator_parallel} x "
            f"{pipeline_parallel} = {data_parallel * operator_parallel * pipeline_parallel} devices, but there are "
            f"{devices} (pass data_parallel=-1 to use the rest)")
    stage = UniformStageOption(pipeline_parallel, None, (data_parallel, operator_parallel), {})
    if manual_layer_num is not None:
        if manual_layer_num % pipeline_parallel:
            raise MethodOptionError(f"get_3d_parallel_method(manual_layer_num={manual_layer_num}) must be a multiple of "
                                    f"pipeline_parallel={pipeline_parallel}: each stage gets as many of your layers")
        layer: Any = ManualLayerOption()
    else:
        layer = AutoLayerOption(layer_num=pipeline_parallel, eps=0.1)
    return PipeshardParallel(
        num_micro_batches=num_micro_batches,
        default_auto_sharding_option=AutoShardingOption(prefer_reduce_scatter=True, force_batch_dim_to_mesh_dim=0),
        layer_option=layer, stage_option=stage, manual_sharding_option=manual_sharding_option)


class ManualPipeshardParallel(PipeshardParallel):
    """``PipeshardParallel`` with the stages given (``ManualStageOption``) and layers at your boundaries."""

    def __init__(
        self,
        forward_stage_layer_ids: Sequence[Sequence[int]],
        submesh_physical_shapes: Sequence[Sequence[int]],
        submesh_logical_shapes: Sequence[Sequence[int]] | None = None,
        submesh_autosharding_option_dicts: Sequence[dict] | None = None,
        devices: Any = None,
        num_micro_batches: int = 1,
        default_auto_sharding_option: AutoShardingOption | None = None,
        pipeline_schedule: str = "1f1b",
    ):
        stage = ManualStageOption(forward_stage_layer_ids, submesh_physical_shapes, submesh_logical_shapes,
                                  submesh_autosharding_option_dicts)
        super().__init__(devices, num_micro_batches, default_auto_sharding_option, pipeline_schedule, "manual", stage)


@dataclass
class LocalPipelineParallel(PipeshardParallel):
    """Alpa's debugging method: the step cut at your ``mark_pipeline_boundary()`` calls (or Alpa's layer-construction
    decorators), one stage per piece, run in this process on one micro-batch, each stage a program of its own, so
    a pipeline's cutting and its numerics can be checked without a cluster. Alpa runs every stage on one device;
    here each stage gets an equal share of this process's devices (``UniformStageOption()``), so their number
    must divide by the number of pieces."""

    def __init__(self) -> None:
        super().__init__(None, 1, None, "1f1b", "manual", UniformStageOption())


@dataclass(frozen=True)
class _WholeCluster:
    """One stage of every layer on every device: gradient accumulation on a single mesh (``ShardParallel``'s
    ``num_micro_batches``). ``logical``: the stage's logical mesh where Alpa's ``devices=`` gave one (a
    ``LogicalDeviceMesh``, whose grid is the cluster's hosts x devices); None: the planner chooses the view."""

    logical: tuple[int, int] | None = None

    def assign(self, problem: Any) -> tuple[list[list[int]], list[tuple[int, int]], list[tuple[int, int]] | None]:
        from alpa_lab.passes.submesh import even_submesh

        c = problem.cluster
        submesh = even_submesh(c.hosts, c.devices_per_host, 1)
        return [[0, problem.slicing.num_layers - 1]], [submesh], None if self.logical is None else [tuple(self.logical)]

    def batch_axes(self, num_stages: int) -> list[int | None]:
        return [None] * num_stages


