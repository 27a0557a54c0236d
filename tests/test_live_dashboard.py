"""The live dashboard in a real JupyterLab, on a local Ray of mesh workers started by the kernel (issue 10).

A notebook plans a tiny MLP with ``%%parallelize --ray local:2x2`` and launches a long run
from the workbench; the browser must see the dashboard change several times while the run
goes, the kernel must answer another request meanwhile, and the dashboard's Stop button must
end the run (the step count stops growing); the browser must have acknowledged the redraws it
drew (the dashboard's back-pressure, which keeps a browser starved of CPU from falling minutes
behind the kernel and losing its connection: seen in CI before it existed). Uses the JupyterLab server and Chromium of
``test_labextension`` (skips without Chromium, except under CI).
"""

from __future__ import annotations

import json
import re
import time

import pytest

import test_labextension as labx
from test_labextension import RUN_TIMEOUT_MS, _cells, _describe, _wait_for_notebook

lab, browser, page = labx.lab, labx.browser, labx.page  # its JupyterLab server and Chromium, as fixtures here

CELLS = [
    "%load_ext alpa_lab",
    "from alpa_lab.models import tiny_example\nex = tiny_example('mlp')\nstate, batch = ex.state, ex.batch",
    "%%parallelize --ray local:2x2 --microbatches 4 --args state,batch --name plan --workbench wb\n"
    "def train_step(state, batch):\n    return ex.train_step(state, batch)",
    "run = wb.launch(state, batch, steps=100_000)\nwb.dashboard",
]

EXECUTE_JS = """async (code) => {
    const kernel = window.jupyterapp.shell.currentWidget.sessionContext.session.kernel;
    const future = kernel.requestExecute({code, store_history: false});
    let result = null, error = null;
    future.onIOPub = (msg) => {
        if (msg.header.msg_type === 'execute_result') result = msg.content.data['text/plain'];
        if (msg.header.msg_type === 'error') error = msg.content.evalue;
    };
    const t0 = performance.now();
    // a lost kernel connection (the server drops a browser that stops answering its pings) never
    // settles the future: give up after 90 s, so the test fails and says so instead of hanging CI
    const late = new Promise((resolve) => setTimeout(() => resolve('timeout'), 90000));
    if (await Promise.race([future.done.then(() => 'done'), late]) === 'timeout') {
        error = `no reply within 90 s (kernel connection: ${kernel.connectionStatus}, kernel: ${kernel.status})`;
    }
    return {result, error, ms: performance.now() - t0};
}"""


def _notebook() -> dict:
    cells = [{"cell_type": "code", "execution_count": None, "metadata": {}, "outputs": [], "source": s} for s in CELLS]
    kernelspec = {"display_name": "Python 3 (ipykernel)", "language": "python", "name": "python3"}
    return {"cells": cells, "metadata": {"kernelspec": kernelspec}, "nbformat": 4, "nbformat_minor": 5}


def test_dashboard_updates_live_the_kernel_stays_free_and_stop_stops(page, lab):
    pg = page
    (lab.root / "live.ipynb").write_text(json.dumps(_notebook()))
    pg.evaluate("() => window.jupyterapp.commands.execute('docmanager:open', {path: 'live.ipynb'}).then(() => true)")
    _wait_for_notebook(pg, "live.ipynb")
    pg.wait_for_function(
        "() => { const p = window.jupyterapp.shell.currentWidget; const k = p.sessionContext.session "
        "&& p.sessionContext.session.kernel; return k && k.status === 'idle'; }"
    )
    try:
        pg.evaluate("() => window.jupyterapp.commands.execute('notebook:run-all-cells')")
        out = pg.locator(".jp-Notebook .jp-Cell").nth(len(CELLS) - 1).locator(".jp-OutputArea")
        header = out.locator(".widget-html", has_text="samples/s").first
        try:
            header.wait_for(state="visible", timeout=RUN_TIMEOUT_MS)
        except Exception as exc:  # a timeout: say what the cells showed
            pytest.fail(f"no dashboard within {RUN_TIMEOUT_MS / 1000:.0f} s ({exc}):\n{_describe(_cells(pg))}\n{lab.log_tail()}")
        # several distinct states seen in the browser while the run goes
        seen: list[str] = []
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            text = header.inner_text()
            if not seen or text != seen[-1]:
                seen.append(text)
            if len({m.group(1) for s in seen if "running" in s and (m := re.search(r"step (\d+)/100000", s))}) >= 3:
                break
            pg.wait_for_timeout(100)
        running = [s for s in seen if "running" in s]
        steps = {re.search(r"step (\d+)/", s).group(1) for s in running}
        assert len(steps) >= 3, f"the dashboard did not move while running: {seen}\n{_describe(_cells(pg))}"
        # the kernel answers meanwhile
        reply = pg.evaluate(EXECUTE_JS, "(run.status, 6 * 7)")
        assert reply["error"] is None and reply["result"] == "('running', 42)", reply
        # the browser acknowledges the redraws as it draws them (the dashboard's back-pressure): while
        # the run goes, not only once when the dashboard was first shown
        first = pg.evaluate(EXECUTE_JS, "wb.dashboard._pacer.seen")
        acked = first
        deadline = time.monotonic() + 60
        while int(acked["result"]) <= int(first["result"]) and time.monotonic() < deadline:
            pg.wait_for_timeout(500)
            acked = pg.evaluate(EXECUTE_JS, "wb.dashboard._pacer.seen")
        assert first["error"] is None and int(acked["result"]) > int(first["result"]) >= 0, (first, acked)
        # the dashboard's Stop button stops the run after the step in progress
        out.locator("button", has_text="Stop").first.click()
        # the output area, not the header: when the run ends its widget is replaced by a static copy of the last state
        try:
            pg.wait_for_function("(el) => el.innerText.includes('stopped')", arg=out.element_handle(), timeout=60_000)
        except Exception as exc:  # a timeout: say where the run and the dashboard were
            state = pg.evaluate(EXECUTE_JS, "(run, run.error, wb.dashboard.updates, wb.dashboard._thread.is_alive(), "
                                            "run._stop.is_set(), run._thread.is_alive())")
            pytest.fail(f"the dashboard did not show 'stopped' within 60 s ({exc}); kernel: {state}\n"
                        f"{_describe(_cells(pg))}\n{lab.log_tail()}")
        done = pg.evaluate(EXECUTE_JS, "run.wait(60); (run.status, run.monitor.steps_done)")
        assert done["error"] is None and done["result"].startswith("('stopped'"), done
        final = int(re.search(r"(\d+)\)", done["result"]).group(1))
        pg.wait_for_timeout(1500)
        later = pg.evaluate(EXECUTE_JS, "run.monitor.steps_done")
        assert int(later["result"]) == final and 3 <= final < 100_000
    finally:
        pg.evaluate(EXECUTE_JS, "wb.step.ray_cluster.shutdown() if 'wb' in dir() and wb.step.ray_cluster else None")


TIMELINE_CELL = (
    "import dataclasses\nimport alpa_lab as al\nfrom alpa_lab.models import tiny_example\n"
    "from alpa_lab.notebook import views\nfrom alpa_lab.notebook.workbench import Workbench\n"
    "ex = tiny_example('mlp')\nstep = al.parallelize(ex.train_step, cluster=al.ClusterSpec.local(2, 4), microbatches=4, layers=4)\n"
    "wb = Workbench(step.plan(ex.state, ex.batch), step)\n"
    "wb.measured = tuple(dataclasses.replace(b, source='measured') for b in views.timeline_bars(wb.plan))\n"
    "wb._draw_timeline()\nwb.tabs.selected_index = wb._timeline_index\nwb"
)

MEASURED_PLOT_JS = """() => {
    const plots = [...document.querySelectorAll('.js-plotly-plot')].filter(
        gd => gd.layout && gd.layout.title && String(gd.layout.title.text || '').startsWith('measured'));
    return plots.map(gd => ({marked: gd.__marked === true, height: gd.layout.height,
                             x: gd.data.map(t => Array.from(t.x || []))}));
}"""


def test_a_timeline_figure_updated_in_place_shows_the_new_bars(page, lab):
    """New measurements go into the Timeline's measured figure in place (``Workbench._timeline_figure``):
    the browser's plot, the same element, then shows the kernel's new bars (plotly's widget applies the
    update: checked here in a real JupyterLab, as no Python test can)."""
    pg = page
    nb = _notebook()
    nb["cells"] = nb["cells"][:1] + [dict(nb["cells"][0], source=TIMELINE_CELL)]
    (lab.root / "timeline.ipynb").write_text(json.dumps(nb))
    pg.evaluate("() => window.jupyterapp.commands.execute('docmanager:open', {path: 'timeline.ipynb'}).then(() => true)")
    _wait_for_notebook(pg, "timeline.ipynb")
    pg.wait_for_function(
        "() => { const p = window.jupyterapp.shell.currentWidget; const k = p.sessionContext.session "
        "&& p.sessionContext.session.kernel; return k && k.status === 'idle'; }"
    )
    pg.evaluate("() => window.jupyterapp.commands.execute('notebook:run-all-cells')")
    try:
        pg.wait_for_function(f"() => ({MEASURED_PLOT_JS})().length === 1", timeout=RUN_TIMEOUT_MS)
    except Exception as exc:  # a timeout: say what the cells showed
        pytest.fail(f"no measured timeline within {RUN_TIMEOUT_MS / 1000:.0f} s ({exc}):\n{_describe(_cells(pg))}\n{lab.log_tail()}")
    pg.evaluate("""() => { document.querySelectorAll('.js-plotly-plot').forEach(gd => {
        if (gd.layout && String((gd.layout.title || {}).text || '').startsWith('measured')) gd.__marked = true; }); }""")
    before = pg.evaluate(MEASURED_PLOT_JS)[0]
    sent = pg.evaluate(EXECUTE_JS, (
        "figure = wb.timeline_box.children[1]\n"
        "wb.measured = tuple(dataclasses.replace(b, start=3 * b.start, end=3 * b.end) for b in wb.measured if b.microbatch != 0)\n"
        "wb._draw_timeline()\n"
        "assert wb.timeline_box.children[1] is figure\n"
        "json.dumps([list(t.x) for t in figure.data]) if (json := __import__('json')) else None"
    ))
    assert sent["error"] is None, sent
    expected = json.loads(sent["result"].strip("'"))
    assert expected != before["x"]
    pg.wait_for_function(
        f"""(want) => {{ const p = ({MEASURED_PLOT_JS})(); return p.length === 1 && p[0].marked
            && JSON.stringify(p[0].x.map(a => a.length)) === JSON.stringify(want.map(a => a.length)); }}""",
        arg=expected, timeout=30_000,
    )
    after = pg.evaluate(MEASURED_PLOT_JS)
    assert len(after) == 1 and after[0]["marked"]  # the same plot element: updated, not replaced
    for got, want in zip(after[0]["x"], expected, strict=True):
        assert got == pytest.approx(want, rel=1e-9)
