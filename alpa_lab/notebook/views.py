"""What the workbench shows, as plain data computed from a plan.

Every view is a pure function of a ``Plan`` or ``PipelinePlan`` (and, for measured
timelines, the runtime's records) returning frozen dataclasses. The widgets and the static
HTML only draw these, so the tests check the content here without a browser: the heatmap's
tiles against the spec's tile map, the timeline's bars against the schedule's instructions,
the traffic matrix against the resharding plan. A single-mesh ``Plan`` is shown as one
stage, so every view takes both kinds of plan.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass, replace
from typing import Any, Mapping, Sequence

import numpy as np

from alpa_lab.graph.opgraph import did_you_mean
from alpa_lab.plan import PipelinePlan, Plan
from alpa_lab.sharding.spec import ShardingSpec

# ---------------------------------------------------------------------------------------
# Stages: a single-mesh plan is one stage
# ---------------------------------------------------------------------------------------


def stage_plans(plan: Plan | PipelinePlan) -> tuple[Plan, ...]:
    """The intra-op plan of every stage (one for a single-mesh plan)."""
    if isinstance(plan, PipelinePlan):
        return tuple(st.plan for st in plan.stages)
    return (plan,)


# ---------------------------------------------------------------------------------------
# Overview
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class StageSummary:
    """One stage's row in the overview. Times are seconds per training step.

    ``compute + communication + bubble`` is the pipeline's makespan (for a single mesh,
    the ILP's step time with no bubble); ``update`` comes after it. The stage's busy time
    in the simulated timeline is split into compute and communication in the proportion
    of its intra-op plan's compute and communication (incl. resharding) costs.
    """

    index: int
    layers: tuple[int, int] | None
    """first and last layer, inclusive (None for a single-mesh plan)."""
    submesh_shape: tuple[int, int]
    logical_shape: tuple[int, int]
    device_ids: tuple[int, ...]
    compute: float
    communication: float
    bubble: float
    update: float
    memory: float
    capacity: float
    method: str


@dataclass(frozen=True)
class Overview:
    cluster_name: str
    num_hosts: int
    devices_per_host: int
    device_stage: tuple[tuple[int | None, ...], ...]
    """[host][local device] -> the stage running there, or None when the device is idle."""
    stages: tuple[StageSummary, ...]
    step_time: float
    memory: float
    capacity: float
    schedule: str
    num_microbatches: int
    device_labels: tuple[tuple[str, ...], ...] = ()
    """[host][local device] -> "stage 2", "stages 0,2" (interleaved) or "idle"."""


def _split_busy(busy: float, plan: Plan) -> tuple[float, float]:
    compute, comm = max(plan.compute_cost, 0.0), max(plan.communication_cost, 0.0)  # comm may be -0.0 after rounding
    total = compute + comm
    share = compute / total if total > 0 else 1.0
    return busy * share, busy * (1.0 - share)


def overview(plan: Plan | PipelinePlan) -> Overview:
    """The cluster coloured by stage, and per stage where it runs, its time and memory."""
    c = plan.cluster
    hosts, per_host = int(c["hosts"]), int(c["devices_per_host"])
    capacity = float(c["device_memory"])
    stage_of_device: dict[int, int] = {}
    stages_on: dict[int, list[int]] = {}
    rows = []
    if isinstance(plan, PipelinePlan):
        makespan = plan.timeline.makespan
        busy = [0.0] * plan.num_stages
        for r in plan.timeline.records:
            if r.kind == "RUN":
                busy[r.stage] += r.end - r.start
        mesh_busy: dict[tuple[int, ...], float] = {}
        for st in plan.stages:
            mesh_busy[st.device_ids] = mesh_busy.get(st.device_ids, 0.0) + busy[st.index]
        for st in plan.stages:
            compute, comm = _split_busy(busy[st.index], st.plan)
            # a mesh's idle time, shared among the (interleaved) stages on it by their busy time
            share = busy[st.index] / mesh_busy[st.device_ids] if mesh_busy[st.device_ids] > 0 else 1.0
            rows.append(
                StageSummary(
                    st.index, (st.layers[0], st.layers[1] - 1), st.submesh_shape, st.logical_shape, st.device_ids,
                    compute, comm, max(makespan - mesh_busy[st.device_ids], 0.0) * share, st.apply_time,
                    st.memory_per_device, capacity, st.plan.method,
                )
            )
            for d in st.device_ids:
                stage_of_device.setdefault(d, st.index)
                stages_on.setdefault(d, []).append(st.index)
        schedule, micro = plan.schedule, plan.num_microbatches
    else:
        rows.append(
            StageSummary(
                0, None, tuple(plan.mesh_shape), tuple(plan.mesh_shape), tuple(plan.device_ids),
                plan.compute_cost, max(plan.communication_cost, 0.0), 0.0, 0.0, plan.memory_per_device, capacity, plan.method,
            )
        )
        stage_of_device.update({d: 0 for d in plan.device_ids})
        stages_on.update({d: [0] for d in plan.device_ids})
        schedule, micro = "", 1
    grid = tuple(tuple(stage_of_device.get(h * per_host + d) for d in range(per_host)) for h in range(hosts))
    labels = tuple(
        tuple(_device_label(stages_on.get(h * per_host + d, [])) for d in range(per_host)) for h in range(hosts)
    )
    return Overview(
        str(c.get("name", "")), hosts, per_host, grid, tuple(rows), plan.estimated_step_time, plan.memory_per_device,
        capacity, schedule, micro, labels,
    )


def _device_label(stages: list[int]) -> str:
    if not stages:
        return "idle"
    return f"stage {stages[0]}" if len(stages) == 1 else "stages " + ",".join(map(str, stages))


# ---------------------------------------------------------------------------------------
# Sharding heatmaps
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TensorInfo:
    """A tensor the plan lays out: a step argument/result, or an op's output, on its stage's mesh."""

    name: str
    """an argument's path (``[0].params['w']``), or ``op`` / ``op:k`` for an op's k-th output."""
    stage: int
    shape: tuple[int, ...]
    dtype: str
    spec: str
    mesh_shape: tuple[int, int]
    device_ids: tuple[int, ...]


@dataclass(frozen=True)
class Tile:
    """What one device holds of a tensor: its tile's index and the region [start, stop) per dim."""

    device: int
    mesh_coord: tuple[int, int]
    tile_index: tuple[int, ...]
    region: tuple[tuple[int, int], ...]
    replica: int
    """0 for the first device holding this tile, 1 for the next copy, ..."""


def tensors(plan: Plan | PipelinePlan) -> dict[str, int]:
    """Every tensor whose layout the plan decides, by name, with its stage: the step's
    arguments and results, and (with the planner state attached) every op's outputs.

    Names only, which is cheap; ``tensor_info`` looks one up. A plan loaded from JSON
    without planner state lists its arguments and results only.
    """
    out: dict[str, int] = {}
    for index, sp in enumerate(stage_plans(plan)):
        for t in (*sp.inputs, *sp.outputs):
            out.setdefault(t.path, index)
        if sp.problem is None:
            continue
        for o in sp.ops:
            if o.kind != "op" or not o.output_specs:
                continue
            if len(o.output_specs) == 1:
                out.setdefault(o.name, index)
            else:
                for k in range(len(o.output_specs)):
                    out.setdefault(f"{o.name}:{k}", index)
    return out


def tensor_info(plan: Plan | PipelinePlan, name: str, names: Mapping[str, int] | None = None) -> TensorInfo:
    """Shape, dtype, spec and mesh of the tensor ``name``; ``names`` is ``tensors(plan)`` if at hand."""
    where = tensors(plan) if names is None else names
    if name not in where:
        raise KeyError(f"no tensor named {name!r} in this plan{did_you_mean(name, list(where))}")
    index = where[name]
    sp = stage_plans(plan)[index]
    mesh, devs = tuple(sp.mesh_shape), tuple(sp.device_ids)
    for t in (*sp.inputs, *sp.outputs):
        if t.path == name:
            return TensorInfo(t.path, index, tuple(t.shape), t.dtype, t.spec, mesh, devs)
    op_name, _, k = name.partition(":")
    sg = sp.problem
    n, k = sg.node_index(op_name), int(k or 0)
    var = next(v for v, nk in sg.node_of_var.items() if nk == (n, k))
    shape, _ = sg.var_info[var]
    return TensorInfo(name, index, tuple(shape), sg.var_dtype.get(var, ""), sp.op(op_name).output_specs[k], mesh, devs)


def sharding_tiles(info: TensorInfo) -> tuple[Tile, ...]:
    """Which device holds which tile of ``info``, from its sharding spec (Table 1 of the paper)."""
    spec = ShardingSpec.parse(info.spec)
    mesh = tuple(info.mesh_shape)
    tile_map = spec.tile_map(info.shape, mesh)
    seen: dict[tuple[int, ...], int] = {}
    tiles = []
    for r in range(mesh[0]):
        for c in range(mesh[1]):
            index = spec.tile_index((r, c), mesh)
            region = tuple((s.start or 0, s.stop if s.stop is not None else n) for s, n in zip(tile_map[(r, c)], info.shape))
            tiles.append(Tile(info.device_ids[r * mesh[1] + c], (r, c), index, region, seen.get(index, 0)))
            seen[index] = seen.get(index, 0) + 1
    return tuple(tiles)


# ---------------------------------------------------------------------------------------
# Pipeline timeline
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Bar:
    """One span on a mesh's lane: a stage's forward/backward run, a transfer or the update."""

    mesh: int
    stage: int
    kind: str
    """"RUN", "TRANSFER" (arriving on ``mesh`` from ``peer``) or "UPDATE"."""
    phase: str
    microbatch: int
    start: float
    end: float
    source: str = "predicted"
    """"predicted" (the simulated schedule) or "measured" (the runtime's records)."""
    peer: int | None = None


def timeline_bars(plan: PipelinePlan) -> tuple[Bar, ...]:
    """The predicted timeline: every RUN, every cross-mesh transfer, then each stage's update."""
    tl = plan.timeline
    bars = [Bar(r.mesh, r.stage, "RUN", r.phase, r.microbatch, r.start, r.end) for r in tl.records if r.kind == "RUN"]
    for r, peer, start, arrival in tl.transfers():
        bars.append(Bar(r.mesh, r.stage, "TRANSFER", r.phase, r.microbatch, start, arrival, peer=peer))
    for st in plan.stages:
        if st.apply_time > 0:
            bars.append(Bar(st.index, st.index, "UPDATE", "apply", -1, tl.makespan, tl.makespan + st.apply_time))
    return tuple(bars)


def measured_bars(records: Sequence[tuple[int, str, int, float, float]]) -> tuple[Bar, ...]:
    """Bars from the runtime's (stage, phase, micro-batch, start, end) records (one mesh per stage)."""
    bars = []
    for stage, phase, mb, start, end in records:
        kind = "UPDATE" if phase == "apply" else "RUN"
        bars.append(Bar(stage, stage, kind, phase, mb, start, end, source="measured"))
    return tuple(bars)


@dataclass(frozen=True)
class StageCost:
    """One kind of span of a mesh or stage, predicted against measured: medians of the bars' durations."""

    stage: int
    """the stage (for transfers: the receiving mesh)"""
    kind: str
    """"RUN", "TRANSFER" or "UPDATE" """
    phase: str
    """the run's phase (forward, backward, ...); "" for transfers"""
    predicted: float
    measured: float
    count: int
    """measured bars behind the median"""

    @property
    def ratio(self) -> float:
        """measured / predicted (inf when nothing was predicted)"""
        return self.measured / self.predicted if self.predicted > 0 else float("inf")


def stage_costs(predicted: Sequence[Bar], measured: Sequence[Bar]) -> tuple[StageCost, ...]:
    """Per stage and phase (and per receiving mesh for transfers), the median predicted and measured durations.

    Both sides are bars (``timeline_bars`` and ``measured_bars``/``worker_bars``), so the in-process and
    the Ray runtime are compared the same way; only kinds that were measured are listed.
    """

    def key(b: Bar) -> tuple[int, str, str]:
        return (b.mesh, "TRANSFER", "") if b.kind == "TRANSFER" else (b.stage, b.kind, b.phase)

    def durations(bars: Sequence[Bar]) -> dict[tuple[int, str, str], list[float]]:
        out: dict[tuple[int, str, str], list[float]] = {}
        for b in bars:
            out.setdefault(key(b), []).append(b.end - b.start)
        return out

    want, got = durations(predicted), durations(measured)
    return tuple(
        StageCost(k[0], k[1], k[2], float(np.median(want[k])) if k in want else 0.0, float(np.median(got[k])), len(got[k]))
        for k in sorted(got)
    )


def worker_bars(events: Sequence[Any], step: int) -> tuple[Bar, ...]:
    """Bars of one step from the Ray mesh workers' events: RUNs on their stage's mesh, RECVs as transfers.

    Times are from the step's first event (the events are in the driver's clock already).
    """
    return event_bars([e for e in events if e.step == step])


def event_bars(events: Sequence[Any]) -> tuple[Bar, ...]:
    """Bars from runtime events (``mesh_worker.Event``, either runtime), times from the first event's start."""
    mine = [e for e in events if e.kind in ("run", "recv")]
    if not mine:
        return ()
    t0 = min(e.start for e in mine)
    bars = []
    for e in mine:
        if e.kind == "run":
            kind = "UPDATE" if e.phase == "apply" else "RUN"
            mb = e.microbatch if e.phase != "step" else e.step
            bars.append(Bar(e.mesh, e.stage, kind, e.phase, mb, e.start - t0, e.end - t0, source="measured"))
        else:
            bars.append(Bar(e.mesh, -1, "TRANSFER", "recv", e.microbatch, e.start - t0, e.end - t0, source="measured", peer=e.peer))
    return tuple(bars)


_PHASE_LETTER = {"forward": "F", "backward": "B", "backward_input": "B", "backward_weight": "W", "apply": "U", "step": "step "}


def bar_label(bar: Bar) -> str:
    """``F3`` for stage s's forward of micro-batch 3, ``B3``/``W3`` backward, ``U`` update, ``->F3`` a transfer."""
    if bar.kind == "UPDATE":
        return "U"
    text = f"{_PHASE_LETTER.get(bar.phase, bar.phase)}{bar.microbatch}"
    return "->" + text if bar.kind == "TRANSFER" else text


def chrome_trace(bars: Sequence[Bar]) -> dict[str, Any]:
    """The bars as a Chrome trace (``chrome://tracing`` / Perfetto JSON), times in microseconds.

    One process per source (predicted, measured), one thread per mesh, plus a thread per
    mesh for transfers arriving there.
    """
    pids = {"predicted": 1, "measured": 2}
    events: list[dict[str, Any]] = []
    threads = set()
    for b in bars:
        pid = pids.get(b.source, 3)
        tid = b.mesh * 2 + (1 if b.kind == "TRANSFER" else 0)
        threads.add((pid, tid, b.mesh, b.kind == "TRANSFER"))
        events.append(
            {
                "name": bar_label(b),
                "cat": b.kind.lower(),
                "ph": "X",
                "ts": b.start * 1e6,
                "dur": max(b.end - b.start, 0.0) * 1e6,
                "pid": pid,
                "tid": tid,
                "args": {"stage": b.stage, "phase": b.phase, "microbatch": b.microbatch, "peer": b.peer},
            }
        )
    for source, pid in pids.items():
        if any(t[0] == pid for t in threads):
            events.append({"name": "process_name", "ph": "M", "pid": pid, "args": {"name": f"{source} timeline"}})
    for pid, tid, mesh, transfer in sorted(threads):
        name = f"mesh {mesh} transfers in" if transfer else f"mesh {mesh}"
        events.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": tid, "args": {"name": name}})
    return {"traceEvents": events, "displayTimeUnit": "ms"}


# ---------------------------------------------------------------------------------------
# Strategy table
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class StrategyRow:
    """One op (or argument) of a stage plan: its strategy, cost and place in the model."""

    stage: int
    layer: int | None
    block: str
    """the repeated module instance it belongs to (``TransformerLM/Block_3``), or ""."""
    name: str
    kind: str
    primitive: str
    label: str
    strategy: str
    cost: float
    """its own compute + communication seconds (resharding to neighbours not included)."""
    num_strategies: int
    pinned: bool
    merged_into: str


_INSTANCE = re.compile(r"^(?:\w+\()*([^()]*?/[A-Za-z][A-Za-z0-9]*_\d+)(?:/|\)|$)")


@functools.lru_cache(maxsize=65536)  # every redraw asks again for each op's label: the same few thousand
def block_of(label: str) -> str:
    """The first numbered module on ``label``'s path: ``jvp(GPT/Block_3/attn)`` -> ``GPT/Block_3``."""
    m = _INSTANCE.match(label)
    return m.group(1) if m else ""


def strategy_rows(plan: Plan | PipelinePlan) -> tuple[StrategyRow, ...]:
    """Every op and argument of every stage, in program order, with its layer and block."""
    layer_of: dict[str, int] = {}
    if isinstance(plan, PipelinePlan) and plan.problem is not None:
        graph, sl = plan.problem.graph, plan.problem.slicing
        layer_of = {op.name: int(sl.layer[op.index]) for op in graph.ops}
    rows = []
    for index, sp in enumerate(stage_plans(plan)):
        pins = dict(sp.pins)
        for o in sp.ops:
            rows.append(
                StrategyRow(
                    index, layer_of.get(o.name), block_of(o.label), o.name, o.kind, o.primitive, o.label, o.strategy,
                    o.compute_cost + o.communication_cost, o.num_strategies, o.name in pins, o.merged_into,
                )
            )
    return tuple(rows)


@dataclass(frozen=True)
class RowGroup:
    """Rows shown together: one block instance (or loose ops), and the repeats folded into it."""

    stage: int
    block: str
    rows: tuple[StrategyRow, ...]
    repeats: tuple[str, ...] = ()
    """other instances of the same module whose ops took exactly the same strategies."""


def _pattern(block: str) -> str:
    return re.sub(r"_\d+$", "_*", block)


def collapse_repeated(rows: Sequence[StrategyRow]) -> tuple[RowGroup, ...]:
    """Group rows by stage and block; fold a block whose (primitive, strategy) sequence equals
    an earlier instance of the same module in the same stage into that instance."""
    groups: list[tuple[int, str, list[StrategyRow]]] = []
    for r in rows:
        if groups and groups[-1][0] == r.stage and groups[-1][1] == r.block:
            groups[-1][2].append(r)
        else:
            groups.append((r.stage, r.block, [r]))
    # a block's ops may be split into several runs (forward, backward): gather them
    merged: dict[tuple[int, str], list[StrategyRow]] = {}
    order: list[tuple[int, str]] = []
    loose: list[RowGroup] = []
    for stage, block, rs in groups:
        if not block:
            loose.append(RowGroup(stage, "", tuple(rs)))
            order.append((stage, f"\0{len(loose) - 1}"))
            continue
        if (stage, block) not in merged:
            merged[(stage, block)] = []
            order.append((stage, block))
        merged[(stage, block)].extend(rs)
    first_of: dict[tuple[int, str, tuple], str] = {}
    repeats: dict[tuple[int, str], list[str]] = {}
    shown: list[tuple[int, str]] = []
    for key in order:
        stage, block = key
        if block.startswith("\0"):
            shown.append(key)
            continue
        sig = tuple((r.primitive, r.strategy) for r in merged[key])
        k = (stage, _pattern(block), sig)
        if k in first_of:
            repeats[(stage, first_of[k])].append(block)
        else:
            first_of[k] = block
            repeats[key] = []
            shown.append(key)
    out = []
    for stage, block in shown:
        if block.startswith("\0"):
            out.append(loose[int(block[1:])])
        else:
            out.append(RowGroup(stage, block, tuple(merged[(stage, block)]), tuple(repeats[(stage, block)])))
    return tuple(out)


# ---------------------------------------------------------------------------------------
# Small helpers shared by the renderers
# ---------------------------------------------------------------------------------------


def tile_ids(tiles: Sequence[Tile]) -> dict[tuple[int, ...], int]:
    """A small integer per distinct tile, in first-seen order (a colour per tile)."""
    ids: dict[tuple[int, ...], int] = {}
    for t in tiles:
        ids.setdefault(t.tile_index, len(ids))
    return ids


def tensor_grid(info: TensorInfo, tiles: Sequence[Tile], max_cells: int = 64) -> tuple[np.ndarray, tuple[int, int]]:
    """The tensor drawn as a 2-D grid (rows: dim 0, columns: the last dim; other dims folded),
    each cell holding the id of the tile it belongs to; at most ``max_cells`` per side."""
    shape = info.shape or (1,)
    rows_dim, cols_dim = 0, len(shape) - 1
    n_rows, n_cols = shape[rows_dim], shape[cols_dim] if len(shape) > 1 else 1
    gr, gc = min(n_rows, max_cells), min(n_cols, max_cells)
    ids = tile_ids(tiles)
    grid = np.full((gr, gc), -1, dtype=int)
    for t in tiles:
        if t.replica:
            continue
        region = t.region or ((0, 1),)
        r0, r1 = region[rows_dim]
        c0, c1 = region[cols_dim] if len(shape) > 1 else (0, 1)
        # a tile covers every folded middle dim only if it spans them whole; show the first slab
        if any(region[d][0] != 0 for d in range(1, len(shape) - 1)):
            continue
        ra, ca = r0 * gr // n_rows, c0 * gc // n_cols
        grid[ra : max(r1 * gr // n_rows, ra + 1), ca : max(c1 * gc // n_cols, ca + 1)] = ids[t.tile_index]
    return grid, (n_rows, n_cols)


# ---------------------------------------------------------------------------------------
# Resharding traffic between meshes
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Traffic:
    """Bytes per training step between meshes (stages) and between hosts, with the transfers.

    ``mesh_bytes[a][b]`` sums, over tensors stage a sends to stage b, the bytes their
    cross-mesh unit tasks put on links, times the micro-batches (once for the update's
    tensors). ``host_bytes[h][g]`` is the same traffic by the sender's and receiver's host
    (the diagonal stays inside a host). ``transfers[(a, b)]`` are the tensors behind a cell.
    """

    mesh_bytes: tuple[tuple[int, ...], ...]
    host_bytes: tuple[tuple[int, ...], ...]
    transfers: Mapping[tuple[int, int], tuple[Any, ...]]
    num_microbatches: int

    @property
    def cells(self) -> tuple[tuple[int, int], ...]:
        return tuple(sorted(self.transfers))


def traffic(plan: PipelinePlan) -> Traffic:
    """The resharding traffic of a pipeline plan (``passes.transfers``), as matrices."""
    from alpa_lab.passes.transfers import host_traffic, pipeline_transfers, stage_traffic

    moves = pipeline_transfers(plan)
    S, M = plan.num_stages, plan.num_microbatches
    hosts, per_host = int(plan.cluster["hosts"]), int(plan.cluster["devices_per_host"])
    by_stage = stage_traffic(moves, M)
    by_host = host_traffic(moves, M, per_host)
    cells: dict[tuple[int, int], list] = {}
    for t in moves:
        cells.setdefault((t.src_stage, t.dst_stage), []).append(t)
    return Traffic(
        tuple(tuple(by_stage.get((a, b), 0) for b in range(S)) for a in range(S)),
        tuple(tuple(by_host.get((a, b), 0) for b in range(hosts)) for a in range(hosts)),
        {k: tuple(v) for k, v in cells.items()},
        M,
    )


# ---------------------------------------------------------------------------------------
# Device grid labels (the overview's cluster picture)
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DeviceBlock:
    """A rectangle of devices with the same label: written once, not once per device."""

    label: str
    """"stage 2", "stages 0,2" (interleaved) or "idle"."""
    hosts: tuple[int, int]
    """first and last host (row), inclusive."""
    devices: tuple[int, int]
    """first and last local device (column), inclusive."""


def device_blocks(ov: Overview) -> tuple[DeviceBlock, ...]:
    """The device grid cut into same-label rectangles: runs along each host, stacked when
    consecutive hosts have the same run at the same columns (a mesh spanning hosts)."""
    open_: dict[tuple[str, int, int], DeviceBlock] = {}
    done: list[DeviceBlock] = []
    for h, labels in enumerate(ov.device_labels):
        runs = []
        for d, label in enumerate(labels):
            if runs and runs[-1][0] == label and runs[-1][2] == d - 1:
                runs[-1][2] = d
            else:
                runs.append([label, d, d])
        still: dict[tuple[str, int, int], DeviceBlock] = {}
        for label, a, b in runs:
            key = (label, a, b)
            prev = open_.pop(key, None)
            still[key] = DeviceBlock(label, (prev.hosts[0] if prev else h, h), (a, b))
        done.extend(open_.values())  # runs that did not continue on this host end here
        open_ = still
    done.extend(open_.values())
    return tuple(sorted(done, key=lambda b: (b.hosts[0], b.devices[0])))


# ---------------------------------------------------------------------------------------
# Program graph: ops (or groups of ops) as nodes, data dependencies as edges
# ---------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=4096)  # a program graph asks for each op's, several times per redraw
def sharding_key(spec: str) -> str:
    """The colour key of a layout: which mesh axes split the tensor, not on which of its dims.

    ``"S0R"`` and ``"RS0R"`` are both ``"S0"`` (split over mesh axis 0), ``"S0RS1"`` is
    ``"S0+S1"``, ``"RS01"`` is ``"S01"``, a replicated tensor (or a scalar) is ``"R"``: a
    handful of colours for a model, where every spec string would need dozens.
    """
    try:
        dims = ShardingSpec.parse(spec).dims
    except ValueError:
        return spec
    split = ["S" + "".join(map(str, axes)) for axes in dims if axes]
    return "+".join(split) if split else "R"


@dataclass(frozen=True)
class GraphNode:
    """One op of a stage plan, or a group of ops (one module's ops of one layer and phase)."""

    id: str
    """the op's name, or ``s<stage>/L<layer>/<phase>/<module>`` for a group."""
    ops: tuple[str, ...]
    """the ops it stands for, in program order."""
    main: str
    """the op a click selects and the node's spec and strategy are of: the op itself, or the group's
    costliest op in the group's colour (its ``key``)."""
    stage: int
    layer: int | None
    phase: str
    """"forward", "backward", "apply" (pipeline plans), from the op's label otherwise ("" if it has none)."""
    module: str
    """the model module it runs in (``TransformerLM/Block_0/Attention_0``), or ""."""
    primitive: str
    """the primitive of ``main``."""
    spec: str
    """the output sharding spec of ``main``."""
    strategy: str
    """the strategy of ``main``."""
    key: str
    """the colour key (``sharding_key``): for a group, the layout most of its seconds (then ops) run in."""
    compute: float
    """seconds of compute, summed over its ops (per execution of its stage)."""
    communication: float
    """seconds of its ops' own collectives (reshardings between ops are on the edges)."""
    resharding: float
    """seconds of the plan's reshardings no drawn edge shows: between its own ops (a group), of
    the step's arguments into the layouts its ops read, and of its results into the layouts the
    step returns them in."""
    x: int
    """column: the longest path to it from the program's first ops."""
    y: int
    """row, counted down from the top; each stage has its own band of rows."""

    @property
    def title(self) -> str:
        if len(self.ops) == 1:
            return self.ops[0]
        where = self.module or "(ops outside any module)"
        layer = "" if self.layer is None else f" layer {self.layer}"
        return f"{where} {self.phase or 'ops'}{layer}, {len(self.ops)} ops"


@dataclass(frozen=True)
class GraphEdge:
    """Data flowing from node ``src`` to node ``dst`` (merged over the tensors between them)."""

    src: str
    dst: str
    kind: str
    """"data"; "reshard" (a tensor changes layout on its mesh); "cross_mesh" (it moves to another stage's mesh)."""
    tensors: tuple[str, ...]
    """the tensors it carries, ``op:output``."""
    resharding: float
    """seconds of the plan's reshardings on this edge (``Plan.reshardings``), 0 when none."""
    nbytes: int
    """cross-mesh bytes per step (``views.traffic``), 0 for an edge inside a mesh."""
    seconds: float
    """predicted cross-mesh seconds per step, 0 for an edge inside a mesh."""
    phase: str = ""
    """for cross-mesh edges, the phase the tensors move in; ``state`` is a new state leaf read next step."""

    @property
    def cost(self) -> float:
        """seconds per step: what the edge's width shows."""
        return self.resharding + self.seconds


@dataclass(frozen=True)
class StageBand:
    """Rows ``[top, bottom]`` of the graph that hold a stage's nodes (drawn as a background band)."""

    stage: int
    top: int
    bottom: int
    label: str


@dataclass(frozen=True)
class ProgramGraph:
    nodes: tuple[GraphNode, ...]
    edges: tuple[GraphEdge, ...]
    bands: tuple[StageBand, ...]
    num_ops: int
    grouped: bool
    """nodes stand for groups of ops (too many ops to draw one by one)."""
    module_depth: int | None = None
    """how many levels of the module path name a group (None: not grouped)."""

    def node_of(self, op: str) -> GraphNode:
        """The node that shows ``op``."""
        for n in self.nodes:
            if op in n.ops:
                return n
        raise KeyError(f"no op named {op!r} in this graph{did_you_mean(op, [o for n in self.nodes for o in n.ops])}")


@dataclass(frozen=True)
class _OpRecord:
    name: str
    index: int
    stage: int
    layer: int | None
    phase: str
    module: tuple[str, ...]
    primitive: str
    spec: str
    strategy: str
    compute: float
    communication: float


_WRAPPER = re.compile(r"\w+\(|\)")
_MODULE = re.compile(r"[A-Za-z][\w.]*")
_CROSS = re.compile(r"^<(.+):(\d+)>$")


def _module_path(label: str) -> tuple[str, ...]:
    """``transpose(jvp(GPT/Block_0/Attention_0/_where))`` -> ``("GPT", "Block_0", "Attention_0")``;
    ``transpose(jvp(MLP))/Dense_3`` -> ``("MLP", "Dense_3")``."""
    inner = _WRAPPER.sub("", label)
    out = []
    for part in inner.split("/") if inner else ():
        if not _MODULE.fullmatch(part):
            break  # a function (``_take``) or an einsum (``bqhd,bkhd->bhqk``): not a module
        out.append(part)
    return tuple(out)


def _label_phase(label: str) -> str:
    return "backward" if label.startswith("transpose(") else "forward" if label.startswith("jvp(") else ""


def _op_records(plan: Plan | PipelinePlan) -> list[_OpRecord]:
    layer_of: dict[str, tuple[int, str]] = {}
    if isinstance(plan, PipelinePlan) and plan.problem is not None:
        sl = plan.problem.slicing
        layer_of = {op.name: (int(sl.layer[op.index]), sl.phase[op.index]) for op in plan.problem.graph.ops}
        order = {op.name: op.index for op in plan.problem.graph.ops}
    else:
        order = {}
    records = []
    for stage, sp in enumerate(stage_plans(plan)):
        for o in sp.ops:
            if o.kind != "op":
                continue
            layer, phase = layer_of.get(o.name, (None, _label_phase(o.label)))
            records.append(
                _OpRecord(
                    o.name, order.get(o.name, len(records)), stage, layer, phase, _module_path(o.label), o.primitive,
                    o.output_specs[0] if o.output_specs else "-", o.strategy, o.compute_cost, o.communication_cost,
                )
            )
    records.sort(key=lambda r: r.index)
    return records


def _dependencies(plan: Plan | PipelinePlan) -> list[tuple[str, str, str]]:
    """(producer op, consumer op, tensor) for every op input made by another op, in program order.

    A pipeline plan reads them from its traced program; a single-mesh plan from its strategy
    graph's operand edges. A plan loaded without planner state has none."""
    out = []
    if isinstance(plan, PipelinePlan):
        if plan.problem is None:
            return []
        graph = plan.problem.graph
        for op in graph.ops:
            for v in op.inputs:
                p = graph.vars[v].producer
                if p is not None:
                    prod = graph.ops[p]
                    out.append((prod.name, op.name, f"{prod.name}:{prod.outputs.index(v)}"))
        return out
    sg = plan.problem
    if sg is None:
        return []
    for e in sg.edges:
        if e.consumer >= 0 and sg.nodes[e.producer].kind == "op":
            name = sg.nodes[e.producer].name
            out.append((name, sg.nodes[e.consumer].name, f"{name}:{e.output}"))
    return out


def _cross_mesh(plan: PipelinePlan, stage_of: Mapping[str, int]) -> list[tuple[str, str, str, str, int, float]]:
    """(producer op, first reader op, tensor, phase, bytes per step, seconds per step) per cross-mesh transfer.

    A tensor moves once to a stage however many of its ops read it: its bytes go on the edge
    to the first reader (of the matching phase: the update's reads move once per step)."""
    from alpa_lab.cost.cluster import ClusterSpec
    from alpa_lab.passes.stages import APPLY
    from alpa_lab.passes.transfers import STATE, pipeline_transfers

    problem = plan.problem
    graph, sl = problem.graph, problem.slicing
    cluster = getattr(problem, "cluster", None) or ClusterSpec(**plan.cluster)
    readers = getattr(problem, "consumers", None) or graph.consumers()
    made = {v: o for o, v in graph.state_carries()}
    out = []
    for t in pipeline_transfers(plan):
        source = made[t.var] if t.phase == STATE else t.var
        producer = graph.ops[graph.vars[source].producer]
        mine = [i for i in readers[t.var] if stage_of.get(graph.ops[i].name) == t.dst_stage]
        if t.phase != STATE:
            mine = [i for i in mine if (sl.phase[i] == APPLY) == (t.phase == APPLY)] or mine
        if not mine:
            continue
        k = t.times_per_step(plan.num_microbatches)
        tensor = f"{producer.name}:{producer.outputs.index(source)}"
        out.append((producer.name, graph.ops[min(mine)].name, tensor, t.phase, t.nbytes * k, t.resharding.cost(cluster) * k))
    return out


def _join_phase(phases: str, phase: str) -> str:
    """``"forward"`` + ``"apply"`` -> ``"forward+apply"`` (each once)."""
    if not phase or phase in phases.split("+"):
        return phases
    return f"{phases}+{phase}" if phases else phase


def _group_keys(records: Sequence[_OpRecord], max_nodes: int) -> tuple[list[tuple], int | None]:
    """A key per op: the op itself when few, else (stage, layer, phase, module path cut to the deepest
    level that keeps the groups at most ``max_nodes``; just (stage, layer, phase) if none does)."""
    if len(records) <= max_nodes:
        return [(r.name,) for r in records], None
    depth = max((len(r.module) for r in records), default=0)
    while True:
        keys = [(r.stage, r.layer, r.phase, "/".join(r.module[:depth])) for r in records]
        if len(set(keys)) <= max_nodes or depth == 0:
            return keys, depth
        depth -= 1


def program_graph(plan: Plan | PipelinePlan, max_nodes: int = 150) -> ProgramGraph:
    """The planned program as a graph: a node per op (per group of ops when there are more than
    ``max_nodes``), coloured by the layout it computes, and an edge per data dependency, with the
    plan's reshardings and (for a pipeline) the cross-mesh transfers on the edges that cause them.

    Layout: columns by the longest path from the first ops (groups ordered by their ops' median
    column, edges against that order left out of the columns: a group's ops may interleave with
    another's); rows within a stage's band by that order. Deterministic, no solver.
    """
    records = _op_records(plan)
    rec = {r.name: r for r in records}
    keys, depth = _group_keys(records, max_nodes)
    group_of = {r.name: k for r, k in zip(records, keys)}

    # edges between ops, with resharding costs, then cross-mesh transfers
    edge_data: dict[tuple[str, str], dict[str, Any]] = {}

    def edge(src: str, dst: str) -> dict[str, Any]:
        e = edge_data.get((src, dst))
        if e is None:
            e = edge_data[(src, dst)] = {"tensors": [], "resharding": 0.0, "nbytes": 0, "seconds": 0.0, "phase": ""}
        return e

    deps = [(a, b, t) for a, b, t in _dependencies(plan) if a in rec and b in rec]
    for a, b, t in deps:
        e = edge(a, b)
        if t not in e["tensors"]:
            e["tensors"].append(t)
    loose: dict[str, float] = {}  # op -> resharding seconds with no edge between two ops to show them
    for sp in stage_plans(plan):
        for r in sp.reshardings:
            cross = _CROSS.match(r.producer)  # a tensor that arrived from another stage: on the cross-mesh edge
            producer = cross.group(1) if cross else r.producer
            if r.consumer.startswith("output "):  # into the layout the step returns it in
                loose[producer] = loose.get(producer, 0.0) + r.cost
            elif (producer, r.consumer) in edge_data:
                edge_data[(producer, r.consumer)]["resharding"] += r.cost
            else:  # a step argument (a parameter, the batch) read in another layout
                loose[r.consumer] = loose.get(r.consumer, 0.0) + r.cost
    if isinstance(plan, PipelinePlan) and plan.problem is not None:
        stage_of = {r.name: r.stage for r in records}
        for a, b, t, phase, nbytes, seconds in _cross_mesh(plan, stage_of):
            e = edge(a, b)
            if t not in e["tensors"]:
                e["tensors"].append(t)
            e["nbytes"] += nbytes
            e["seconds"] += seconds
            e["phase"] = _join_phase(e["phase"], phase)

    # columns: longest path over the ops (program order is a topological order), per group its first op's
    depth_of: dict[str, int] = {}
    preds: dict[str, list[str]] = {}
    for a, b, _ in deps:
        preds.setdefault(b, []).append(a)
    for r in records:
        depth_of[r.name] = 1 + max((depth_of[p] for p in preds.get(r.name, ()) if p in depth_of), default=-1)
    members: dict[tuple, list[_OpRecord]] = {}
    for r, k in zip(records, keys):
        members.setdefault(k, []).append(r)
    # a group sits where most of its ops do (its first op may read only parameters, at depth 0)
    order = sorted(members, key=lambda k: (float(np.median([depth_of[r.name] for r in members[k]])), members[k][0].index))
    rank = {k: i for i, k in enumerate(order)}
    group_preds: dict[tuple, set[tuple]] = {}
    for a, b, _ in deps:
        ga, gb = group_of[a], group_of[b]
        if rank[ga] < rank[gb]:
            group_preds.setdefault(gb, set()).add(ga)
    column: dict[tuple, int] = {}
    for k in order:
        column[k] = 1 + max((column[p] for p in group_preds.get(k, ())), default=-1)

    # rows: a band per stage, nodes of a column stacked in order
    stages = sorted({members[k][0].stage for k in order})
    slot: dict[tuple, int] = {}
    height: dict[int, int] = {s: 1 for s in stages}
    used: dict[tuple[int, int], int] = {}
    for k in order:
        where = (members[k][0].stage, column[k])
        slot[k] = used.get(where, 0)
        used[where] = slot[k] + 1
        height[where[0]] = max(height[where[0]], used[where])
    top: dict[int, int] = {}
    row = 0
    bands = []
    stage_list = stage_plans(plan)
    for s in stages:
        top[s] = row
        sp = stage_list[s]
        bands.append(StageBand(s, row, row + height[s] - 1, f"stage {s}: mesh {sp.mesh_shape[0]}x{sp.mesh_shape[1]}"))
        row += height[s] + 1

    nodes = []
    node_id: dict[tuple, str] = {}
    for k in order:
        ms = members[k]
        if depth is None:
            nid, module = ms[0].name, "/".join(ms[0].module)
        else:
            module = k[3]
            nid = f"s{k[0]}/L{'' if k[1] is None else k[1]}/{k[2]}/{module}"
        node_id[k] = nid
        weight: dict[str, tuple[float, int]] = {}  # per layout: the group's seconds and ops in it
        for r in ms:
            w = weight.get(sharding_key(r.spec), (0.0, 0))
            weight[sharding_key(r.spec)] = (w[0] + r.compute + r.communication, w[1] + 1)
        key = max(weight, key=lambda c: weight[c])
        main = max((r for r in ms if sharding_key(r.spec) == key), key=lambda r: (r.compute + r.communication, -r.index))
        names = tuple(r.name for r in ms)
        nodes.append(
            GraphNode(
                nid, names, main.name, main.stage, main.layer, main.phase, module, main.primitive, main.spec,
                main.strategy, key, sum(r.compute for r in ms), sum(r.communication for r in ms),
                sum(loose.get(n, 0.0) for n in names), column[k], top[main.stage] + slot[k],
            )
        )

    merged: dict[tuple[str, str], dict[str, Any]] = {}
    inner: dict[str, float] = {}
    for (a, b), e in edge_data.items():
        src, dst = node_id[group_of[a]], node_id[group_of[b]]
        if src == dst:  # inside a group (one stage): its reshardings are the node's
            inner[src] = inner.get(src, 0.0) + e["resharding"]
            continue
        m = merged.setdefault((src, dst), {"tensors": [], "resharding": 0.0, "nbytes": 0, "seconds": 0.0, "phase": ""})
        m["tensors"].extend(t for t in e["tensors"] if t not in m["tensors"])
        m["resharding"] += e["resharding"]
        m["nbytes"] += e["nbytes"]
        m["seconds"] += e["seconds"]
        m["phase"] = _join_phase(m["phase"], e["phase"])
    if inner:
        nodes = [replace(n, resharding=n.resharding + inner[n.id]) if n.id in inner else n for n in nodes]
    stage_of_node = {n.id: n.stage for n in nodes}
    edges = []
    for (src, dst), m in merged.items():
        kind = "cross_mesh" if stage_of_node[src] != stage_of_node[dst] else "reshard" if m["resharding"] > 0 else "data"
        edges.append(GraphEdge(src, dst, kind, tuple(m["tensors"]), m["resharding"], m["nbytes"], m["seconds"], m["phase"]))
    return ProgramGraph(tuple(nodes), tuple(edges), tuple(bands), len(records), depth is not None, depth)
