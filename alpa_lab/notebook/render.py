"""Drawing the views: plotly figures for the live widget, plain HTML/SVG for saved notebooks.

Both draw the data of ``views`` and compute nothing about the plan themselves. The static
HTML needs no JavaScript, so a notebook saved, exported or opened without the widget
manager still shows the plan.
"""

from __future__ import annotations

import html
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


def overview_figure(ov: Overview) -> go.Figure:
    """Left: hosts x devices coloured by stage. Middle: time split per stage. Right: memory."""
    fig = make_subplots(
        rows=1, cols=3, column_widths=[0.3, 0.4, 0.3], horizontal_spacing=0.09,
        subplot_titles=("devices (host x device), by stage", "predicted time per step", "memory per device"),
    )
    z = [[-1 if s is None else s for s in row] for row in ov.device_stage]
    text = [list(row) for row in ov.device_labels]
    n = max(len(ov.stages), 1)
    scale = [[0.0, IDLE], [1.0 / (n + 1), IDLE]]
    for i in range(n):
        lo, hi = (i + 1) / (n + 1), (i + 2) / (n + 1)
        scale += [[lo, colour(i)], [hi, colour(i)]]
    fig.add_trace(
        go.Heatmap(z=z, text=text, texttemplate="%{text}", colorscale=scale, zmin=-1, zmax=n - 1 + 1e-9, showscale=False,
                   xgap=2, ygap=2, hovertemplate="host %{y}, device %{x}: %{text}<extra></extra>"),
        row=1, col=1,
    )
    fig.update_yaxes(autorange="reversed", title_text="host", row=1, col=1, dtick=1)
    fig.update_xaxes(title_text="device", row=1, col=1, dtick=1)
    names = [f"stage {s.index}" for s in ov.stages]
    for part, col in (("compute", "#4C78A8"), ("communication", "#F58518"), ("bubble", "#CCCCCC"), ("update", "#54A24B")):
        fig.add_trace(
            go.Bar(y=names, x=[getattr(s, part) * 1e3 for s in ov.stages], name=part, orientation="h", marker_color=col),
            row=1, col=2,
        )
    fig.update_xaxes(title_text="ms", row=1, col=2)
    fig.update_layout(barmode="stack")
    # memory on a log scale, so a stage using kilobytes still shows beside a capacity of gigabytes
    fig.add_trace(
        go.Bar(x=names, y=[max(s.memory, 1.0) for s in ov.stages], name="memory", showlegend=False,
               marker_color=[colour(s.index) for s in ov.stages], text=[_fmt_bytes(s.memory) for s in ov.stages],
               textposition="auto", hovertemplate="%{x}: %{text} per device<extra></extra>"),
        row=1, col=3,
    )
    fig.add_hline(y=ov.capacity, line_dash="dash", line_color="red", row=1, col=3,
                  annotation_text=f"capacity {_fmt_bytes(ov.capacity)}", annotation_position="bottom right")
    fig.update_yaxes(type="log", exponentformat="SI", ticksuffix="B", title_text="per device (log)", row=1, col=3)
    fig.update_layout(height=320, margin=dict(l=40, r=20, t=40, b=40), legend=dict(orientation="h", y=-0.2))
    return fig


def heatmap_figure(info: TensorInfo, tiles: Sequence[Tile]) -> go.Figure:
    """Left: the mesh, each device coloured by the tile it holds. Right: the tensor cut into tiles."""
    ids = views.tile_ids(tiles)
    fig = make_subplots(
        rows=1, cols=2,
        subplot_titles=(f"mesh {info.mesh_shape[0]}x{info.mesh_shape[1]}: tile per device", f"tensor {info.shape} by tile"),
    )
    rows, cols = info.mesh_shape
    z = [[0] * cols for _ in range(rows)]
    text = [[""] * cols for _ in range(rows)]
    for t in tiles:
        r, c = t.mesh_coord
        z[r][c] = ids[t.tile_index]
        region = ", ".join(f"{a}:{b}" for a, b in t.region)
        text[r][c] = f"dev {t.device}<br>[{region}]" + (f"<br>copy {t.replica + 1}" if t.replica else "")
    n = max(len(ids), 1)
    scale = []
    for i in range(n):
        scale += [[i / n, colour(i)], [(i + 1) / n, colour(i)]]
    fig.add_trace(
        go.Heatmap(z=z, text=text, texttemplate="%{text}", colorscale=scale, zmin=-0.5, zmax=n - 0.5, showscale=False,
                   xgap=2, ygap=2, hovertemplate="%{text}<extra></extra>"),
        row=1, col=1,
    )
    grid, (n_rows, n_cols) = views.tensor_grid(info, tiles)
    ys = [r * n_rows / grid.shape[0] for r in range(grid.shape[0])]  # cells at the tensor's own indices
    xs = [c * n_cols / grid.shape[1] for c in range(grid.shape[1])]
    holders: dict[int, list[int]] = {}
    for t in tiles:
        holders.setdefault(ids[t.tile_index], []).append(t.device)
    hover = [[f"tile {v}: devices {holders.get(int(v), [])}" for v in row] for row in grid]
    fig.add_trace(
        go.Heatmap(z=grid, x=xs, y=ys, text=hover, colorscale=scale, zmin=-0.5, zmax=n - 0.5, showscale=False,
                   hovertemplate="%{text}<extra></extra>"),
        row=1, col=2,
    )
    fig.update_yaxes(autorange="reversed", row=1, col=1, tickvals=list(range(rows)), title_text="mesh axis 0")
    fig.update_xaxes(tickvals=list(range(cols)), row=1, col=1, title_text="mesh axis 1")
    fig.update_yaxes(autorange="reversed", row=1, col=2, title_text=f"dim 0 (size {n_rows})")
    fig.update_xaxes(title_text=f"last dim (size {n_cols})", row=1, col=2)
    if len(ys) <= 16:  # few cells: a tick per cell, not fractional ones
        fig.update_yaxes(tickvals=ys, row=1, col=2)
    if len(xs) <= 16:
        fig.update_xaxes(tickvals=xs, row=1, col=2)
    fig.update_layout(
        height=300, margin=dict(l=40, r=20, t=40, b=40),
        title=dict(text=f"{html.escape(info.name)}: {info.spec} ({info.dtype}) on stage {info.stage}", font=dict(size=13)),
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
    for key, bs in groups.items():
        fig.add_trace(
            go.Bar(
                y=[lane_name[(b.source, b.mesh, b.kind == "TRANSFER")] for b in bs],
                x=[(b.end - b.start) * 1e3 for b in bs],
                base=[b.start * 1e3 for b in bs],
                orientation="h",
                name=key,
                text=[views.bar_label(b) for b in bs],
                textposition="inside",
                marker_color=TRANSFER_COLOUR if key == "transfer" else PHASE_COLOUR.get(key, "#888"),
                customdata=[[b.stage, b.microbatch] for b in bs],
                hovertemplate="stage %{customdata[0]} mb %{customdata[1]}: %{base:.4f}..%{x:.4f} ms<extra>%{fullData.name}</extra>",
            )
        )
    fig.update_yaxes(autorange="reversed", categoryorder="array", categoryarray=[lane_name[k] for k in lanes])
    fig.update_layout(
        barmode="overlay", height=max(200, 60 + 28 * len(lanes)), margin=dict(l=40, r=20, t=40, b=40),
        xaxis_title="ms", title=dict(text=title, font=dict(size=13)),
    )
    return fig


def traffic_figure(matrix: Sequence[Sequence[float]], labels: Sequence[str], title: str) -> go.Figure:
    """Bytes per step from row to column, as a heatmap with the numbers written in."""
    text = [[_fmt_bytes(v) if v else "" for v in row] for row in matrix]
    fig = go.Figure(
        go.Heatmap(z=[list(r) for r in matrix], x=list(labels), y=list(labels), text=text, texttemplate="%{text}",
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
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{lane_h * len(lanes) + 24}" font-size="10">']
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
