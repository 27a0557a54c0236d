"""Measured costs of a run, and the cluster they imply (the feedback half of calibration).

A ``Profile`` lists, per stage and phase of a plan (a stage's forward, backward or update,
and the transfers arriving on each mesh), what the cost model predicted *split into its
parts* and what the runtime measured (medians over the run's steps). The predicted parts
are the terms the model is linear in:

    predicted = compute + communication + launches * task_overhead + transfers * transfer_overhead

where ``compute`` is every op's roofline time (with its per-op overhead), ``communication``
every collective, resharding and cross-mesh byte (all alpha-beta terms of the links), and
``launches``/``transfers`` count compiled programs and cross-mesh messages. Scaling the
cluster's FLOP/s and memory bandwidth by 1/a (and its per-op and per-sum overheads by a) multiplies every
compute term by exactly a; scaling its links' bandwidths by 1/b and latencies by b multiplies
every communication term by b. ``fit`` finds a, b and the two overheads that best explain
the measurements (least squares on relative errors, non-negative, with a weak pull toward
the cluster's own numbers so a term the run never exercised stays as it was), and
``cluster()`` is the cluster with them: re-planning with it is planning with measured costs.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Mapping, Sequence

import numpy as np

from alpa_lab.cost.cluster import ClusterSpec

__all__ = ["CostParts", "Fit", "Profile", "ProfileError", "ProfileRow"]

FORMAT = "alpa_lab.profile/1"


class ProfileError(ValueError):
    """A profile that cannot be used (malformed, empty, or for another cluster)."""


@dataclass(frozen=True)
class CostParts:
    """A predicted time split into the terms the cost model is linear in (module docstring)."""

    compute: float = 0.0
    communication: float = 0.0
    launches: float = 0.0
    transfers: float = 0.0

    def seconds(self, cluster: ClusterSpec) -> float:
        return self.compute + self.communication + self.launches * cluster.task_overhead + self.transfers * cluster.transfer_overhead

    def __add__(self, other: CostParts) -> CostParts:
        return CostParts(*(a + b for a, b in zip(asdict(self).values(), asdict(other).values())))


@dataclass(frozen=True)
class ProfileRow:
    """One stage phase (or one mesh's incoming transfers): predicted parts against the measured median."""

    stage: int
    """the stage (for transfers: the receiving mesh)"""
    kind: str
    """"RUN", "UPDATE", "TRANSFER" or "STEP" (a single-mesh plan's whole step: no launch term, as the planner charges none)"""
    phase: str
    parts: CostParts
    predicted: float
    measured: float
    count: int
    """measurements behind the median"""

    @property
    def ratio(self) -> float:
        return self.measured / self.predicted if self.predicted > 0 else float("inf")


@dataclass(frozen=True)
class Fit:
    """Scale factors for compute and communication, and the two overheads, fitted to a profile."""

    compute_scale: float
    communication_scale: float
    task_overhead: float
    transfer_overhead: float
    rows: int
    residual: float
    """median relative error |fitted - measured| / measured over the rows"""


@dataclass(frozen=True)
class Profile:
    """What a run measured against what its plan predicted; ``cluster()`` the cluster that explains it."""

    fingerprint: str
    cluster_spec: Mapping[str, Any]
    """the cluster the plan was predicted for (``ClusterSpec.to_dict``)"""
    rows: tuple[ProfileRow, ...]
    steps: int
    step_predicted: float
    step_measured: float
    """median step time (the first, compiling, step left out when there are others)"""
    collectives: Mapping[str, float] = field(default_factory=dict)
    """predicted seconds per collective kind per step, over the plan (the share of ``communication``)"""
    step_serial_predicted: float = 0.0
    """for a run that ran its unit tasks one at a time (the in-process runtime, profiled), the plan's step so
    (``PipelinePlan.serial_step_time``), the like-for-like figure for ``step_measured``; 0 otherwise"""

    # ----- the fit ------------------------------------------------------------------------
    def fit(self, prior_weight: float = 1e-3) -> Fit:
        """Least squares on relative errors, every factor >= 0, weakly pulled to the profile's cluster."""
        from scipy.optimize import nnls

        base = ClusterSpec(**self.cluster_spec)
        usable = [r for r in self.rows if r.measured > 0 and r.count > 0]
        if not usable:
            raise ProfileError("the profile has no measurements: run the plan for a few steps first (run.profile())")
        a = [[r.parts.compute / r.measured, r.parts.communication / r.measured, r.parts.launches / r.measured,
              r.parts.transfers / r.measured] for r in usable]
        y = [1.0] * len(usable)
        # the pull toward the cluster's own numbers, scaled per factor by how much the rows say about it
        # (so it never outweighs data, and pins a factor no row exercises)
        norms = np.linalg.norm(np.asarray(a), axis=0)
        prior = (1.0, 1.0, base.task_overhead, base.transfer_overhead)
        w = prior_weight**0.5
        for col, target in enumerate(prior):
            row = [0.0] * 4
            scale = norms[col] if norms[col] > 0 else 1.0
            row[col] = w * scale
            a.append(row)
            y.append(w * scale * target)
        x, _ = nnls(np.asarray(a), np.asarray(y))
        p = [(r.parts.compute, r.parts.communication, r.parts.launches, r.parts.transfers) for r in usable]
        fitted = [float(np.dot(x, q)) for q in p]
        residual = float(np.median([abs(f - r.measured) / r.measured for f, r in zip(fitted, usable)]))
        return Fit(float(x[0]), float(x[1]), float(x[2]), float(x[3]), len(usable), residual)

    def cluster(self, fit: Fit | None = None) -> ClusterSpec:
        """The profile's cluster with the fitted costs: plan with it to plan with what was measured."""
        f = fit or self.fit()
        base = ClusterSpec(**self.cluster_spec)
        a = max(f.compute_scale, 1e-6)
        b = max(f.communication_scale, 1e-6)
        name = base.name if "measured" in base.name else f"{base.name} (measured)"
        return replace(
            base,
            device_flops=base.device_flops / a,
            memory_bandwidth=base.memory_bandwidth / a,
            op_overhead=base.op_overhead * a,
            sum_overhead=base.sum_overhead * a,
            intra_host_bandwidth=base.intra_host_bandwidth / b,
            inter_host_bandwidth=base.inter_host_bandwidth / b,
            host_link_bandwidth=None if base.host_link_bandwidth is None else base.host_link_bandwidth / b,
            intra_host_latency=base.intra_host_latency * b,
            inter_host_latency=base.inter_host_latency * b,
            task_overhead=f.task_overhead,
            transfer_overhead=f.transfer_overhead,
            name=name,
        )

    # ----- reading ------------------------------------------------------------------------
    def __str__(self) -> str:
        lines = [
            f"Profile of plan {self.fingerprint} over {self.steps} steps: step {self.step_measured * 1e3:.3f} ms measured, "
            f"{self.step_predicted * 1e3:.3f} ms predicted" + (
                f" with the meshes at work at once; {self.step_serial_predicted * 1e3:.3f} ms with one unit task at a time, "
                f"as this process ran them ({self.step_measured / self.step_serial_predicted:.2f}x)"
                if self.step_serial_predicted > 0 else ""),
            f"  {'span':<22} {'predicted ms':>13} {'measured ms':>12} {'ratio':>7} {'n':>5}",
        ]
        for r in self.rows:
            what = {"TRANSFER": f"into mesh {r.stage}", "STEP": "step"}.get(r.kind, f"stage {r.stage} {r.phase}")
            lines.append(f"  {what:<22} {r.predicted * 1e3:13.4f} {r.measured * 1e3:12.4f} {r.ratio:7.2f} {r.count:5d}")
        try:
            f = self.fit()
            lines.append(
                f"  fit: compute x{f.compute_scale:.3g}, communication x{f.communication_scale:.3g}, "
                f"launch {f.task_overhead * 1e6:.1f} us, transfer {f.transfer_overhead * 1e6:.1f} us "
                f"(median error {f.residual:.0%} over {f.rows} rows)"
            )
        except ProfileError:
            pass
        return "\n".join(lines)

    def to_json(self) -> str:
        data = {"format": FORMAT, **asdict(self)}
        data["cluster_spec"] = dict(self.cluster_spec)
        data["collectives"] = dict(self.collectives)
        return json.dumps(data, indent=1)

    @classmethod
    def from_json(cls, text: str) -> Profile:
        try:
            d = json.loads(text)
        except json.JSONDecodeError as e:
            raise ProfileError(f"not a profile: {e}") from e
        if not isinstance(d, dict) or d.get("format") != FORMAT:
            raise ProfileError(f"not a profile (format {d.get('format') if isinstance(d, dict) else None!r}, expected {FORMAT!r})")
        try:
            rows = tuple(ProfileRow(**{**r, "parts": CostParts(**r["parts"])}) for r in d["rows"])
            ClusterSpec(**d["cluster_spec"])
            return cls(
                fingerprint=str(d["fingerprint"]), cluster_spec=dict(d["cluster_spec"]), rows=rows, steps=int(d["steps"]),
                step_predicted=float(d["step_predicted"]), step_measured=float(d["step_measured"]),
                collectives=dict(d.get("collectives", {})), step_serial_predicted=float(d.get("step_serial_predicted", 0.0)),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise ProfileError(f"profile JSON is missing or has malformed fields: {e}") from e


def rows_from(parts: Mapping[tuple[int, str, str], CostParts], measured: Mapping[tuple[int, str, str], Sequence[float]],
              cluster: ClusterSpec, predicted: Mapping[tuple[int, str, str], float] | None = None) -> tuple[ProfileRow, ...]:
    """One row per measured (stage, kind, phase) that has predicted parts: the median of its measurements.

    ``predicted``: the plan's own figure where it is not the analytic model's (a profiled plan's stage times).
    """
    out = []
    for key in sorted(measured):
        values = list(measured[key])
        if key not in parts or not values:
            continue
        p = parts[key]
        guess = (predicted or {}).get(key, p.seconds(cluster))
        out.append(ProfileRow(key[0], key[1], key[2], p, guess, float(np.median(values)), len(values)))
    return tuple(out)
