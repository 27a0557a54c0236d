"""alpa_lab: Alpa's automatic parallelization planner on stock JAX, as a workbench.

The public surface; everything else is internal and may move::

    import alpa_lab as al
    cluster = al.ClusterSpec.local(hosts=1, devices_per_host=4)
    step = al.parallelize(train_step, cluster=cluster)
    plan = step.plan(state, batch)
    new_state, loss = step(state, batch)

Importing alpa_lab before JAX gives this process simulated CPU devices to run plans on
(8, or ``ALPA_LAB_CPU_DEVICES``), unless ``XLA_FLAGS`` already sets a count. It changes
nothing for GPUs; if JAX was imported first, the device count is what JAX already has.
"""

import os as _os
import sys as _sys

if "jax" not in _sys.modules and "xla_force_host_platform_device_count" not in _os.environ.get("XLA_FLAGS", ""):
    _count = _os.environ.get("ALPA_LAB_CPU_DEVICES", "8")
    _os.environ["XLA_FLAGS"] = f"{_os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={_count}".strip()

import importlib as _importlib

from alpa_lab.cost.cluster import PRESETS, ClusterError, ClusterSpec, LogicalMesh
from alpa_lab.graph.markers import (
    automatic_layer_construction, automatic_remat, grad, manual_layer_construction, manual_remat, mark_pipeline_boundary,
    mark_stage_boundary, value_and_grad,
)
from alpa_lab.graph.trace import TraceError, trace
from alpa_lab.plan import PinError, PipelinePlan, PlacementSpec, Plan, PlanFormatError, count_communication_primitives
from alpa_lab.sharding.constraints import DeviceError
from alpa_lab.sharding.spec import ShardingSpec, ShardingSpecError
from alpa_lab.parallel_method import __all__ as _ALPA_METHODS  # Alpa's method objects (the module loads no pass)

_LAZY = {
    **{name: "alpa_lab.parallel_method" for name in _ALPA_METHODS},  # Alpa's method objects and options
    "InfeasibleError": "alpa_lab.passes.ilp",
    "InterOpError": "alpa_lab.passes.inter_op",
    "METHODS": "alpa_lab.passes.methods",
    "MethodError": "alpa_lab.passes.methods",
    "ParallelizedStep": "alpa_lab.api",
    "parallelize": "alpa_lab.api",
    "init": "alpa_lab.api",  # Alpa's session: where steps without a cluster run
    "shutdown": "alpa_lab.api",
    "get_global_cluster": "alpa_lab.api",
    "get_global_num_devices": "alpa_lab.api",
    "get_global_physical_mesh": "alpa_lab.api",
    "get_global_virtual_physical_mesh": "alpa_lab.api",
    "set_global_virtual_physical_mesh": "alpa_lab.api",
    "clear_executable_cache": "alpa_lab.api",
    "plan_graph": "alpa_lab.api",
    "DynamicScale": "alpa_lab.graph.loss_scale",  # imports Flax
    "RayCluster": "alpa_lab.runtime.ray_cluster",
    "RayClusterError": "alpa_lab.runtime.ray_cluster",
    "LaunchError": "alpa_lab.runtime.ray_run",
    "MeshWorkerError": "alpa_lab.runtime.ray_run",
    "RayRun": "alpa_lab.runtime.ray_run",
    "VirtualPhysicalMesh": "alpa_lab.runtime.ray_cluster",
    "DataLoader": "alpa_lab.runtime.data_loader",
    "MeshDriverDataLoader": "alpa_lab.runtime.data_loader",
    "CheckpointError": "alpa_lab.runtime.checkpoint",
    "save_checkpoint": "alpa_lab.runtime.checkpoint",
    "restore_checkpoint": "alpa_lab.runtime.checkpoint",
}
"""Names whose modules import the passes or the runtime: loaded on first use, so that a script
using only plans (``Plan.load(...).jit(step)``) runs without importing alpa_lab's passes or runtime."""


def __getattr__(name: str):  # noqa: ANN202 (PEP 562 module attribute hook)
    if name not in _LAZY:
        raise AttributeError(f"module 'alpa_lab' has no attribute {name!r}")
    value = getattr(_importlib.import_module(_LAZY[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


__all__ = [
    *_ALPA_METHODS,
    "DynamicScale",
    "METHODS",
    "PRESETS",
    "CheckpointError",
    "ClusterError",
    "ClusterSpec",
    "DataLoader",
    "MeshDriverDataLoader",
    "DeviceError",
    "InfeasibleError",
    "InterOpError",
    "LaunchError",
    "LogicalMesh",
    "MeshWorkerError",
    "MethodError",
    "ParallelizedStep",
    "PinError",
    "PipelinePlan",
    "PlacementSpec",
    "Plan",
    "PlanFormatError",
    "RayCluster",
    "RayClusterError",
    "RayRun",
    "ShardingSpec",
    "ShardingSpecError",
    "TraceError",
    "VirtualPhysicalMesh",
    "automatic_layer_construction",
    "automatic_remat",
    "clear_executable_cache",
    "count_communication_primitives",
    "get_global_cluster",
    "get_global_num_devices",
    "get_global_physical_mesh",
    "get_global_virtual_physical_mesh",
    "grad",
    "init",
    "manual_layer_construction",
    "manual_remat",
    "mark_pipeline_boundary",
    "mark_stage_boundary",
    "parallelize",
    "plan_graph",
    "restore_checkpoint",
    "save_checkpoint",
    "set_global_virtual_physical_mesh",
    "shutdown",
    "trace",
    "value_and_grad",
]
__version__ = "0.1.0"


def load_ipython_extension(ipython):  # noqa: ANN001, ANN201 (IPython's hook)
    """``%load_ext alpa_lab``: the ``%%parallelize`` cell magic (IPython is imported only here)."""
    from alpa_lab.notebook.magic import load_ipython_extension as load

    load(ipython)


def _jupyter_labextension_paths() -> list[dict[str, str]]:
    """The JupyterLab extension built from ``labextension/`` (linked by ``make labextension``)."""
    return [{"src": "labextension", "dest": "alpa-lab"}]
