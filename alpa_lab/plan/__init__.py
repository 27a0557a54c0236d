"""What the planner decided, as plain data: ``Plan`` (one mesh) and ``PipelinePlan`` (stages).

A plan holds no live JAX objects and imports no pass (``tests/test_imports.py``): it saves to
JSON and loads back anywhere, and ``from alpa_lab.plan import Plan`` needs neither the passes
nor the runtime. Editing a plan (``pin``, ``pin_stages``, ``with_schedule``, ``recalibrated``,
``explain``) asks the planner state the passes attached to it (``plan.problem``: a
``passes.intra_op.StrategyGraph`` or a ``passes.pipeline.PipelineProblem``); a plan loaded
from JSON has none until ``ParallelizedStep.use`` attaches it.

- ``single``: ``Plan`` and what it is made of (``OpPlan``, ``TensorPlan``, ``ReshardingPlan``),
  ``diff`` and ``explain`` results, export to plain JAX (``shardings``, ``jit``).
- ``pipeline``: ``PipelinePlan`` and ``StageResult``; eq. 2 and eq. 5 figures.
- ``timeline``: the simulated schedule a pipeline plan keeps (``Timeline``), the schedules' names.
- ``schema``: the JSON format's version, ``PlanFormatError`` and the readers' shared converters.

``make_plan`` (a solved strategy graph to a ``Plan``) is pass work: ``passes.methods``.
"""

from alpa_lab.plan.pipeline import PipelinePlan, PipelinePlanProblem, StageResult, memory_per_mesh
from alpa_lab.plan.schema import PIPELINE_PLAN_TYPE, SCHEMA_VERSION, PlanFormatError
from alpa_lab.plan.single import (
    Alternative,
    CollectiveComparison,
    Explanation,
    OpChange,
    OpPlan,
    PinError,
    PlacementSpec,
    Plan,
    PlanDiff,
    PlanProblem,
    ReshardingPlan,
    TensorPlan,
    count_communication_primitives,
    count_hlo_collectives,
)
from alpa_lab.plan.timeline import SCHEDULE_NAMES, Timeline, TimelineRecord, pipeline_latency

__all__ = [
    "PIPELINE_PLAN_TYPE",
    "SCHEDULE_NAMES",
    "SCHEMA_VERSION",
    "Alternative",
    "CollectiveComparison",
    "Explanation",
    "OpChange",
    "OpPlan",
    "PinError",
    "PlacementSpec",
    "PipelinePlan",
    "PipelinePlanProblem",
    "Plan",
    "PlanDiff",
    "PlanFormatError",
    "PlanProblem",
    "ReshardingPlan",
    "StageResult",
    "TensorPlan",
    "Timeline",
    "TimelineRecord",
    "count_communication_primitives",
    "count_hlo_collectives",
    "memory_per_mesh",
    "pipeline_latency",
]
