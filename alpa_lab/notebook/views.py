"""What the workbench shows, as plain data computed from a plan.

Every view is a pure function of a ``Plan`` or ``PipelinePlan`` (and, for measured
timelines, the runtime's records) returning frozen dataclasses. The widgets and the static
HTML only draw these, so the tests check the content here without a browser: the heatmap's
tiles against the spec's tile map, the timeline's bars against the schedule's instructions,
the traffic matrix against the resharding plan. A single-mesh ``Plan`` is shown as one
stage, so every view takes both kinds of plan.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
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
    bars = []
    sends = {}
    for r in tl.records:
        if r.kind == "RUN":
            bars.append(Bar(r.mesh, r.stage, "RUN", r.phase, r.microbatch, r.start, r.end))
        elif r.kind == "SEND":
            sends[(r.stage, r.phase, r.microbatch)] = r
    for r in tl.records:
        if r.kind != "RECV":
            continue
        peer = r.stage - 1 if r.phase == "forward" else r.stage + 1
        send = sends.get((peer, r.phase, r.microbatch))
        if send is not None:
            arrival = send.start + tl.transfer_time
            bars.append(Bar(r.mesh, r.stage, "TRANSFER", r.phase, r.microbatch, send.start, arrival, peer=peer))
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
