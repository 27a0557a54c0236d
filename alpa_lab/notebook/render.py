"""Drawing the views: plotly figures for the live widget, plain HTML/SVG for saved notebooks.

Both draw the data of ``views`` and compute nothing about the plan themselves. The static
HTML needs no JavaScript, so a notebook saved, exported or opened without the widget
manager still shows the plan.
"""

from __future__ import annotations

import html
import math
from typing import Sequence

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from alpa_lab.cost.cluster import _fmt_bytes
from alpa_lab.notebook import views
from alpa_lab.notebook.views import Bar, Overview, RowGroup, TensorInfo, Tile

PALETTE = ("#4C78A8", "#F58518", "#54A24B", "#E45756", "#72B7B2", "#EECA3B", "#B279A2", "#FF9DA6", "#9D755D", "#BAB0AC")
PHASE_COLOUR = {
    "forward": "#4C78A8",
    "backward": "#F58518",
    "backward_input": "#F58518",
    "backward_weight": "#E45756",
    "apply": "#54A24B",
}
TRANSFER_COLOUR = "#BAB0AC"
IDLE = "#EEEEEE"


def colour(i: int | None) -> str:
    return IDLE if i is None or i < 0 else PALETTE[i % len(PALETTE)]


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3f} ms"


# ---------------------------------------------------------------------------------------
# Plotly figures
# ---------------------------------------------------------------------------------------


NARROW = 520
"""figure width (px) the text is laid out for: a 1000 px JupyterLab window with its file browser
open leaves an output about 530 px wide; wider figures only give the text more room."""
CHAR = 0.62
"""width of a character in font sizes (plotly's Open Sans, digits and capitals on the safe side)."""


def _text_fits(text: str, width: float, height: float, size: float) -> bool:
    lines = text.split("<br>")
    return max(len(line) for line in lines) * CHAR * size <= width - 4 and len(lines) * 1.3 * size <= height - 2


def _font_for(texts: Sequence[str], width: float, height: float, largest: int = 12, smallest: int = 8) -> int | None:
    """The largest font size (``smallest``..``largest``) at which every text fits its cell, or None."""
    for size in range(largest, smallest - 1, -1):
        if all(_text_fits(t, width, height, size) for t in texts if t):
            return size
    return None


def _short(text: str, chars: int) -> str:
    """``text`` cut in the middle to ``chars`` characters (an argument path keeps its two ends)."""
    if len(text) <= chars:
        return text
    keep = max(chars - 1, 2)
    return text[: keep - keep // 2] + "\u2026" + text[len(text) - keep // 2 :]


def overview_figure(ov: Overview) -> go.Figure:
    """Left: hosts x devices coloured by stage, each stage's block labelled once. Middle: time split
    per stage. Right: memory."""
    fig = make_subplots(
        rows=1, cols=3, column_widths=[0.3, 0.4, 0.3], horizontal_spacing=0.1,
        subplot_titles=("devices by stage", "predicted time by stage", "memory per device (log)"),
    )
    fig.update_annotations(font_size=12)  # the subplot titles: each within its third at NARROW
    z = [[-1 if s is None else s for s in row] for row in ov.device_stage]
    text = [list(row) for row in ov.device_labels]
    n = max(len(ov.stages), 1)
    scale = [[0.0, IDLE], [1.0 / (n + 1), IDLE]]
    for i in range(n):
        lo, hi = (i + 1) / (n + 1), (i + 2) / (n + 1)
        scale += [[lo, colour(i)], [hi, colour(i)]]
    fig.add_trace(
        go.Heatmap(z=z, text=text, colorscale=scale, zmin=-1, zmax=n - 1 + 1e-9, showscale=False,
                   xgap=2, ygap=2, hovertemplate="host %{y}, device %{x}: %{text}<extra></extra>"),
        row=1, col=1,
    )
    # a label per block of devices running the same stage(s), not one per device: "stage 0" written
    # in each of 8 cells runs into its neighbours; shortened to the stage number where it does not fit
    height = 320 - 40 - 60
    cell_w = 0.3 * (1 - 0.2) * (NARROW - 80) / max(ov.devices_per_host, 1)
    cell_h = height / max(ov.num_hosts, 1)
    for b in views.device_blocks(ov):
        if b.label == "idle":
            continue
        w, h = (b.devices[1] - b.devices[0] + 1) * cell_w, (b.hosts[1] - b.hosts[0] + 1) * cell_h
        short = b.label.split(" ", 1)[1]
        label = b.label if _text_fits(b.label, w, h, 11) else short
        size = _font_for([label], w, h, 11)
        if size is None:
            continue  # too small to write in: the hover says it
        fig.add_annotation(x=(b.devices[0] + b.devices[1]) / 2, y=(b.hosts[0] + b.hosts[1]) / 2, text=label, showarrow=False,
                           font=dict(size=size, color="#fff"), bgcolor=colour(ov.device_stage[b.hosts[0]][b.devices[0]]),
                           row=1, col=1)  # the background covers the gaps between the block's cells
    fig.update_yaxes(autorange="reversed", title_text="host", row=1, col=1, dtick=1)
    fig.update_xaxes(title_text="device", row=1, col=1, dtick=1)
    names = [str(s.index) for s in ov.stages]  # "stage 0" beside the device grid runs into it at 1000 px
    for part, col in (("compute", "#4C78A8"), ("communication", "#F58518"), ("bubble", "#CCCCCC"), ("update", "#54A24B")):
        fig.add_trace(
            go.Bar(y=names, x=[getattr(s, part) * 1e3 for s in ov.stages], name=part, orientation="h", marker_color=col,
                   hovertemplate="stage %{y}: %{x:.4f} ms<extra>%{fullData.name}</extra>"),
            row=1, col=2,
        )
    fig.update_xaxes(title_text="ms", row=1, col=2)
    fig.update_yaxes(type="category", autorange="reversed", row=1, col=2)  # no title: it would run into the grid
    fig.update_layout(barmode="stack")
    # memory on a log scale, so a stage using kilobytes still shows beside a capacity of gigabytes
    fig.add_trace(
        go.Bar(x=[str(s.index) for s in ov.stages], y=[max(s.memory, 1.0) for s in ov.stages], name="memory", showlegend=False,
               marker_color=[colour(s.index) for s in ov.stages], text=[_fmt_bytes(s.memory) for s in ov.stages],
               textposition="none", hovertemplate="stage %{x}: %{text} per device<extra></extra>"),
        row=1, col=3,
    )
    fig.add_hline(y=ov.capacity, line_dash="dash", line_color="red", row=1, col=3)
    # an annotation on a log axis is placed in log10 units (add_hline's own would sit far off the plot)
    fig.add_annotation(x=1, xref="x3 domain", y=math.log10(max(ov.capacity, 1.0)), yref="y3", xanchor="right",
                       yanchor="top", showarrow=False, text=f"capacity {_fmt_bytes(ov.capacity)}",
                       font=dict(size=10, color="red"))
    fig.update_xaxes(title_text="stage", type="category", row=1, col=3)
    fig.update_yaxes(type="log", exponentformat="SI", ticksuffix="B", row=1, col=3)
    fig.update_layout(height=320, margin=dict(l=40, r=20, t=40, b=60),
                      legend=dict(orientation="h", yanchor="top", y=-0.3, x=0.3, font=dict(size=11)))
    return fig


def heatmap_figure(info: TensorInfo, tiles: Sequence[Tile]) -> go.Figure:
    """Left: the mesh, each device coloured by the tile it holds. Right: the tensor cut into tiles.

    A mesh cell says which device and tile (its region is in the hover), in a font sized to the
    cells, or nothing when even the smallest font does not fit."""
    ids = views.tile_ids(tiles)
    shape = "x".join(map(str, info.shape)) or "scalar"
    fig = make_subplots(
        rows=1, cols=2, horizontal_spacing=0.14,
        subplot_titles=(f"mesh {info.mesh_shape[0]}x{info.mesh_shape[1]}: tile per device", f"tensor {shape} by tile"),
    )
    fig.update_annotations(font_size=12)
    rows, cols = info.mesh_shape
    z = [[0] * cols for _ in range(rows)]
    text = [[""] * cols for _ in range(rows)]
    hover = [[""] * cols for _ in range(rows)]
    for t in tiles:
        r, c = t.mesh_coord
        z[r][c] = ids[t.tile_index]
        region = ", ".join(f"{a}:{b}" for a, b in t.region)
        text[r][c] = f"dev {t.device}<br>tile {ids[t.tile_index]}" + (f"<br>copy {t.replica + 1}" if t.replica else "")
        hover[r][c] = f"device {t.device}: tile {ids[t.tile_index]} [{region}]" + (f", copy {t.replica + 1}" if t.replica else "")
    cell_w = 0.43 * (NARROW - 100) / max(cols, 1)
    cell_h = (300 - 60 - 50) / max(rows, 1)
    size = _font_for([x for row in text for x in row], cell_w, cell_h)
    n = max(len(ids), 1)
    scale = []
    for i in range(n):
        scale += [[i / n, colour(i)], [(i + 1) / n, colour(i)]]
    fig.add_trace(
        go.Heatmap(z=z, text=text if size else None, customdata=hover, texttemplate="%{text}" if size else None,
                   textfont=dict(size=size or 8, color="#fff"), colorscale=scale, zmin=-0.5, zmax=n - 0.5,
                   showscale=False, xgap=2, ygap=2, hovertemplate="%{customdata}<extra></extra>"),
        row=1, col=1,
    )
    grid, (n_rows, n_cols) = views.tensor_grid(info, tiles)
    ys = [r * n_rows / grid.shape[0] for r in range(grid.shape[0])]  # cells at the tensor's own indices
    xs = [c * n_cols / grid.shape[1] for c in range(grid.shape[1])]
    holders: dict[int, list[int]] = {}
    for t in tiles:
        holders.setdefault(ids[t.tile_index], []).append(t.device)
    cells = [[f"tile {v}: devices {holders.get(int(v), [])}" for v in row] for row in grid]
    fig.add_trace(
        go.Heatmap(z=grid, x=xs, y=ys, text=cells, colorscale=scale, zmin=-0.5, zmax=n - 0.5, showscale=False,
                   hovertemplate="%{text}<extra></extra>"),
        row=1, col=2,
    )
    fig.update_yaxes(autorange="reversed", row=1, col=1, tickvals=list(range(rows)), title_text="mesh axis 0")
    fig.update_xaxes(tickvals=list(range(cols)), row=1, col=1, title_text="mesh axis 1")
    fig.update_yaxes(autorange="reversed", row=1, col=2, title_text=f"dim 0 ({n_rows})")
    fig.update_xaxes(title_text=f"last dim ({n_cols})", row=1, col=2)
    if len(ys) <= 8:  # few cells: a tick per cell, not fractional ones
        fig.update_yaxes(tickvals=ys, row=1, col=2)
    if len(xs) <= 8:
        fig.update_xaxes(tickvals=xs, row=1, col=2)
    fig.update_xaxes(nticks=6, row=1, col=2)
    head = f": {info.spec} ({info.dtype}) on stage {info.stage}"
    name = _short(info.name, max(int(NARROW / (CHAR * 13)) - len(head), 12))
    fig.update_layout(
        height=300, margin=dict(l=50, r=20, t=60, b=50),
        title=dict(text=html.escape(name) + head, font=dict(size=13), y=0.97, yanchor="top"),
    )
    return fig


def timeline_figure(bars: Sequence[Bar], title: str = "") -> go.Figure:
    """One lane per mesh (and one for transfers arriving there); bars coloured by phase."""
    fig = go.Figure()
    lanes = sorted({(b.source, b.mesh, b.kind == "TRANSFER") for b in bars}, key=lambda k: (k[0] != "predicted", k[1], k[2]))
    lane_name = {k: f"{'measured ' if k[0] == 'measured' else ''}mesh {k[1]}{' transfers' if k[2] else ''}" for k in lanes}
    groups: dict[str, list[Bar]] = {}
    for b in bars:
        key = "transfer" if b.kind == "TRANSFER" else b.phase
        groups.setdefault(key, []).append(b)
    # bars of a lane may overlap (transfers in flight together): only the first of them is labelled
    labelled: set[int] = set()
    ends: dict[tuple, float] = {}
    for b in sorted(bars, key=lambda b: b.start):
        lane = (b.source, b.mesh, b.kind == "TRANSFER")
        if b.start >= ends.get(lane, float("-inf")):
            labelled.add(id(b))
        ends[lane] = max(ends.get(lane, float("-inf")), b.end)
    for key, bs in groups.items():
        fig.add_trace(
            go.Bar(
                y=[lane_name[(b.source, b.mesh, b.kind == "TRANSFER")] for b in bs],
                x=[(b.end - b.start) * 1e3 for b in bs],
                base=[b.start * 1e3 for b in bs],
                orientation="h",
                name=key,
                text=[views.bar_label(b) if id(b) in labelled else "" for b in bs],
                textposition="inside", textangle=0, insidetextanchor="middle",
                marker_color=TRANSFER_COLOUR if key == "transfer" else PHASE_COLOUR.get(key, "#888"),
                customdata=[[b.stage, b.microbatch] for b in bs],
                hovertemplate="stage %{customdata[0]} mb %{customdata[1]}: %{base:.4f}..%{x:.4f} ms<extra>%{fullData.name}</extra>",
            )
        )
    fig.update_yaxes(autorange="reversed", categoryorder="array", categoryarray=[lane_name[k] for k in lanes])
    fig.update_layout(
        barmode="overlay", height=max(200, 60 + 28 * len(lanes)), margin=dict(l=40, r=20, t=40, b=40),
        uniformtext=dict(minsize=8, mode="hide"),  # a label that would need a smaller font is left to the hover
        xaxis_title="ms", title=dict(text=title, font=dict(size=13)),
    )
    return fig


def traffic_figure(matrix: Sequence[Sequence[float]], labels: Sequence[str], title: str) -> go.Figure:
    """Bytes per step from row to column, as a heatmap with the numbers written in."""
    text = [[_fmt_bytes(v) if v else "" for v in row] for row in matrix]
    n = max(len(labels), 1)
    size = _font_for([t for row in text for t in row], (NARROW - 120) / n, (320 - 80) / n)  # None: hover only
    fig = go.Figure(
        go.Heatmap(z=[list(r) for r in matrix], x=list(labels), y=list(labels), text=text,
                   texttemplate="%{text}" if size else None, textfont=dict(size=size or 8),
                   colorscale="Blues", hovertemplate="%{y} -> %{x}: %{text}<extra></extra>")
    )
    fig.update_yaxes(autorange="reversed", title_text="from")
    fig.update_xaxes(title_text="to")
    fig.update_layout(height=320, margin=dict(l=40, r=20, t=40, b=40), title=dict(text=title, font=dict(size=13)))
    return fig


# ---------------------------------------------------------------------------------------
# Static HTML (no JavaScript)
# ---------------------------------------------------------------------------------------

_STYLE = (
    "<style>.alpa-lab table{border-collapse:collapse;font:12px monospace;margin:4px 0}"
    ".alpa-lab td,.alpa-lab th{border:1px solid #ddd;padding:2px 6px;text-align:left;white-space:nowrap}"
    ".alpa-lab th{background:#f4f4f4}.alpa-lab .dev{width:46px;height:22px;text-align:center;color:#fff}"
    ".alpa-lab h4{margin:8px 0 2px 0;font:bold 13px sans-serif}</style>"
)


def styled(fragment: str) -> str:
    """An HTML fragment with the workbench's table style (for the widget's HTML panes)."""
    return f'<div class="alpa-lab">{_STYLE}{fragment}</div>'


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{c}</td>" for c in row) + "</tr>" for row in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def overview_html(ov: Overview) -> str:
    grid = "".join(
        "<tr><th>host %d</th>%s</tr>"
        % (h, "".join(f'<td class="dev" style="background:{colour(s)}">{html.escape(label)}</td>' for s, label in zip(row, labels)))
        for h, (row, labels) in enumerate(zip(ov.device_stage, ov.device_labels))
    )
    rows = [
        [
            str(s.index),
            "" if s.layers is None else f"{s.layers[0]}..{s.layers[1]}",
            f"{s.submesh_shape[0]}x{s.submesh_shape[1]}",
            f"{s.logical_shape[0]}x{s.logical_shape[1]}",
            _ms(s.compute), _ms(s.communication), _ms(s.bubble), _ms(s.update),
            f"{_fmt_bytes(s.memory)} / {_fmt_bytes(s.capacity)}",
            html.escape(s.method),
        ]
        for s in ov.stages
    ]
    head = (
        f"<h4>{html.escape(ov.cluster_name)}: predicted step {_ms(ov.step_time)}, memory/device up to "
        f"{_fmt_bytes(ov.memory)} of {_fmt_bytes(ov.capacity)}"
        + (f", schedule {html.escape(ov.schedule)} x {ov.num_microbatches} micro-batches" if ov.schedule else "")
        + "</h4>"
    )
    table = _table(
        ["stage", "layers", "sub-mesh", "logical", "compute", "communication", "bubble", "update", "memory / capacity", "method"], rows
    )
    return head + f"<table>{grid}</table>" + table


def timeline_svg(bars: Sequence[Bar], width: int = 900) -> str:
    """The timeline as inline SVG: a lane per mesh (and its incoming transfers)."""
    if not bars:
        return ""
    lanes = sorted({(b.source, b.mesh, b.kind == "TRANSFER") for b in bars}, key=lambda k: (k[0] != "predicted", k[1], k[2]))
    lane_of = {k: i for i, k in enumerate(lanes)}
    t0 = min(b.start for b in bars)
    t1 = max(b.end for b in bars)
    span = max(t1 - t0, 1e-12)
    left, lane_h = 140, 22
    scale = (width - left - 10) / span
    height = lane_h * len(lanes) + 24  # scales down to a narrower notebook (viewBox), never wider than its width
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" viewBox="0 0 {width} {height}" '
             'style="max-width:100%;height:auto" font-size="10">']
    for k, i in lane_of.items():
        name = f"{'measured ' if k[0] == 'measured' else ''}mesh {k[1]}{' transfers' if k[2] else ''}"
        parts.append(f'<text x="2" y="{i * lane_h + 15}">{html.escape(name)}</text>')
    for b in bars:
        x = left + (b.start - t0) * scale
        w = max((b.end - b.start) * scale, 1.0)
        y = lane_of[(b.source, b.mesh, b.kind == "TRANSFER")] * lane_h + 2
        fill = TRANSFER_COLOUR if b.kind == "TRANSFER" else PHASE_COLOUR.get(b.phase, "#888")
        label = html.escape(views.bar_label(b))
        parts.append(
            f'<rect x="{x:.1f}" y="{y}" width="{w:.1f}" height="{lane_h - 4}" fill="{fill}" stroke="#fff">'
            f"<title>stage {b.stage} {label} {b.start * 1e3:.4f}-{b.end * 1e3:.4f} ms</title></rect>"
        )
        if w > 14:
            parts.append(f'<text x="{x + 2:.1f}" y="{y + 12}" fill="#fff">{label}</text>')
    parts.append(f'<text x="{left}" y="{lane_h * len(lanes) + 18}">0 ms</text>')
    parts.append(f'<text x="{width - 80}" y="{lane_h * len(lanes) + 18}">{span * 1e3:.3f} ms</text></svg>')
    return "".join(parts)


def strategy_html(groups: Sequence[RowGroup], max_rows: int = 200) -> str:
    """The strategy table, blocks that repeat an earlier one folded into it; at most ``max_rows`` op rows."""
    rows = []
    total = sum(len(g.rows) for g in groups)
    shown = 0
    for g in groups:
        if shown >= max_rows:
            break
        if g.repeats:
            names = ", ".join(g.repeats[:4]) + (" ..." if len(g.repeats) > 4 else "")
            rows.append([str(g.stage), "", f"<b>{html.escape(g.block)}</b>",
                         f"<i>also stands for {len(g.repeats)} more with the same strategies: {html.escape(names)}</i>", "", ""])
        for r in g.rows[: max_rows - shown]:
            note = ("pinned" if r.pinned else "") + (f" follows {html.escape(r.merged_into)}" if r.merged_into not in ("", r.name) else "")
            layer = "" if r.layer is None else str(r.layer)
            rows.append([str(r.stage), layer, html.escape(r.name), html.escape(r.strategy), f"{r.cost * 1e6:.2f} us", note])
        shown += min(len(g.rows), max_rows - shown)
    more = f"<i>... {total - shown} more rows: narrow the filter</i>" if total > shown else ""
    return _table(["stage", "layer", "op", "strategy", "cost", "note"], rows) + more


def static_html(ov: Overview, bars: Sequence[Bar], groups: Sequence[RowGroup], traffic: str = "") -> str:
    """The whole workbench as one self-contained HTML fragment (what a saved notebook shows).

    Predicted and measured timelines are drawn apart: each on its own time scale (simulated
    devices run far slower than the cluster the plan was priced for)."""
    timelines = "".join(
        f"<h4>pipeline timeline ({source})</h4>{timeline_svg(part)}"
        for source in ("predicted", "measured")
        if (part := [b for b in bars if b.source == source])
    )
    return (
        f'<div class="alpa-lab">{_STYLE}{overview_html(ov)}'
        + timelines
        + traffic
        + f"<h4>strategies</h4>{strategy_html(groups)}</div>"
    )


def traffic_cell_html(tr: views.Traffic, cell: tuple[int, int], max_tasks: int = 12) -> str:
    """The tensors behind one cell of the mesh matrix, each with its unit tasks."""
    parts = [f"<b>mesh {cell[0]} -> mesh {cell[1]}</b>"]
    for t in tr.transfers.get(cell, ()):
        k = t.times_per_step(tr.num_microbatches)
        rs = t.resharding
        parts.append(
            f"<div><code>{html.escape(t.name)}</code> {html.escape(t.dtype)}{list(t.shape)} ({t.phase}, x{k} per step): "
            f"{rs.src_spec} on {list(rs.src_devices)} -> {rs.dst_spec} on {list(rs.dst_devices)}, "
            f"{_fmt_bytes(t.nbytes)} per move, {len(rs.tasks)} unit tasks</div>"
        )
        rows = [
            [", ".join(f"{a}:{b}" for a, b in u.region), _fmt_bytes(u.nbytes), str(list(u.senders)), str(list(u.receivers)),
             html.escape(", ".join(f"{s}->{r}" for s, r in u.assignment))]
            for u in rs.tasks[:max_tasks]
        ]
        parts.append(_table(["region", "bytes", "senders", "receivers", "sends"], rows))
        if len(rs.tasks) > max_tasks:
            parts.append(f"<i>... {len(rs.tasks) - max_tasks} more unit tasks</i>")
    return "".join(parts)


def traffic_html(tr: views.Traffic) -> str:
    def matrix(m: Sequence[Sequence[int]], what: str) -> str:
        header = ["from \\ to"] + [f"{what} {j}" for j in range(len(m))]
        rows = [[f"{what} {i}"] + [_fmt_bytes(v) if v else "" for v in row] for i, row in enumerate(m)]
        return _table(header, rows)

    return (
        "<h4>resharding traffic per step</h4>" + matrix(tr.mesh_bytes, "mesh") + matrix(tr.host_bytes, "host")
    )


# ---------------------------------------------------------------------------------------
# Program graph
# ---------------------------------------------------------------------------------------

EDGE_STYLE = {
    "data": ("#BBBBBB", "data"),
    "reshard": ("#D62728", "resharding on a mesh"),
    "cross_mesh": ("#FF7F0E", "cross-mesh transfer"),
}
KEY_NAMES = {"R": "replicated"}


def _key_name(key: str) -> str:
    """``"S0"`` -> ``"S0: split on mesh axis 0"``, the legend of a sharding colour."""
    if key in KEY_NAMES:
        return f"{key}: {KEY_NAMES[key]}"
    parts = [p[1:] for p in key.split("+")]
    if len(parts) == 1:
        axes = parts[0]
        return f"{key}: split on mesh axis {axes}" if len(axes) == 1 else f"{key}: split on mesh axes {' and '.join(axes)}"
    return f"{key}: dims split on mesh axes " + ", ".join(parts)


def _edge_width(cost: float, top: float) -> float:
    """1.5 to 5 px by cost against the costliest edge, in half pixels (one trace per width)."""
    return 1.5 if top <= 0 else round((1.5 + 3.5 * min(cost / top, 1.0)) * 2) / 2


def _node_hover(n: views.GraphNode) -> str:
    lines = [f"<b>{html.escape(n.title)}</b>", f"stage {n.stage}" + ("" if n.layer is None else f", layer {n.layer}")
             + (f", {n.phase}" if n.phase else "")]
    if len(n.ops) > 1:
        lines.append(f"costliest op {html.escape(n.main)} ({html.escape(n.primitive)})")
    else:
        lines.append(html.escape(n.primitive))
    lines += [
        f"strategy {html.escape(n.strategy)}", f"output {n.spec} (colour {n.key})",
        f"compute {n.compute * 1e6:.2f} us, collectives {n.communication * 1e6:.2f} us",
    ]
    if n.resharding:
        lines.append(f"resharding not drawn as an edge {n.resharding * 1e6:.2f} us")
    lines.append("<i>click: select it in Strategies and Sharding</i>")
    return "<br>".join(lines)


def _edge_hover(e: views.GraphEdge, src: views.GraphNode, dst: views.GraphNode) -> str:
    tensors = ", ".join(e.tensors[:4]) + (f" (+{len(e.tensors) - 4})" if len(e.tensors) > 4 else "")
    head = f"{html.escape(tensors)}<br>stage {src.stage} -> stage {dst.stage}"
    if e.kind == "cross_mesh":
        moved = f"{_fmt_bytes(e.nbytes)} per step, {_ms(e.seconds)}" if e.nbytes else "moved once, on the first reader's edge"
        return f"{head} ({e.phase or 'same tensor'}): {moved}" + (f"<br>then resharded {e.resharding * 1e6:.2f} us" if e.resharding else "")
    return f"{head}: resharding {e.resharding * 1e6:.2f} us"


def graph_figure(g: views.ProgramGraph, selected: str | None = None, title: str = "") -> go.Figure:
    """Nodes coloured by the layout they compute, in stage bands; grey data edges, red reshardings
    and orange cross-mesh transfers as wide as their cost. A node's ``customdata`` is the op a click
    selects; ``selected`` (an op) is ringed."""
    fig = go.Figure()
    pos = {n.id: (n.x, n.y) for n in g.nodes}
    by_id = {n.id: n for n in g.nodes}
    width = max((n.x for n in g.nodes), default=0)
    for b in g.bands:
        fig.add_shape(type="rect", x0=-0.5, x1=width + 0.5, y0=b.top - 0.45, y1=b.bottom + 0.45, layer="below",
                      fillcolor=colour(b.stage), opacity=0.1, line_width=0)
    top = max((e.cost for e in g.edges if e.kind != "data"), default=0.0)
    lines: dict[tuple[str, float], list[views.GraphEdge]] = {}
    for e in g.edges:
        lines.setdefault((e.kind, 0.8 if e.kind == "data" else _edge_width(e.cost, top)), []).append(e)
    shown_kinds: set[str] = set()
    for (kind, w), es in sorted(lines.items(), key=lambda kv: (list(EDGE_STYLE).index(kv[0][0]), kv[0][1])):
        xs: list[float | None] = []
        ys: list[float | None] = []
        for e in es:
            (x0, y0), (x1, y1) = pos[e.src], pos[e.dst]
            xs += [x0, x1, None]
            ys += [y0, y1, None]
        col, name = EDGE_STYLE[kind]
        fig.add_trace(go.Scatter(x=xs, y=ys, mode="lines", line=dict(color=col, width=w), hoverinfo="skip",
                                 name=name, legendgroup=kind, showlegend=kind not in shown_kinds))
        shown_kinds.add(kind)
    marked = [e for e in g.edges if e.kind != "data"]
    if marked:  # hover points half-way along the highlighted edges
        fig.add_trace(go.Scatter(
            x=[(pos[e.src][0] + pos[e.dst][0]) / 2 for e in marked], y=[(pos[e.src][1] + pos[e.dst][1]) / 2 for e in marked],
            mode="markers", marker=dict(size=7, symbol="diamond", color=[EDGE_STYLE[e.kind][0] for e in marked]),
            hovertext=[_edge_hover(e, by_id[e.src], by_id[e.dst]) for e in marked], hoverinfo="text", showlegend=False,
            name="edges",
        ))
    heaviest = max((n.compute + n.communication for n in g.nodes), default=0.0)
    keys = sorted({n.key for n in g.nodes}, key=lambda k: (k != "R", k))
    for i, key in enumerate(keys):
        ns = [n for n in g.nodes if n.key == key]
        size = [8 + 12 * ((n.compute + n.communication) / heaviest) ** 0.5 if heaviest > 0 else 10 for n in ns]
        fig.add_trace(go.Scatter(
            x=[n.x for n in ns], y=[n.y for n in ns], mode="markers", name=_key_name(key),
            marker=dict(size=size, color=colour(i), line=dict(color="#333", width=0.5)),
            customdata=[n.main for n in ns], hovertext=[_node_hover(n) for n in ns], hoverinfo="text",
        ))
    ring = next((n for n in g.nodes if selected in n.ops), None)  # always a trace, so a widget can move it
    fig.add_trace(go.Scatter(x=[ring.x] if ring else [], y=[ring.y] if ring else [], mode="markers", name="selected",
                             showlegend=False, hoverinfo="skip",
                             marker=dict(size=26, symbol="circle-open", color="#000", line=dict(width=2))))
    fig.update_xaxes(visible=False, range=[-0.8, width + 0.8])
    rows = max((b.bottom for b in g.bands), default=0)
    fig.update_yaxes(autorange=False, range=[rows + 0.8, -0.8], zeroline=False, showgrid=False,
                     tickvals=[(b.top + b.bottom) / 2 for b in g.bands], ticktext=[f"stage {b.stage}" for b in g.bands])
    what = f"{g.num_ops} ops in {len(g.nodes)} groups" if g.grouped else f"{g.num_ops} ops"
    fig.update_layout(
        height=min(max(300, 150 + 22 * (rows + 1)), 760), margin=dict(l=60, r=10, t=36, b=75), plot_bgcolor="#fff",
        title=dict(text=title or f"{what}; edge width: cost", font=dict(size=12), x=0.01, xanchor="left"),
        # below the plot, in the bottom margin kept for it (two rows when the figure is narrow)
        legend=dict(orientation="h", yref="container", y=0, yanchor="bottom", font=dict(size=11)), hoverlabel=dict(align="left"),
    )
    return fig
