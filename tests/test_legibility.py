"""Every workbench view legible at common notebook widths (issue 10): no two text labels of a
plotly figure overlap and none is cut off, in a real JupyterLab at 1000 and 1500 px.

The oracle is the browser's own layout: the bounding boxes (``getBoundingClientRect``) of
the visible ``<text>`` elements of each figure's SVG, after plotly has laid them out at the
page's width. Uses the JupyterLab server and Chromium of ``test_labextension`` (it skips
without Chromium, except under CI). Screenshots go to ``$ALPA_LAB_SCREENSHOTS`` if set, else
to the test's tmp dir.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

import test_labextension as labx
from test_labextension import RUN_TIMEOUT_MS, _cells, _describe, _wait_for_notebook

lab, browser, page = labx.lab, labx.browser, labx.page  # its JupyterLab server and Chromium, as fixtures here

WIDTHS = (1000, 1500)
TABS = ("Overview", "Sharding", "Timeline", "Traffic", "Strategies", "Graph")
FIGURES = ("Overview", "Sharding", "Timeline", "Traffic", "Graph")
"""the tabs that draw plotly figures (Strategies is a table and controls)."""
SLACK = 2.0
"""pixels two labels may share (antialiasing, a descender), and a label may stick out."""

SETUP = """\
import alpa_lab as al
from alpa_lab.models import tiny_example
from alpa_lab.notebook.workbench import Workbench

ex = tiny_example("gpt")
step = al.parallelize(ex.train_step, cluster=al.ClusterSpec.local(hosts=2, devices_per_host=4), microbatches=4, layers=4)
plan = step.plan(ex.state, ex.batch).pin_stages([[0, 0], [1, 1], [2, 2], [3, 3]], submeshes=[(1, 2)] * 4)
wb = Workbench(plan, step)
wb"""
SINGLE = """\
# one mesh of 2 hosts x 4 devices; the Sharding tab on a tensor split over both mesh axes
mlp = tiny_example("mlp")
step1 = al.parallelize(mlp.train_step, cluster=al.ClusterSpec.local(hosts=2, devices_per_host=4))
plan1 = step1.plan(mlp.state, mlp.batch)
wb1 = Workbench(plan1, step1)
split = [o.name for o in plan1.ops if o.kind == "op" and o.output_specs and o.output_specs[0].count("S") >= 1]
wb1.select_op(max(split, key=lambda n: len(plan1.op(n).output_specs[0])))
wb1"""
VIEWS = ((1, TABS), (2, ("Overview", "Sharding", "Graph")))
"""(cell, tabs to check): the pipelined plan's every tab; the single mesh's figures that differ."""


def _notebook() -> dict:
    def code(text: str) -> dict:
        return {"cell_type": "code", "execution_count": None, "metadata": {}, "outputs": [], "source": text}

    return {
        "cells": [code("%load_ext alpa_lab"), code(SETUP), code(SINGLE)],
        "metadata": {"kernelspec": {"display_name": "Python 3 (ipykernel)", "language": "python", "name": "python3"}},
        "nbformat": 4,
        "nbformat_minor": 5,
    }


# The visible text labels of every plotly figure shown in ``root``: box, text, and the box
# it must stay inside (the figure, and the clip path of the layer that draws it).
LABELS_JS = """(root) => {
    const box = r => ({left: r.left, top: r.top, right: r.right, bottom: r.bottom});
    const clipOf = (el) => {
        for (let a = el; a && a.tagName.toLowerCase() !== 'svg'; a = a.parentElement) {
            const ref = a.getAttribute('clip-path');
            const id = ref && ref.match(/#([^)'"]+)/);
            const rect = id && document.getElementById(id[1]) && document.getElementById(id[1]).querySelector('rect');
            if (!rect) continue;
            const m = a.getScreenCTM();
            const x = +rect.getAttribute('x') || 0, y = +rect.getAttribute('y') || 0;
            const p = new DOMPoint(x, y).matrixTransform(m);
            const q = new DOMPoint(x + (+rect.getAttribute('width')), y + (+rect.getAttribute('height'))).matrixTransform(m);
            return {left: Math.min(p.x, q.x), top: Math.min(p.y, q.y), right: Math.max(p.x, q.x), bottom: Math.max(p.y, q.y)};
        }
        return null;
    };
    const figures = [];
    const panel = root.getBoundingClientRect();
    root.querySelectorAll('.js-plotly-plot').forEach((plot, f) => {
        const container = plot.querySelector('.svg-container');
        if (!container || !plot.checkVisibility()) return;
        const c = container.getBoundingClientRect();  // the figure, as far as its tab shows it
        const frame = {left: Math.max(c.left, panel.left), top: c.top, right: Math.min(c.right, panel.right), bottom: c.bottom};
        const labels = [];
        plot.querySelectorAll('svg text').forEach(t => {
            const text = t.textContent.trim();
            if (!text || t.closest('.hoverlayer') || !t.checkVisibility({opacityProperty: true, visibilityProperty: true})) return;
            const r = t.getBoundingClientRect();
            if (r.width === 0 || r.height === 0) return;
            labels.push({text, cls: t.getAttribute('class') || t.parentElement.getAttribute('class') || '',
                         box: box(r), clip: clipOf(t)});
        });
        const areas = Array.from(plot.querySelectorAll('.bglayer rect.bg')).map(r => box(r.getBoundingClientRect()));
        figures.push({index: f, frame, labels, areas});
    });
    return figures;
}"""


# Text outside the figures: tab titles, widget labels and buttons cut short with an ellipsis,
# controls running out of the tab, and preformatted text (an op's explanation) wrapped or cut
# off instead of scrolling.
HTML_JS = """(root) => {
    const out = [];
    root.querySelectorAll('.lm-TabBar-tabLabel, .widget-label, .jupyter-button').forEach(el => {
        if (el.checkVisibility() && el.textContent.trim() && el.scrollWidth > el.clientWidth + 1)
            out.push(`label ${JSON.stringify(el.textContent.trim())} is cut short (${el.clientWidth} of ${el.scrollWidth} px)`);
    });
    const panel = root.querySelector('.widget-tab-contents').getBoundingClientRect();
    root.querySelectorAll('.widget-tab-contents .widget-inline-hbox, .widget-tab-contents .jupyter-button').forEach(el => {
        const r = el.getBoundingClientRect();
        if (el.checkVisibility() && (r.right > panel.right + 1 || r.left < panel.left - 1))
            out.push(`control ${JSON.stringify(el.innerText.trim().slice(0, 30))} runs out of the tab (${r.left}..${r.right} of `
                     + `${panel.left}..${panel.right} px)`);
    });
    root.querySelectorAll('pre').forEach(el => {
        if (!el.checkVisibility()) return;
        const style = getComputedStyle(el);
        if (style.whiteSpace !== 'pre')
            out.push(`text ${JSON.stringify(el.textContent.slice(0, 40))} wraps its lines (white-space: ${style.whiteSpace})`);
        else if (el.scrollWidth > el.clientWidth + 1 && !['auto', 'scroll'].includes(style.overflowX))
            out.push(`text ${JSON.stringify(el.textContent.slice(0, 40))} is cut off (overflow-x: ${style.overflowX})`);
    });
    return out;
}"""


OUTSIDE_PLOTS = re.compile(r"^([xy]\d*(tick|title)|legendtext|gtitle)$")
"""labels that belong beside the plot areas (ticks, axis titles, legend, title), never on one."""


def _overlap(a: dict, b: dict) -> float:
    w = min(a["right"], b["right"]) - max(a["left"], b["left"])
    h = min(a["bottom"], b["bottom"]) - max(a["top"], b["top"])
    return min(w, h)


def _outside(inner: dict, outer: dict) -> float:
    return max(
        outer["left"] - inner["left"], inner["right"] - outer["right"], outer["top"] - inner["top"], inner["bottom"] - outer["bottom"]
    )


def problems(figures: list[dict]) -> list[str]:
    """Overlapping and cut-off labels, in words."""
    out = []
    for fig in figures:
        labels = fig["labels"]
        for i, a in enumerate(labels):
            cut = _outside(a["box"], fig["frame"])
            if cut > SLACK:
                out.append(f"figure {fig['index']}: {a['text']!r} ({a['cls']}) sticks out of the figure by {cut:.0f} px")
            if a["clip"] is not None and _outside(a["box"], a["clip"]) > SLACK:
                out.append(f"figure {fig['index']}: {a['text']!r} ({a['cls']}) is cut off by its plot area "
                           f"({_outside(a['box'], a['clip']):.0f} px)")
            if OUTSIDE_PLOTS.match(a["cls"]):
                for area in fig["areas"]:
                    if _overlap(a["box"], area) > SLACK:
                        out.append(f"figure {fig['index']}: {a['text']!r} ({a['cls']}) runs into a plot area")
            for b in labels[i + 1 :]:
                if _overlap(a["box"], b["box"]) > SLACK:
                    out.append(f"figure {fig['index']}: {a['text']!r} ({a['cls']}) overlaps {b['text']!r} ({b['cls']})")
    return out


def _run_all(pg, server) -> None:
    pg.wait_for_function(
        "() => { const p = window.jupyterapp.shell.currentWidget; const k = p.sessionContext.session "
        "&& p.sessionContext.session.kernel; return k && k.status === 'idle'; }"
    )
    pg.evaluate("() => window.jupyterapp.commands.execute('notebook:run-all-cells')")
    try:
        pg.wait_for_function(
            """() => {
                const p = window.jupyterapp.shell.currentWidget;
                const cells = p.content.widgets.filter(c => c.model.type === 'code');
                const errors = cells.some(c => c.model.outputs.toJSON().some(o => o.output_type === 'error'));
                const done = cells.every(c => c.model.executionCount !== null) && p.sessionContext.session.kernel.status === 'idle';
                return errors || (done && cells.slice(1).every(c => c.node.querySelector('.js-plotly-plot') !== null));
            }""",
            timeout=RUN_TIMEOUT_MS,
            polling=500,
        )
    except Exception as exc:  # a timeout: say what the cells showed
        pytest.fail(f"the notebook did not finish ({exc}):\n{_describe(_cells(pg))}\n{server.log_tail()}")
    cells = _cells(pg)
    assert not [o for c in cells for o in c["outputs"] if o.get("output_type") == "error"], _describe(cells)


def test_every_view_is_legible_at_notebook_widths(page, lab, tmp_path):
    pg = page
    shots = Path(os.environ.get("ALPA_LAB_SCREENSHOTS") or tmp_path)
    shots.mkdir(parents=True, exist_ok=True)
    (lab.root / "legibility.ipynb").write_text(json.dumps(_notebook()))
    pg.set_viewport_size({"width": WIDTHS[0], "height": 900})
    pg.evaluate("() => window.jupyterapp.commands.execute('docmanager:open', {path: 'legibility.ipynb'}).then(() => true)")
    _wait_for_notebook(pg, "legibility.ipynb")
    _run_all(pg, lab)
    news = pg.locator(".Toastify__toast button", has_text="No")  # "get notified about official Jupyter news?"
    if news.count():
        news.first.click()
    found: dict[str, list[str]] = {}
    for width, (cell, tabs) in ((w, v) for w in WIDTHS for v in VIEWS):
        pg.set_viewport_size({"width": width, "height": 900})
        out = pg.locator(".jp-Notebook .jp-Cell").nth(cell).locator(".jp-OutputArea")
        for tab in tabs:
            out.locator(".lm-TabBar-tab", has_text=tab).first.click()
            panel = out.locator(".widget-tab-contents > .lm-Widget:not(.lm-mod-hidden)").first
            panel.wait_for(state="visible")
            if tab in FIGURES:
                try:
                    panel.locator(".js-plotly-plot .main-svg").first.wait_for(state="visible", timeout=30_000)
                except Exception as exc:  # noqa: BLE001 - said with the page as it was
                    pg.screenshot(path=str(shots / f"{width}px_{cell}_{tab.lower()}_missing.png"))
                    pytest.fail(f"{tab} at {width} px shows no figure: {exc}")
            pg.wait_for_timeout(800)  # plotly re-lays out a figure shown in a tab at the tab's width
            panel.scroll_into_view_if_needed()
            panel.screenshot(path=str(shots / f"{width}px_{cell}_{tab.lower()}.png"))
            figures = pg.evaluate(LABELS_JS, panel.element_handle())
            if tab in FIGURES:
                assert figures and any(f["labels"] for f in figures), f"{tab} at {width} px: no figure with labels"
            where = f"{tab} at {width} px" + (" (single mesh)" if cell == 2 else "")
            for p in problems(figures) + pg.evaluate(HTML_JS, out.element_handle()):
                if not any(p in ps for ps in found.values()):  # the tab bar's, once
                    found.setdefault(where, []).append(p)
    found = {where: ps for where, ps in found.items() if ps}
    assert not found, "labels collide or are cut off:\n" + "\n".join(
        f"{where}:\n  " + "\n  ".join(ps[:12]) + (f"\n  ... {len(ps) - 12} more" if len(ps) > 12 else "") for where, ps in found.items()
    )
