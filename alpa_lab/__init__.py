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

from alpa_lab.api import ParallelizedStep, parallelize, plan_graph
from alpa_lab.cost.cluster import PRESETS, ClusterError, ClusterSpec, LogicalMesh
from alpa_lab.graph.markers import grad, mark_stage_boundary, value_and_grad
from alpa_lab.graph.trace import TraceError, trace
from alpa_lab.passes.ilp import InfeasibleError
from alpa_lab.passes.intra_op import PinError
from alpa_lab.passes.methods import METHODS, MethodError
from alpa_lab.plan import PipelinePlan, Plan, PlanFormatError
from alpa_lab.runtime.apply import DeviceError
from alpa_lab.runtime.ray_cluster import RayCluster, RayClusterError
from alpa_lab.runtime.ray_run import LaunchError, MeshWorkerError, RayRun
from alpa_lab.sharding.spec import ShardingSpec, ShardingSpecError

__all__ = [
    "METHODS",
    "PRESETS",
    "ClusterError",
    "ClusterSpec",
    "DeviceError",
    "InfeasibleError",
    "LaunchError",
    "LogicalMesh",
    "MeshWorkerError",
    "MethodError",
    "ParallelizedStep",
    "PinError",
    "PipelinePlan",
    "Plan",
    "PlanFormatError",
    "RayCluster",
    "RayClusterError",
    "RayRun",
    "ShardingSpec",
    "ShardingSpecError",
    "TraceError",
    "grad",
    "mark_stage_boundary",
    "parallelize",
    "plan_graph",
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
