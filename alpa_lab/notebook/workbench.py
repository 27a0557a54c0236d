"""The workbench widget: a plan's views and its edit controls in one place.

``Workbench(plan, step)`` shows tabs (overview, sharding, timeline, traffic, strategies,
changes). Every edit goes through the plan's own methods (``pin``, ``unpin``,
``pin_stages``, ``with_schedule``), so an edit made with the buttons is exactly the edit
made in code; the re-solve re-uses whatever the edit did not touch (the plan's caches).
An edit that fails shows why and keeps the last good plan. ``run`` trains in a background
thread and streams measured per-stage times into the timeline (only while the run's plan is
the one shown), with its progress in a status line of its own: the dashboard's thread writes
there, the edits write the planning status. Saved notebooks keep a static HTML copy of the
views (``_repr_mimebundle_``), so they read without the widget.
"""

from __future__ import annotations

import html
import json
import math
import statistics
import threading
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import ipywidgets as W
import plotly.graph_objects as go

from alpa_lab.notebook import render, views
from alpa_lab.notebook.autosize import WORKBENCH_CLASS, FitToWidth, figure_widget
from alpa_lab.plan import PipelinePlan, Plan
from alpa_lab.passes.schedule import INFERENCE, TRAINING_SCHEDULES

__all__ = ["Workbench"]

TIMELINE_EVERY = 2.0
"""seconds between two redraws of the Timeline tab's figures while a run goes (the dashboard redraws faster)"""

_RUNTIME_SCHEDULES = ("gpipe", "1f1b", "eager_1f1b", "zb_h1")


def _figure(fig: go.Figure) -> W.Widget:
    return figure_widget(fig)  # at its tab's width (FitToWidth below the tabs)


def _update_in_place(widget: go.FigureWidget, fig: go.Figure) -> bool:
    """Make ``widget`` show ``fig`` by updating its traces and layout, where its traces are ``fig``'s
    (same kinds and names, in order); False, changing nothing, where they are not."""
    if [(t.type, t.name) for t in widget.data] != [(t.type, t.name) for t in fig.data]:
        return False
    with widget.batch_update():  # one message to the browser
        for old, new in zip(widget.data, fig.data):
            props = new.to_plotly_json()
            props.pop("type", None)
            old.update(props, overwrite=True)
        layout = fig.layout.to_plotly_json()
        layout.pop("template", None)  # the same default template: not sent again
        widget.layout.update(layout, overwrite=True)
    return True


def _swap(box: W.Box, children: Sequence[W.Widget]) -> None:
    """Put ``children`` in ``box`` and close the widgets they replace: a figure widget left open
    stays registered in the kernel (its comm and its data) as long as the kernel lives."""
    old = box.children
    box.children = list(children)
    kept = {id(c) for c in children}
    for widget in old:
        if id(widget) not in kept:
            widget.close()


def _parse_ranges(text: str) -> list[list[int]]:
    """``"0-1, 2-3"`` -> ``[[0, 1], [2, 3]]`` (inclusive layer ranges, as ``pin_stages`` takes)."""
    out = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        a, _, b = part.partition("-")
        try:
            first = int(a)
            last = int(b) if b else first
        except ValueError:
            raise ValueError(f"stage layers {part!r}: write inclusive ranges like '0-1, 2-3'") from None
        out.append([first, last])
    if not out:
        raise ValueError("stage layers are empty: write inclusive ranges like '0-1, 2-3'")
    return out


def _parse_shapes(text: str) -> list[tuple[int, int]] | None:
    """``"1x4, 1x4"`` -> ``[(1, 4), (1, 4)]``; empty -> None (an even split)."""
    parts = [p.strip() for p in text.split(",") if p.strip()]
    if not parts:
        return None
    out = []
    for p in parts:
        a, _, b = p.lower().partition("x")
        try:
            out.append((int(a), int(b)))
        except ValueError:
            raise ValueError(f"sub-mesh {p!r}: write shapes like '1x4, 1x4'") from None
    return out


class Workbench(W.VBox):
    """The plan's views and edit controls. ``plan`` is the current plan; ``history`` the older ones."""

    def __init__(
        self, plan: Plan | PipelinePlan, step: Any = None, on_change: Callable[[Plan | PipelinePlan], None] | None = None
    ):
        """``step`` (a ``ParallelizedStep``) runs the edited plan; ``on_change(plan)`` hears of every new plan."""
        super().__init__()
        self._lock = threading.RLock()
        """held by edits and by the run sync (the dashboard's thread): the plan, the measurements and the views"""
        self.plan = plan
        self.step = step
        self.on_change = on_change
        self.history: list[Plan | PipelinePlan] = []
        self._contexts: list[dict[str, Any]] = []
        """per plan in ``history``: the step's context when it was current (``_step_context``), for undo"""
        self.changes: list[str] = []
        self.last_error = ""
        self.measured: tuple[views.Bar, ...] = ()
        self.measured_steps: list[float] = []
        self.measured_serial = False
        """whether the measured steps ran one unit task at a time (in this process), so compare with the plan's so"""
        self.result: Any = None
        self._timeline_drawn = 0.0
        self._timeline_stale = False
        """measurements came in while the Timeline tab was hidden: drawn when it is shown"""
        self._timeline_figures: dict[str, tuple[tuple, W.Widget]] = {}
        """"predicted"/"measured" -> (what its figure shows, the figure widget showing it)"""
        self.refresh_seconds = 0.0

        self.title = W.HTML()
        self.status = W.HTML()
        """the planning status: what the last edit did, or why it was refused"""
        self.run_status = W.HTML()
        """the newest run's progress (written by the dashboard's thread; edits leave it alone)"""
        self.run_error = ""
        # overview
        self.overview_box = W.VBox()
        self.overview_measured = W.HTML()
        # sharding
        self.tensor_select = W.Combobox(placeholder="tensor: op name or argument path", ensure_option=True,
                                        layout=W.Layout(width="60%"))
        self.tensor_select.observe(lambda _: self._show_tensor(), "value")
        self.heatmap_box = W.VBox()
        # timeline
        self.schedule_select = W.Dropdown(description="schedule", options=sorted(TRAINING_SCHEDULES))
        self.schedule_select.observe(self._on_schedule, "value")
        self.trace_path = W.Text(value="alpa_lab_trace.json", description="trace file")
        self.export_button = W.Button(description="Export Chrome trace", icon="download")
        self.export_button.on_click(lambda _: self._guard(lambda: self.export_chrome_trace(self.trace_path.value)))
        self.timeline_box = W.VBox()
        self.measured_html = W.HTML()
        # launch: run the current plan (on the step's Ray cluster when it has one) from the widget
        self.run_args: tuple = ()
        """the step's arguments for the Launch button (the magic sets them from --args)"""
        self.launch_steps = W.BoundedIntText(value=3, min=1, max=1_000_000, description="steps")
        self.launch_button = W.Button(description="Launch", button_style="success", icon="play")
        self.launch_button.on_click(lambda _: self._guard(lambda: self.run(*self.run_args, steps=self.launch_steps.value)))
        self.stop_button = W.Button(description="Stop", icon="stop", tooltip="stop after the current step; the state is kept")
        self.stop_button.on_click(lambda _: self.stop())
        self.backend_html = W.HTML()
        # dashboard: the launched runs, each with its own live dashboard
        self.runs: list[Any] = []
        """every run launched from this workbench (``TrainingRun``), oldest first"""
        self.dashboards: list[Any] = []
        self.run_select = W.Dropdown(description="run", options=[])
        self.run_select.observe(lambda _: self._show_dashboard(), "value")
        self.recalibrate_button = W.Button(description="Re-plan with measured costs", icon="refresh",
                                           tooltip="re-solve the plan with the costs the selected run measured (plan.recalibrated)")
        self.recalibrate_button.on_click(lambda _: self.recalibrate())
        self.dashboard_box = W.VBox([W.HTML("<i>no run yet: Launch one (Timeline tab) or wb.launch(state, batches, steps=...)</i>")])
        # traffic
        self.traffic_box = W.VBox()
        self.traffic_cell = W.Dropdown(description="cell", options=[])
        self.traffic_cell.observe(lambda _: self._show_traffic_cell(), "value")
        self.traffic_tasks = W.HTML()
        # strategies
        self.op_filter = W.Text(placeholder="filter ops by name, label or strategy", description="filter")
        self.op_filter.observe(lambda _: self._fill_ops(), "value")
        self.op_select = W.Dropdown(description="op", options=[], layout=W.Layout(width="70%"))
        self.op_select.observe(lambda _: None if self._filling else self._show_op(), "value")
        self._filling = False  # set while _fill_ops replaces the op list: it shows the op once, at the end
        self.strategy_select = W.Dropdown(description="strategy", options=[], layout=W.Layout(width="70%"))
        self.pin_button = W.Button(description="Pin", button_style="primary", icon="thumb-tack")
        self.pin_button.on_click(lambda _: self.pin(self.op_select.value, self.strategy_select.value))
        self.unpin_button = W.Button(description="Unpin", icon="unlock")
        self.unpin_button.on_click(lambda _: self.unpin(self.op_select.value))
        self.explain_html = W.HTML()
        self.stage_layers = W.Text(placeholder="0-1, 2-3", description="stage layers")
        self.stage_submeshes = W.Text(placeholder="1x4, 1x4 (empty: even split)", description="sub-meshes")
        self.stages_button = W.Button(description="Pin stages", icon="columns")
        self.stages_button.on_click(lambda _: self._on_pin_stages())
        self.unpin_stages_button = W.Button(description="Unpin stages", icon="random", tooltip="let the stage DP choose again")
        self.unpin_stages_button.on_click(lambda _: self.unpin_stages())
        self.table_html = W.HTML()
        # changes
        self.changes_html = W.HTML()
        self.undo_button = W.Button(description="Undo last edit", icon="undo")
        self.undo_button.on_click(lambda _: self.undo())
        self.save_path = W.Text(value="plan.json", description="plan file")
        self.save_button = W.Button(description="Save plan", icon="save")
        self.save_button.on_click(lambda _: self.save(self.save_path.value))

        timeline_tab = W.VBox([
            W.HBox([self.schedule_select, self.trace_path, self.export_button]),
            W.HBox([self.launch_steps, self.launch_button, self.stop_button, self.backend_html]),
            self.timeline_box, self.measured_html,
        ])
        self.tabs = W.Tab(children=[
            self.overview_box,
            W.VBox([self.tensor_select, self.heatmap_box]),
            timeline_tab,
            W.VBox([self.traffic_box, self.traffic_cell, self.traffic_tasks]),
            W.VBox([
                self.op_filter, self.op_select, self.explain_html, W.HBox([self.strategy_select, self.pin_button, self.unpin_button]),
                W.HBox([self.stage_layers, self.stage_submeshes, self.stages_button, self.unpin_stages_button]), self.table_html,
            ]),
            W.VBox([W.HBox([self.undo_button, self.save_path, self.save_button]), self.changes_html]),
            W.VBox([W.HBox([self.launch_steps, self.launch_button, self.stop_button, self.run_select, self.recalibrate_button]),
                    self.dashboard_box]),
        ])
        for i, name in enumerate(("Overview", "Sharding", "Timeline", "Traffic", "Strategies", "Changes", "Dashboard")):
            self.tabs.set_title(i, name)
        # graph: the program's ops (or module groups) in stage bands; a click on a node selects its op
        self.graph_box = W.VBox()
        self._graph_widget: go.FigureWidget | None = None
        self.tabs.children = (*self.tabs.children, self.graph_box)
        self.tabs.set_title(len(self.tabs.children) - 1, "Graph")
        self._timeline_index = self.tabs.children.index(timeline_tab)
        """its figures are redrawn live only while it is shown"""
        self.tabs.observe(self._on_tab, "selected_index")
        self.children = [self.title, self.status, self.run_status, self.tabs, FitToWidth()]
        self.add_class(WORKBENCH_CLASS)  # FitToWidth's style: whole tab titles, explanations that scroll
        self.refresh()

    # ----- views -----------------------------------------------------------------------
    @property
    def pipelined(self) -> bool:
        return isinstance(self.plan, PipelinePlan)

    def refresh(self) -> None:
        """Redraw every view from the current plan."""
        with self._lock:
            self._refresh()

    def _refresh(self) -> None:
        t0 = time.perf_counter()
        plan = self.plan
        ov = views.overview(plan)
        kind = f"{plan.num_stages} stages, {plan.schedule}" if self.pipelined else f"mesh {plan.mesh_shape[0]}x{plan.mesh_shape[1]}"
        self.title.value = (
            f"<b>alpa_lab plan</b> ({html.escape(plan.method)}, {kind}): predicted step "
            f"{plan.estimated_step_time * 1e3:.3f} ms, memory/device {render._fmt_bytes(plan.memory_per_device)}"
        )
        _swap(self.overview_box, [_figure(render.overview_figure(ov)), self.overview_measured])
        cluster = getattr(self.step, "ray_cluster", None)
        self.backend_html.value = f"runs on {html.escape(repr(cluster))}" if cluster is not None else "runs in this process"
        self._tensors = views.tensors(plan)
        names = sorted(self._tensors)
        self.tensor_select.options = names
        if self.tensor_select.value not in self._tensors:
            self.tensor_select.value = next((n for n in names if not n.startswith("[")), names[0] if names else "")
        self._show_tensor()
        if self.pipelined:
            # a forward-only (inference) step has one schedule; a training step any of the others
            options = [INFERENCE] if plan.schedule == INFERENCE else sorted(TRAINING_SCHEDULES)
            if self.schedule_select.value != plan.schedule or list(self.schedule_select.options) != options:
                self._setting_schedule = True
                self.schedule_select.options = options
                self.schedule_select.value = plan.schedule
                self._setting_schedule = False
        self._draw_timeline()
        self._draw_traffic()
        self._rows = views.strategy_rows(plan)
        self._fill_ops()
        self._draw_graph()
        self._show_changes()
        self.refresh_seconds = time.perf_counter() - t0

    def _show_changes(self) -> None:
        self.changes_html.value = "<br>".join(f"<pre>{html.escape(c)}</pre>" for c in reversed(self.changes)) or "no edits yet"

    def _show_tensor(self) -> None:
        name = self.tensor_select.value
        if name not in self._tensors:
            _swap(self.heatmap_box, [])
            return
        info = views.tensor_info(self.plan, name, self._tensors)
        _swap(self.heatmap_box, [_figure(render.heatmap_figure(info, views.sharding_tiles(info)))])

    def timeline_bars(self) -> tuple[views.Bar, ...]:
        """Predicted bars, then the measured ones of the last run (if any)."""
        return (views.timeline_bars(self.plan) if self.pipelined else ()) + self.measured

    def _draw_timeline(self) -> None:
        self._timeline_stale = False
        bars = self.timeline_bars()
        if not bars:
            _swap(self.timeline_box, [W.HTML("single-mesh plan: no pipeline timeline (plan with microbatches=)")])
        else:  # predicted and measured apart: each on its own time scale
            schedule = f"{self.plan.schedule}, {self.plan.num_microbatches} micro-batches" if self.pipelined else ""
            _swap(self.timeline_box, [
                self._timeline_figure(source, part, f"{source}: {schedule}")
                for source in ("predicted", "measured")
                if (part := tuple(b for b in bars if b.source == source))
            ])
        self._show_measured_table()

    def _timeline_figure(self, source: str, bars: tuple[views.Bar, ...], title: str) -> W.Widget:
        """The figure of ``source``'s bars: the one shown, kept as it is or updated in place where it
        can be (a live run's measured bars every few seconds), a new widget only where it cannot.

        A new figure widget is a new view for the browser (its comm, its model, a full plotly render);
        an update in place sends the changed data and plotly redraws the same plot.
        """
        shown = self._timeline_figures.get(source)
        if shown is not None and shown[1] in self.timeline_box.children:
            key, widget = shown
            if key == (bars, title):
                return widget
            fig = render.timeline_figure(bars, title)
            if _update_in_place(widget, fig):
                self._timeline_figures[source] = ((bars, title), widget)
                return widget
        else:
            fig = render.timeline_figure(bars, title)
        widget = _figure(fig)
        self._timeline_figures[source] = ((bars, title), widget)
        return widget

    def _show_measured_table(self) -> None:
        self.measured_html.value = self.overview_measured.value = self._measured_table()

    def _measured_table(self) -> str:
        if not self.measured_steps:
            return "<i>run the step (workbench.run(state, batch)) to see measured times next to the predicted ones</i>"
        rows = []
        predicted = views.timeline_bars(self.plan) if self.pipelined else ()
        for c in views.stage_costs(predicted, self.measured):
            names = {"RUN": f"stage {c.stage} {c.phase}", "UPDATE": f"stage {c.stage} update", "TRANSFER": f"into mesh {c.stage}"}
            what = names[c.kind]
            ratio = f"{c.ratio:.2f}x" if c.predicted > 0 else "-"
            rows.append([what, render._ms(c.predicted), render._ms(c.measured), ratio])
        steady = self.measured_steps[1:] or self.measured_steps  # the first step compiles
        median = f"{render._ms(statistics.median(steady))} (median of {len(steady)}; first step with compiling "
        # a run in this process waits for each unit task (to time it): its step is theirs one at a time
        predicted = self.plan.serial_step_time if self.measured_serial else self.plan.estimated_step_time
        what = "step, one unit task at a time (this process)" if self.measured_serial else "step"
        step_ratio = f"{statistics.median(steady) / predicted:.2f}x" if predicted > 0 else "-"
        rows.append([what, render._ms(predicted), median + f"{render._ms(self.measured_steps[0])})", step_ratio])
        table = render._table(["span (medians, last step)", "predicted", "measured", "measured / predicted"], rows)
        return render.styled("<b>measured against predicted</b>" + table)

    def _draw_traffic(self) -> None:
        if not self.pipelined:
            _swap(self.traffic_box, [W.HTML("single-mesh plan: no cross-mesh traffic")])
            self.traffic_cell.options = []
            return
        tr = views.traffic(self.plan)
        self._traffic = tr
        meshes = [f"mesh {i}" for i in range(len(tr.mesh_bytes))]
        hosts = [f"host {i}" for i in range(len(tr.host_bytes))]
        _swap(self.traffic_box, [
            _figure(render.traffic_figure(tr.mesh_bytes, meshes, "bytes per step between meshes")),
            _figure(render.traffic_figure(tr.host_bytes, hosts, "bytes per step between hosts")),
        ])
        self.traffic_cell.options = [(f"mesh {a} -> mesh {b}: {render._fmt_bytes(tr.mesh_bytes[a][b])}", (a, b)) for a, b in tr.cells]
        if tr.cells and self.traffic_cell.value not in tr.cells:
            self.traffic_cell.value = max(tr.cells, key=lambda c: tr.mesh_bytes[c[0]][c[1]])  # the busiest link first
        self._show_traffic_cell()

    def _show_traffic_cell(self) -> None:
        cell = self.traffic_cell.value
        if not self.pipelined or cell is None:
            self.traffic_tasks.value = ""
            return
        self.traffic_tasks.value = render.styled(render.traffic_cell_html(self._traffic, cell))

    def _fill_ops(self) -> None:
        """The op picker and the table, narrowed to ops whose name, label or strategy has the filter text."""
        text = self.op_filter.value.strip().lower()
        rows = [r for r in self._rows if not text or text in r.name.lower() or text in r.label.lower() or text in r.strategy.lower()]
        note = f"<i>{len(rows)} of {len(self._rows)} ops and arguments" + (f" match {html.escape(text)!r}" if text else "") + "</i>"
        self.table_html.value = render.styled(note + render.strategy_html(views.collapse_repeated(rows)))
        options = [
            (f"stage {r.stage}" + ("" if r.layer is None else f" / layer {r.layer}") + f" / {r.name}: {r.strategy}"
             + (" (pinned)" if r.pinned else ""), r.name)
            for r in rows[:2000]
        ]
        current = self.op_select.value
        values = [v for _, v in options]
        heaviest = max(rows[:2000], key=lambda r: r.cost).name if values else None  # the default: the costliest op
        # one state message, no intermediate selection (replacing the options first selects the first one)
        self._filling = True
        try:
            with self.op_select.hold_sync():
                self.op_select.options = options
                self.op_select.value = current if current in values else heaviest
        finally:
            self._filling = False
        self._show_op()

    def _stage_plan_of(self, op: str) -> Plan:
        return self.plan.stages[self.plan.stage_of(op)].plan if self.pipelined else self.plan

    def _show_op(self) -> None:
        op = self.op_select.value
        if not op:
            self.strategy_select.options = []
            self.explain_html.value = ""
            return
        sp = self._stage_plan_of(op)
        if sp.problem is None:
            self.explain_html.value = "<i>no planner state (a loaded plan): re-plan it with its step to edit</i>"
            return
        ex = sp.explain(op)
        alts = sorted(ex.alternatives, key=lambda a: a.total)
        with self.strategy_select.hold_sync():
            self.strategy_select.options = [
                (f"{a.strategy}  ({f'{a.total * 1e6:.2f} us' if math.isfinite(a.total) else 'forbidden'}"
                 f"{', chosen' if a.chosen else ''})", a.strategy) for a in alts
            ]
            self.strategy_select.value = ex.op.strategy
        self.explain_html.value = f"<pre>{html.escape(str(ex))}</pre>"
        if op in self._tensors:
            self.tensor_select.value = op
        self._ring(op)

    def _draw_graph(self) -> None:
        self._graph = views.program_graph(self.plan)
        fig = figure_widget(render.graph_figure(self._graph, selected=self.op_select.value))
        for trace in fig.data:
            if trace.customdata is not None:  # the nodes: a click selects the op
                trace.on_click(self._on_graph_click)
        self._graph_widget = fig
        _swap(self.graph_box, [fig])

    def _on_graph_click(self, trace: Any, points: Any, _state: Any) -> None:
        if points.point_inds:
            self._guard(lambda: self.select_op(trace.customdata[points.point_inds[0]]))

    def _ring(self, op: str | None) -> None:
        """Mark ``op``'s node in the graph (the figure's "selected" trace)."""
        fig = self._graph_widget
        if fig is None or not hasattr(self, "_graph"):
            return
        ring = next(t for t in fig.data if t.name == "selected")
        node = next((n for n in self._graph.nodes if op in n.ops), None)
        with fig.batch_update():
            ring.x, ring.y = ((node.x,), (node.y,)) if node is not None else ((), ())

    def select_op(self, name: str) -> None:
        """Show op ``name`` in the Strategies tab (its strategies, its explanation) and its output's
        heatmap in the Sharding tab: what a click on its node in the graph does."""
        if name not in {r.name for r in self._rows}:
            raise KeyError(f"no op named {name!r} in this plan{views.did_you_mean(name, [r.name for r in self._rows])}")
        if name not in [v for _, v in self.op_select.options]:
            self.op_filter.value = ""  # the filter hides it
            if name not in [v for _, v in self.op_select.options]:
                self.op_filter.value = name
        self.op_select.value = name
        tensor = next((t for t in (name, f"{name}:0") if t in self._tensors), None)
        if tensor is not None:
            self.tensor_select.value = tensor

    # ----- edits -----------------------------------------------------------------------
    def _guard(self, action: Callable[[], Any]) -> bool:
        try:
            action()
        except (ValueError, KeyError, OSError) as err:
            return self._refuse(str(err))
        return True

    def _refuse(self, message: str) -> bool:
        self.last_error = message
        self.status.value = f'<span style="color:#c00">&#9888; {html.escape(message)} (the plan is unchanged)</span>'
        return False

    def _edit(self, what: str, make: Callable[[Plan | PipelinePlan], Plan | PipelinePlan]) -> bool:
        """Apply an edit; on failure keep the current plan (and the step as it was) and show why."""
        with self._lock:
            old = self.plan
            context = self._step_context()
            t0 = time.perf_counter()
            result: list[Any] = []
            if not self._guard(lambda: result.append(make(old))):
                self._restore_context(context)
                return False
            new = result[0]
            solve = time.perf_counter() - t0
            self.history.append(old)
            self._contexts.append(context)
            self._make_current(new)
            d = new.diff(old)
            self.changes.append(f"{what}\n{d}")
            self.last_error = ""
            self.refresh()
            self.status.value = (
                f'<span style="color:#070">{html.escape(what)}: predicted step {old.estimated_step_time * 1e3:.3f} ms -> '
                f"{new.estimated_step_time * 1e3:.3f} ms (re-solved in {solve:.2f} s, views in {self.refresh_seconds:.2f} s)</span>"
            )
            return True

    def _step_context(self) -> dict[str, Any]:
        """What an edit may change on the step besides its current plan: ``step.recalibrate`` gives it
        the fitted cluster and caches the planner state planned on it. Undo gives them back, so the
        step plans (and compiles) as it did with the plan undo returns to."""
        if self.step is None:
            return {}
        context: dict[str, Any] = {}
        if hasattr(self.step, "cluster"):
            context["cluster"] = self.step.cluster
        if isinstance(getattr(self.step, "_problems", None), dict):
            context["_problems"] = dict(self.step._problems)
        return context

    def _restore_context(self, context: dict[str, Any]) -> None:
        for name, value in context.items():
            setattr(self.step, name, dict(value) if isinstance(value, dict) else value)

    def _make_current(self, plan: Plan | PipelinePlan) -> None:
        with self._lock:
            self.plan = plan
            self.measured, self.measured_steps = (), []  # they were measured on the previous plan
            if self.step is not None:
                self.step.current_plan = plan  # calling the step now runs this plan
            if self.on_change is not None:
                self.on_change(plan)

    def pin(self, op: str, strategy: str) -> bool:
        """Fix ``op`` to ``strategy`` and re-solve (only its stage, for a pipeline plan)."""
        return self._edit(f"pin {op} = {strategy!r}", lambda p: p.pin(op, strategy))

    def unpin(self, op: str) -> bool:
        return self._edit(f"unpin {op}", lambda p: p.unpin(op))

    def pin_stages(self, layers: Sequence[Sequence[int]], submeshes: Sequence[tuple[int, int]] | None = None) -> bool:
        """Fix the stage boundaries (inclusive layer ranges) and, optionally, each stage's sub-mesh."""
        if not self.pipelined:
            return self._refuse("a single-mesh plan has no stages to pin; plan the step with microbatches= to pipeline it")
        return self._edit(f"pin stages {list(map(list, layers))}", lambda p: p.pin_stages(layers, submeshes))

    def unpin_stages(self) -> bool:
        """Let the stage DP choose boundaries and sub-meshes again (cached layer costs; op pins kept)."""
        if not self.pipelined:
            return self._refuse("a single-mesh plan has no stages to unpin")
        return self._edit("unpin stages (stage DP)", lambda p: p.unpin_stages())

    def set_schedule(self, schedule: str) -> bool:
        if not self.pipelined:
            return self._refuse("a single-mesh plan has no pipeline schedule; plan the step with microbatches= to pipeline it")
        return self._edit(f"schedule {schedule}", lambda p: p.with_schedule(schedule))

    def undo(self) -> bool:
        """Go back to the previous plan, and the step to how it was with it (its cluster and planner state)."""
        with self._lock:
            if not self.history:
                return self._refuse("nothing to undo")
            plan = self.history.pop()
            if len(self._contexts) > len(self.history):
                self._restore_context(self._contexts.pop())
            self._make_current(plan)
            self.last_error = ""
            self.changes.append("undo")
            self.refresh()
            self.status.value = "undone"
            return True

    def _on_schedule(self, change: dict) -> None:
        if getattr(self, "_setting_schedule", False) or not self.pipelined or change["new"] == self.plan.schedule:
            return
        if not self.set_schedule(change["new"]):
            self._setting_schedule = True
            self.schedule_select.value = self.plan.schedule
            self._setting_schedule = False

    def _on_pin_stages(self) -> None:
        try:
            layers, submeshes = _parse_ranges(self.stage_layers.value), _parse_shapes(self.stage_submeshes.value)
        except ValueError as err:
            self._refuse(str(err))
            return
        self.pin_stages(layers, submeshes)

    # ----- running ---------------------------------------------------------------------
    def launch(self, state: Any, batches: Any, *, steps: int = 100, update: Callable[[Any], Any] | None = None) -> Any:
        """Train the current plan ``steps`` steps in the background, with a live dashboard; returns the ``TrainingRun``.

        On the step's Ray cluster when it has one (``%%parallelize --ray``), else in this process.
        ``batches``: one batch, a list (cycled), an iterator, or a function of the step index.
        The notebook stays usable; ``run.stop()`` (or Stop) ends it after the current step.
        Each run gets its own dashboard (``self.dashboards``; the Dashboard tab shows the newest);
        one that fails shows why there, and keeps the plan and the last good state (``run.state``).
        """
        from alpa_lab.notebook.dashboard import Dashboard
        from alpa_lab.runtime.training import TrainingRun

        if self.step is None:
            raise ValueError("this workbench has no step to run: make it with Workbench(plan, step)")
        with self._lock:
            if self.runs and self.runs[-1].running:
                raise ValueError("a run is already in progress; stop it (run.stop()) or wait for it (run.wait())")
            self.step.current_plan = self.plan  # the plan shown is the one that runs (and is measured)
            run = TrainingRun(self.step, state, batches, steps=steps, update=update, start=False)
            dash = Dashboard(run, follow=False)
            dash.on_update = lambda _s, run=run: self._sync_run(run)
            self.runs.append(run)
            self.dashboards.append(dash)
            self.run_error = ""
            self.run_status.value = f"run {len(self.runs) - 1}: starting ({steps} steps)"
            self.measured, self.measured_steps = (), []
            with self.run_select.hold_sync():
                self.run_select.options = [(f"run {i} ({r.steps} steps)", i) for i, r in enumerate(self.runs)]
                self.run_select.value = len(self.runs) - 1
            self._show_dashboard()
            run.start()
            dash.follow()  # its redraws wait for this lock: they sync once launch is done
            return run

    @property
    def dashboard(self) -> Any:
        """The newest run's dashboard (None before the first launch)."""
        return self.dashboards[-1] if self.dashboards else None

    def _show_dashboard(self) -> None:
        i = self.run_select.value
        if i is not None and 0 <= i < len(self.dashboards):
            self.dashboard_box.children = [self.dashboards[i]]

    def _sync_run(self, run: Any) -> None:
        """The run's progress into the run status line and, while it runs the plan shown, its
        measurements into the timeline and the measured table.

        Called on each dashboard redraw, from the dashboard's thread: it waits for an edit in
        progress (the lock), and leaves the planning status and refusals to the edits.
        """
        snap = run.monitor.snapshot(recent=0)  # steps, events and the count, read together
        steps = snap.recent
        with self._lock:
            if run.result is not None:
                self.result = run.result
            name = f"run {self.runs.index(run)}" if run in self.runs else "run"
            current = run.plan is self.plan
            if run.status == "failed":
                self.run_error = run.error
                self.run_status.value = (
                    f'<span style="color:#c00">{name} failed: {html.escape(run.error)} (plan and last state kept)</span>'
                )
            elif snap.steps_done and steps:
                self.run_status.value = (
                    f"{name} {run.status}: step {snap.steps_done}/{run.steps}, {steps[-1].seconds * 1e3:.1f} ms"
                    + ("" if current else " (an earlier plan: its measurements are not shown against this one)")
                )
            if not current:
                return
            self.measured_steps = [r.seconds for r in steps]
            self.measured_serial = self.pipelined and not run.on_ray  # this process ran one unit task at a time
            if steps and snap.events:
                last = steps[-1].step
                if self.pipelined:
                    self.measured = views.event_bars([e for e in snap.events if e.step == last])
                else:  # one bar per step, from the first step kept in the window
                    self.measured = views.event_bars(snap.events)
            now = time.monotonic()
            # the status, not the run's thread: the last redraw can come before the thread has ended
            ended = snap.status in ("finished", "stopped", "failed")
            if ended or now - self._timeline_drawn > TIMELINE_EVERY:  # plotly figures cost: not on every redraw
                self._timeline_drawn = now
                # a hidden tab's figures are not redrawn live: each new figure costs the browser a
                # plotly render, and a browser that falls behind the run loses its kernel connection
                if ended or self.tabs.selected_index == self._timeline_index:
                    self._draw_timeline()
                else:
                    self._timeline_stale = True
                    self._show_measured_table()

    def _on_tab(self, change: dict) -> None:
        with self._lock:
            if change["new"] == self._timeline_index and self._timeline_stale:
                self._draw_timeline()

    def run(self, *args: Any, steps: int = 3, block: bool = False, update: Callable[[Any], tuple] | None = None) -> Any:
        """``launch`` with the step's arguments as given (``wb.run(state, batch, steps=3)``); ``block`` waits for it.

        ``update(result)`` gives the next state (default: the result's first element).
        """
        if self.step is None:
            raise ValueError("this workbench has no step to run: make it with Workbench(plan, step)")
        if not args:
            raise ValueError("no arguments to run the step with: wb.run(state, batch), or set wb.run_args = (state, batch)")
        batch = args[1] if len(args) == 2 else tuple(args[1:])
        run = self.launch(args[0], batch, steps=steps, update=update)
        if block:
            self.wait()
        return run

    def stop(self) -> None:
        """Stop the running run after the step it is in; its last state stays (``run.state``)."""
        if self.runs:
            self.runs[-1].stop()

    def wait(self, timeout: float | None = None) -> Any:
        """Wait for the newest run and its dashboard's last redraw; returns its last result."""
        if self.runs:
            self.runs[-1].wait(timeout)
            self.dashboards[-1].wait(timeout)
        return self.result

    def recalibrate(self, run: Any = None) -> bool:
        """Re-solve the plan with the costs ``run`` (default: the selected run) measured; shows what changed.

        The change note gives the measured step time, the re-solved plan's prediction with the
        measured costs, and the current plan's own prediction with them (its stages kept).
        """
        if run is None:
            i = self.run_select.value
            run = self.runs[i] if i is not None and 0 <= i < len(self.runs) else None
        if run is None:
            return self._refuse("no run to take measurements from: launch one first")
        try:
            prof = run.profile()
        except ValueError as err:
            return self._refuse(str(err))
        with self._lock:
            old = self.plan
            if self.step is not None:
                ok = self._edit(f"re-plan with the costs run {self.runs.index(run) if run in self.runs else '?'} measured",
                                lambda p: self.step.recalibrate(prof))
            else:
                ok = self._edit("re-plan with measured costs", lambda p: p.recalibrated(prof))
            if not ok:
                return False
            note = (
                f"measured step {prof.step_measured * 1e3:.3f} ms; re-solved plan predicts "
                f"{self.plan.estimated_step_time * 1e3:.3f} ms with the measured costs"
            )
            if isinstance(old, PipelinePlan) and self.pipelined:
                try:
                    kept = self.plan.pin_stages([[st.layers[0], st.layers[1] - 1] for st in old.stages],
                                                [st.submesh_shape for st in old.stages], [st.logical_shape for st in old.stages])
                    note += f", the previous stages {kept.estimated_step_time * 1e3:.3f} ms"
                except ValueError:
                    pass
            self.changes[-1] += "\n" + note
            self._show_changes()
            self.status.value += f"<br>{html.escape(note)}"
            return True

    # ----- export ----------------------------------------------------------------------
    def save(self, path: str | Path) -> bool:
        """Write the current plan as JSON (``Plan.load`` / ``PipelinePlan.load``, then ``step.use``, bring it back)."""
        if not self._guard(lambda: self.plan.save(path)):
            return False
        self.status.value = f"saved the plan to {html.escape(str(path))}"
        return True

    def export_chrome_trace(self, path: str | Path) -> Path:
        """Write the timeline (predicted and measured) as Chrome trace JSON; Perfetto opens it."""
        path = Path(path)
        path.write_text(json.dumps(views.chrome_trace(self.timeline_bars())))
        self.status.value = f"wrote {html.escape(str(path))}"
        return path

    def to_html(self) -> str:
        """The views as static HTML (no JavaScript)."""
        traffic = render.traffic_html(views.traffic(self.plan)) if self.pipelined else ""
        return render.static_html(
            views.overview(self.plan), self.timeline_bars(), views.collapse_repeated(views.strategy_rows(self.plan)), traffic
        )

    def __repr__(self) -> str:
        return self.plan.summary()

    def _repr_mimebundle_(self, **kwargs: Any) -> dict:
        bundle = super()._repr_mimebundle_(**kwargs) or {}
        bundle["text/html"] = self.to_html()
        return bundle
