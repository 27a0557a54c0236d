"""The live profiling dashboard of a training run: what the run does, next to what the plan predicted.

``dashboard_state(run)`` is the content, computed from the run's monitor (pure; tests check
it against the run's own events, steps, memory and traffic); ``Dashboard(run)`` draws it and
redraws it from a background thread whenever the monitor changed (every ``interval`` seconds
at most), so the kernel stays free. Everything drawn is plain HTML/SVG, so a saved notebook
keeps a static copy of the last state (the display is updated with it when the run ends).

A browser that draws slower than the dashboard sends (starved of CPU by the run it shows, or
drawing a big plan's timeline) falls behind further with every redraw, until the Jupyter server
drops its connection. So the browser acknowledges each redraw once drawn (``_Pacer``) and
the dashboard sends the next only then: at most one redraw in flight. Acknowledgements reach
the kernel on its shell thread, which is blocked while a cell runs: then the dashboard redraws
on its clock. A browser that does not answer for ``max_wait`` seconds (its tab closed or in the
background, or the shell busy with a button's work) gets one redraw per ``max_wait``.
"""

from __future__ import annotations

import html
import json
import threading
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import anywidget
import ipywidgets as W
import numpy as np
import traitlets

from alpa_lab.cost.cluster import ClusterSpec, _fmt_bytes
from alpa_lab.cost.profile import ProfileError, ProfileRow
from alpa_lab.notebook import render, views
from alpa_lab.plan import PipelinePlan, memory_per_mesh
from alpa_lab.runtime.monitor import MonitorSnapshot, median_step, profile

__all__ = ["Dashboard", "DashboardState", "LinkLine", "MemoryLine", "dashboard_state"]


@dataclass(frozen=True)
class MemoryLine:
    """One device: measured bytes against the plan's eq. 5 figure and the device's capacity."""

    worker: int
    device: str
    device_id: int
    measured: int
    predicted: float
    capacity: float
    source: str
    """where ``measured`` comes from ("backend" or "live buffers"); ``capacity``'s from "backend" or "cluster spec" """


@dataclass(frozen=True)
class LinkLine:
    """Bytes per step between two mesh workers (or meshes, in-process): the last step's count and the plan's."""

    sender: int
    receiver: int
    measured: int | None
    """None where no step was counted yet (a Ray worker's received tiles; in this process, each receiving device's
    shard of what a profiled step moved between meshes)"""
    predicted: int


@dataclass(frozen=True)
class DashboardState:
    """What the dashboard shows at one moment."""

    status: str
    error: str
    backend: str
    steps_done: int
    steps_total: int
    step_time: float
    """median measured step seconds (the compiling first step left out)"""
    predicted_step_time: float
    samples_per_second: float
    tflops: float
    """achieved TFLOP/s: the plan's FLOPs per step over the measured step time"""
    loss: float | None
    bars: tuple[views.Bar, ...]
    """measured instructions of the last steps (the monitor's window), from the window's first start"""
    memory: tuple[MemoryLine, ...]
    links: tuple[LinkLine, ...]
    costs: tuple[ProfileRow, ...]
    ray_dashboard: str
    steps: tuple[tuple[int, float, float | None], ...]
    """(step, seconds, loss) of the recent steps, for the charts"""
    serial_step_time: float = 0.0
    """the plan's step with one unit task at a time, where the run ran so (in this process); 0 otherwise"""


def _predicted_memory(plan: Any) -> dict[int, float]:
    """Device id -> the plan's eq. 5 bytes on it."""
    if isinstance(plan, PipelinePlan):
        return {d: b for devices, b in memory_per_mesh(plan.stages).items() for d in devices}
    return {d: plan.memory_per_device for d in plan.device_ids}


def dashboard_state(run: Any, snap: MonitorSnapshot | None = None) -> DashboardState:
    """The dashboard's content for ``run`` (a ``TrainingRun``) from its monitor's snapshot."""
    snap = snap or run.monitor.snapshot()
    plan = run.plan
    cluster = ClusterSpec(**plan.cluster)
    step_time = median_step(snap.recent)
    samples = snap.recent[-1].samples if snap.recent else 0
    flops = snap.recent[-1].flops if snap.recent else 0.0
    predicted_mem = _predicted_memory(plan)
    memory = tuple(
        MemoryLine(m.worker, m.device, m.device_id, m.bytes_in_use, predicted_mem.get(m.device_id, 0.0),
                   float(m.bytes_limit) if m.bytes_limit else cluster.device_memory, m.source)
        for m in snap.memory
    )
    rr = run.ray_run
    if rr is not None:
        predicted = rr.predicted_bytes()
        measured = dict(snap.recent[-1].link_bytes) if snap.recent else {}
        keys = sorted(set(predicted) | set(measured))
        links = tuple(LinkLine(a, b, measured.get((a, b), 0), predicted.get((a, b), 0)) for a, b in keys)
    elif isinstance(plan, PipelinePlan):
        tr = views.traffic(plan)  # measured: the bytes a profiled in-process step counted landing (None before one)
        measured = dict(snap.recent[-1].link_bytes) if snap.recent and snap.recent[-1].link_bytes else None
        keys = sorted(set(tr.cells) | set(measured or {}))
        links = tuple(LinkLine(a, b, None if measured is None else measured.get((a, b), 0), int(tr.mesh_bytes[a][b]))
                      for a, b in keys)
    else:
        links = ()
    serial = not run.on_ray and isinstance(plan, PipelinePlan)  # this process runs one unit task at a time
    try:
        costs = profile(plan, run.monitor, serial=serial).rows
    except ProfileError:
        costs = ()
    url = getattr(getattr(run.step, "ray_cluster", None), "dashboard_url", "") or ""
    return DashboardState(
        status=snap.status,
        error=snap.error,
        backend=run.backend,
        steps_done=snap.steps_done,
        steps_total=snap.steps_total or run.steps,
        step_time=step_time,
        predicted_step_time=plan.estimated_step_time,
        samples_per_second=samples / step_time if step_time > 0 else 0.0,
        tflops=flops / step_time / 1e12 if step_time > 0 else 0.0,
        loss=snap.recent[-1].loss if snap.recent else None,
        bars=views.event_bars(snap.events),
        memory=memory,
        links=links,
        costs=costs,
        ray_dashboard=url,
        steps=tuple((r.step, r.seconds, r.loss) for r in snap.recent),
        serial_step_time=plan.serial_step_time if serial else 0.0,
    )


# ----- drawing (HTML and SVG strings) -------------------------------------------------------------
_STATUS_COLOUR = {"running": "#070", "launching": "#a60", "starting": "#a60", "finished": "#333", "stopped": "#a60", "failed": "#c00"}


def header_html(s: DashboardState) -> str:
    colour = _STATUS_COLOUR.get(s.status, "#333")
    loss = "-" if s.loss is None else f"{s.loss:.5g}"
    ratio = f" ({s.step_time / s.predicted_step_time:.2f}x)" if s.predicted_step_time > 0 and s.step_time > 0 else ""
    predicted = f"{render._ms(s.predicted_step_time)} predicted{ratio}"
    if s.serial_step_time > 0:  # this process runs one unit task at a time: that is the like-for-like figure
        serial = f" ({s.step_time / s.serial_step_time:.2f}x)" if s.step_time > 0 else ""
        predicted = (f"{render._ms(s.serial_step_time)} predicted one unit task at a time, as this process runs them{serial}; "
                     f"{render._ms(s.predicted_step_time)} with every mesh at work at once, as mesh workers run them")
    parts = [
        f'<b style="color:{colour}">{html.escape(s.status)}</b> on {html.escape(s.backend)}',
        f"step {s.steps_done}/{s.steps_total}",
        f"step time {render._ms(s.step_time)} measured, {predicted}",
        f"{s.samples_per_second:,.1f} samples/s",
        f"{s.tflops:.4g} TFLOP/s",
        f"loss {loss}",
    ]
    if s.ray_dashboard:
        url = html.escape(s.ray_dashboard)
        parts.append(f'<a href="{url}" target="_blank">Ray dashboard</a>')
    text = " &middot; ".join(parts)
    if s.error:
        text += f'<br><span style="color:#c00">&#9888; {html.escape(s.error)} (the plan and the last good state are kept: run.state)</span>'
    return render.styled(text)


def series_svg(points: Sequence[tuple[int, float]], title: str, unit: str, width: int = 420, height: int = 110) -> str:
    """A small line chart of (step, value) points: the title, the last value, the min and max on the axis."""
    pts = [(x, y) for x, y in points if y is not None and np.isfinite(y)]
    if not pts:
        return ""
    xs, ys = [p[0] for p in pts], [p[1] for p in pts]
    x0, x1 = min(xs), max(max(xs), min(xs) + 1)
    y0, y1 = min(ys), max(ys)
    if y1 - y0 < 1e-12:
        y0, y1 = y0 - 1, y1 + 1
    left, top, bottom = 56, 18, 18
    w, h = width - left - 8, height - top - bottom

    def px(x: float, y: float) -> str:
        return f"{left + (x - x0) / (x1 - x0) * w:.1f},{top + (1 - (y - y0) / (y1 - y0)) * h:.1f}"

    line = " ".join(px(x, y) for x, y in pts)
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" viewBox="0 0 {width} {height}" '
        'style="max-width:100%;height:auto" font-size="10">'
        f'<text x="2" y="12">{html.escape(title)}: {ys[-1]:.4g} {html.escape(unit)}</text>'
        f'<text x="2" y="{top + 8}">{y1:.3g}</text><text x="2" y="{top + h}">{y0:.3g}</text>'
        f'<rect x="{left}" y="{top}" width="{w}" height="{h}" fill="none" stroke="#ddd"/>'
        f'<polyline fill="none" stroke="#4C78A8" stroke-width="1.5" points="{line}"/>'
        f'<text x="{left}" y="{height - 4}">step {x0}</text><text x="{width - 60}" y="{height - 4}">step {x1}</text></svg>'
    )


def memory_html(lines: Sequence[MemoryLine]) -> str:
    if not lines:
        return "<i>no memory sample yet</i>"
    rows = [
        [str(m.worker) if m.worker >= 0 else "-", html.escape(m.device), _fmt_bytes(m.measured), _fmt_bytes(m.predicted),
         f"{m.measured / m.predicted:.2f}x" if m.predicted else "-", _fmt_bytes(m.capacity), m.source]
        for m in lines
    ]
    return render._table(["worker", "device", "measured", "plan (eq. 5)", "ratio", "capacity", "measured from"], rows)


def links_html(lines: Sequence[LinkLine], by: str) -> str:
    if not lines:
        return "<i>no cross-mesh traffic</i>"
    rows = [
        [
            f"{by} {ln.sender} -> {by} {ln.receiver}",
            "not counted" if ln.measured is None else _fmt_bytes(ln.measured),
            _fmt_bytes(ln.predicted),
            "-" if ln.measured is None or not ln.predicted else f"{ln.measured / ln.predicted:.2f}x",
        ]
        for ln in lines
    ]
    return render._table(["link", "measured bytes (last step)", "plan's unit tasks", "ratio"], rows)


def costs_html(rows: Sequence[ProfileRow]) -> str:
    if not rows:
        return "<i>measured spans appear after the second step (the first compiles)</i>"
    out = []
    for r in rows:
        what = {"TRANSFER": f"into mesh {r.stage} (per tensor)", "STEP": "step", "UPDATE": f"stage {r.stage} update"}.get(
            r.kind, f"stage {r.stage} {r.phase}")
        out.append([what, render._ms(r.predicted), render._ms(r.measured), f"{r.ratio:.2f}x" if r.predicted > 0 else "-", str(r.count)])
    return render._table(["span (medians)", "predicted", "measured", "measured / predicted", "n"], out)


_PACER_ESM = """
export default {
  render({ model, el }) {
    el.style.display = 'none';
    // after the redraw's messages (they came before this one) are drawn: the next frame
    const ack = () => requestAnimationFrame(() => {
      if (model.get('seen') !== model.get('sent')) { model.set('seen', model.get('sent')); model.save_changes(); }
    });
    model.on('change:sent', ack);
    ack();
    return () => model.off('change:sent', ack);
  }
};
"""


class _Pacer(anywidget.AnyWidget):
    """The browser's acknowledgement of the dashboard's redraws: ``seen`` follows ``sent`` once drawn."""

    _esm = _PACER_ESM
    sent = traitlets.Int(0).tag(sync=True)
    seen = traitlets.Int(-1).tag(sync=True)
    """-1 until a browser shows the dashboard"""


_cell_running = False
"""whether the kernel runs a cell now (IPython's execute events): the shell thread, which takes
the browser's acknowledgements, is blocked meanwhile"""

_watched_shell: Any = None
"""the IPython shell whose execute events set ``_cell_running``"""


def _watch_cells() -> None:
    global _cell_running, _watched_shell
    try:
        from IPython import get_ipython
    except ImportError:  # pragma: no cover - IPython comes with ipywidgets
        return
    ip = get_ipython()
    if ip is None or ip is _watched_shell:
        return

    def started(*_: Any) -> None:
        global _cell_running
        _cell_running = True

    def ended(*_: Any) -> None:
        global _cell_running
        _cell_running = False

    ip.events.register("pre_execute", started)
    ip.events.register("post_execute", ended)
    _watched_shell = ip
    # now: made by a cell, or by a widget's click (the Launch button), which runs no cell; a shell
    # with no kernel (terminal IPython, tests) has no browser to wait for either way
    parent = getattr(ip, "parent_header", None) or {}
    _cell_running = parent.get("header", {}).get("msg_type") == "execute_request"


class Dashboard(W.VBox):
    """A training run's live dashboard; follows the run from a background thread until it ends."""

    def __init__(self, run: Any, *, interval: float = 0.4, follow: bool = True, max_wait: float = 5.0):
        super().__init__()
        self.run = run
        self.interval = interval
        self.max_wait = max_wait
        """seconds to wait for the browser's acknowledgement of a redraw before sending the next anyway"""
        self._pacer = _Pacer()
        self._sent_at = 0.0
        self.waits = 0
        """redraws put off because the browser had not drawn the last one yet"""
        _watch_cells()
        self.updates = 0
        self.update_times: deque[float] = deque(maxlen=10_000)
        """driver clock of each redraw"""
        self.busy_seconds = 0.0
        """time spent redrawing (what the dashboard takes from the run, at most)"""
        self.latencies: deque[float] = deque(maxlen=1000)
        """seconds from the newest event's end to the redraw that showed it (for the benchmark)"""
        self.state: DashboardState | None = None
        self._version = -1
        self._seen_event_at = 0.0
        self._handle: Any = None
        self.on_update: Any = None
        """called with each new ``DashboardState`` (the workbench mirrors the run into its timeline)"""
        self._closed = threading.Event()
        self.header = W.HTML()
        self.stop_button = W.Button(description="Stop", icon="stop", tooltip="stop after the current step; the state is kept")
        self.stop_button.on_click(lambda _: self.run.stop())
        self.trace_path = W.Text(value="alpa_lab_run_trace.json", description="trace file")
        self.export_button = W.Button(description="Export Chrome trace", icon="download")
        self.export_button.on_click(lambda _: self.export_chrome_trace(self.trace_path.value))
        self.timeline = W.HTML()
        self.predicted = W.HTML()
        self.charts = W.HTML()
        self.costs = W.HTML()
        self.memory = W.HTML()
        self.links = W.HTML()
        self.note = W.HTML()
        plan = run.plan
        if isinstance(plan, PipelinePlan):
            bars = views.timeline_bars(plan)
            what = f"{plan.schedule}, {plan.num_microbatches} micro-batches, one step"
            self.predicted.value = render.styled(f"<b>predicted schedule</b> ({what})<br>" + render.timeline_svg(bars))
        self.children = [
            self.header,
            W.HBox([self.stop_button, self.trace_path, self.export_button]),
            self.timeline, self.predicted, self.charts,
            W.HTML("<b>measured against predicted, per stage and phase</b>"), self.costs,
            W.HTML("<b>memory per device</b>"), self.memory,
            W.HTML("<b>bytes per link per step</b>"), self.links, self.note, self._pacer,
        ]
        self.update()
        self._thread = threading.Thread(target=self._follow, name="alpa_lab-dashboard", daemon=True)
        if follow:
            self._thread.start()

    # ----- following the run ------------------------------------------------------------------------
    def _follow(self) -> None:
        while not self._closed.is_set():
            ended = not self.run.running and self.run.status != "starting"
            if self.run.monitor.version != self._version:
                if not ended and self._browser_behind():  # the run's end is drawn regardless
                    self.waits += 1
                else:
                    try:
                        self.update()
                    except Exception as err:  # noqa: BLE001 - a drawing bug must not end the following
                        self.note.value = f'<span style="color:#c00">dashboard: {html.escape(repr(err))}</span>'
            if ended:
                break
            self._closed.wait(self.interval)
        if self._handle is not None:  # the saved notebook keeps the last state
            try:
                self._handle.update(self._bundle(), raw=True)
            except Exception:  # noqa: BLE001 - no kernel display (a script): nothing to update
                pass

    def _browser_behind(self) -> bool:
        """True while a browser shows this dashboard and has not drawn its last redraw (for
        ``max_wait`` seconds at most; not while a cell runs: its acknowledgement waits behind it)."""
        seen, sent = self._pacer.seen, self._pacer.sent
        if seen < 0 or seen >= sent or _cell_running:
            return False
        return time.monotonic() - self._sent_at < self.max_wait

    def follow(self) -> None:
        """Start following the run (a no-op if already following)."""
        if not self._thread.is_alive() and not self._closed.is_set():
            try:
                self._thread.start()
            except RuntimeError:  # started before and ended
                pass

    def wait(self, timeout: float | None = None) -> None:
        """Wait until the run ended and the dashboard drew its last state."""
        if self._thread.is_alive():
            self._thread.join(timeout)

    def close(self) -> None:
        """Stop following the run (the run goes on) and close the widget."""
        self._closed.set()
        super().close()

    def update(self) -> DashboardState:
        """Redraw from the run's monitor now."""
        t0 = time.perf_counter()
        snap = self.run.monitor.snapshot()
        s = dashboard_state(self.run, snap)
        self.header.value = header_html(s)
        lanes = "mesh workers" if self.run.ray_run is not None else "meshes"
        window = f"last {len({b.microbatch for b in s.bars if b.phase == 'step'}) or self.run.monitor.window_steps} steps"
        self.timeline.value = render.styled(f"<b>measured, {lanes}</b> ({window})<br>" + render.timeline_svg(s.bars)) if s.bars else ""
        self.charts.value = (
            series_svg([(i, sec * 1e3) for i, sec, _ in s.steps], "step time", "ms")
            + series_svg([(i, loss) for i, _, loss in s.steps if loss is not None], "loss", "")
        )
        self.costs.value = render.styled(costs_html(s.costs))
        self.memory.value = render.styled(memory_html(s.memory))
        by = "worker" if self.run.ray_run is not None else "mesh"
        self.links.value = render.styled(links_html(s.links, by))
        self.stop_button.disabled = s.status not in ("starting", "launching", "running")
        if snap.last_event_at > self._seen_event_at and snap.events:
            self.latencies.append(time.time() - max(e.end for e in snap.events))
            self._seen_event_at = snap.last_event_at
        self.state = s
        self._version = snap.version
        self.updates += 1
        self.update_times.append(time.time())
        if self.on_update is not None:
            self.on_update(s)
        self._sent_at = time.monotonic()
        self._pacer.sent += 1  # last: the browser acknowledges it after drawing everything above
        self.busy_seconds += time.perf_counter() - t0
        return s

    # ----- export -----------------------------------------------------------------------------------
    def export_chrome_trace(self, path: str | Path) -> Path:
        """The measured window (and the predicted schedule) as Chrome trace JSON; Perfetto opens it."""
        path = Path(path)
        predicted = views.timeline_bars(self.run.plan) if isinstance(self.run.plan, PipelinePlan) else ()
        measured = self.state.bars if self.state else ()
        path.write_text(json.dumps(views.chrome_trace(tuple(predicted) + tuple(measured))))
        self.note.value = f"wrote {html.escape(str(path))}"
        return path

    def to_html(self) -> str:
        """The dashboard's last state as static HTML (no JavaScript)."""
        s = self.state or dashboard_state(self.run)
        parts = [header_html(s)]
        if s.bars:
            parts.append(render.styled("<b>measured</b><br>" + render.timeline_svg(s.bars)))
        parts += [self.predicted.value, self.charts.value, render.styled(costs_html(s.costs)), render.styled(memory_html(s.memory)),
                  render.styled(links_html(s.links, "worker" if self.run.ray_run is not None else "mesh"))]
        return "".join(parts)

    def _bundle(self) -> dict:
        bundle = super()._repr_mimebundle_() or {}
        bundle["text/html"] = self.to_html()
        bundle["text/plain"] = repr(self.run)
        return bundle

    def _repr_mimebundle_(self, **kwargs: Any) -> dict:
        return self._bundle()

    def _ipython_display_(self) -> None:
        from IPython.display import display

        self._handle = display(self._bundle(), raw=True, display_id=True)
