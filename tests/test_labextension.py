"""The JupyterLab extension ``alpa-lab`` (labextension/) in a real JupyterLab and a real browser.

``make test`` builds the extension and links it into the venv's Jupyter first (``make
labextension``). The browser tests start ``jupyter lab`` from this Python on a free port of
127.0.0.1 and drive it with Playwright on Debian's Chromium (``apt-get install -y chromium``;
Playwright's own browser download does not work here). Without Chromium they skip, except
under CI (``CI`` set), where they fail.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

CHROMIUM = "/usr/bin/chromium"
EXTENSION = "alpa-lab"
CARD = "alpa_lab workbench"
INSERT = "alpa-lab:insert-parallelize"
NEW = "alpa-lab:new-workbench"
RUN_TIMEOUT_MS = 120_000
BUILD_HINT = "build and link it with `make labextension` (or `make test`)"


def _plain(text: str) -> str:
    return re.sub(r"\x1b\[[0-9;]*m", "", text)


def test_labextension_is_installed_enabled_and_ok():
    proc = subprocess.run(
        [sys.executable, "-m", "jupyter", "labextension", "list"], capture_output=True, text=True, timeout=120
    )
    text = _plain(proc.stdout + proc.stderr)
    assert proc.returncode == 0, text
    lines = [line.split() for line in text.splitlines()]
    ours = [words for words in lines if words[:1] == [EXTENSION]]
    assert ours, f"{EXTENSION} is not installed in {sys.executable}'s Jupyter: {BUILD_HINT}\n{text}"
    assert "enabled" in ours[0] and "OK" in ours[0], text


KERNEL_CHECK = """
from jupyter_client.manager import start_new_kernel
km, kc = start_new_kernel(kernel_name="python3")
try:
    code = ("import jax; ip = get_ipython(); "
            "print('loaded', 'alpa_lab' in ip.extension_manager.loaded, 'parallelize' in ip.magics_manager.magics['cell'], "
            "len(jax.devices()))")
    kc.execute_interactive(code, timeout=120)
finally:
    kc.stop_channels()
    km.shutdown_kernel(now=True)
"""


def test_make_lab_kernels_start_with_the_magic_loaded():
    """`make lab` puts labextension/jupyter on JUPYTER_PATH: its python3 kernelspec loads alpa_lab."""
    repo = Path(__file__).resolve().parents[1]
    env = dict(os.environ, JUPYTER_PATH=str(repo / "labextension" / "jupyter"), XLA_FLAGS="--xla_force_host_platform_device_count=8")
    proc = subprocess.run([sys.executable, "-c", KERNEL_CHECK], capture_output=True, text=True, timeout=180, env=env, cwd=repo)
    assert "loaded True True 8" in proc.stdout, proc.stdout + proc.stderr


# --- a real JupyterLab server and browser -------------------------------------------------


def _need_chromium() -> None:
    if not os.path.exists(CHROMIUM):
        reason = f"{CHROMIUM} is missing (apt-get install -y chromium; .ci/run installs it)"
        if os.environ.get("CI"):
            pytest.fail(f"CI must run the browser tests: {reason}")
        pytest.skip(reason)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Lab:
    """A running ``jupyter lab``: its base URL, token, root directory and log."""

    def __init__(self, url: str, token: str, root: Path, log: Path, proc: subprocess.Popen):
        self.url, self.token, self.root, self.log, self.proc = url, token, root, log, proc

    def api(self, path: str, method: str = "GET") -> object:
        req = urllib.request.Request(f"{self.url}{path}", method=method, headers={"Authorization": f"token {self.token}"})
        with urllib.request.urlopen(req, timeout=10) as resp:
            body = resp.read()
        return json.loads(body) if body else None

    def log_tail(self, chars: int = 6000) -> str:
        return self.log.read_text(errors="replace")[-chars:] if self.log.exists() else ""


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    _need_chromium()
    base = tmp_path_factory.mktemp("jupyterlab")
    root, log = base / "notebooks", base / "server.log"
    root.mkdir()
    port, token = _free_port(), secrets.token_hex(16)
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JUPYTER_RUNTIME_DIR=str(base / "runtime"))
    cmd = [
        sys.executable, "-m", "jupyter", "lab", "--no-browser", "--expose-app-in-browser",
        "--ServerApp.ip=127.0.0.1", f"--ServerApp.port={port}", "--ServerApp.port_retries=0",
        f"--IdentityProvider.token={token}", "--ServerApp.allow_root=True", f"--ServerApp.root_dir={root}",
        f"--LabApp.user_settings_dir={base / 'settings'}", f"--LabApp.workspaces_dir={base / 'workspaces'}",
        "--LabApp.news_url=None", "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
    ]  # fmt: skip
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=base, start_new_session=True)
    server = Lab(f"http://127.0.0.1:{port}", token, root, log, proc)
    try:
        deadline = time.monotonic() + 60
        while True:
            if proc.poll() is not None:
                pytest.fail(f"jupyter lab exited with {proc.returncode}:\n{server.log_tail()}")
            try:
                server.api("/api/status")
                break
            except (urllib.error.URLError, ConnectionError, OSError):
                if time.monotonic() > deadline:
                    pytest.fail(f"jupyter lab did not answer within 60 s:\n{server.log_tail()}")
                time.sleep(0.25)
        yield server
    finally:
        try:  # kernels run in their own sessions: shut them down through the server
            for kernel in server.api("/api/kernels") or []:
                server.api(f"/api/kernels/{kernel['id']}", method="DELETE")
        except Exception:  # noqa: BLE001 (the server may be gone already; it is stopped below)
            pass
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)


@pytest.fixture(scope="module")
def browser():
    _need_chromium()
    from playwright.sync_api import sync_playwright

    pw = sync_playwright().start()
    try:
        chromium = pw.chromium.launch(executable_path=CHROMIUM, headless=True)
        try:
            yield chromium
        finally:
            chromium.close()
    finally:
        pw.stop()


@pytest.fixture
def page(lab, browser):
    """JupyterLab open in a fresh browser page (fresh workspace), the app restored."""
    context = browser.new_context(viewport={"width": 1400, "height": 1000})
    errors: list[str] = []
    try:
        pg = context.new_page()
        pg.on("pageerror", lambda exc: errors.append(str(exc)))
        pg.set_default_timeout(60_000)
        pg.goto(f"{lab.url}/lab?reset&token={lab.token}")
        pg.wait_for_function("() => window.jupyterapp !== undefined")
        pg.evaluate("() => window.jupyterapp.restored.then(() => true)")
        yield pg
        assert not errors, f"uncaught errors in the page: {errors}"
    finally:
        context.close()


# JavaScript run in the page, on the notebook in the main area.
CELLS_JS = """() => {
    const panel = window.jupyterapp.shell.currentWidget;
    if (!panel || !panel.content || !panel.content.widgets) return null;
    return panel.content.widgets.map(cell => ({
        type: cell.model.type,
        source: cell.model.sharedModel.getSource(),
        outputs: cell.model.type === 'code' ? cell.model.outputs.toJSON() : [],
        rendered: cell.model.type === 'code' ? (cell.node.querySelector('.jp-OutputArea') || {}).innerText || '' : '',
        count: cell.model.type === 'code' ? cell.model.executionCount : null,
    }));
}"""
PANEL_JS = """() => {
    const panel = window.jupyterapp.shell.currentWidget;
    if (!panel || !panel.context || !panel.sessionContext) return null;
    const kernel = panel.sessionContext.session && panel.sessionContext.session.kernel;
    return {path: panel.context.path, kernel: kernel ? kernel.name : null, status: kernel ? kernel.status : null,
            active: panel.content.activeCellIndex};
}"""


def _cells(pg) -> list[dict]:
    return pg.evaluate(CELLS_JS) or []


def _wait_for_notebook(pg, name: str) -> dict:
    pg.wait_for_function(
        """(name) => {
            const panel = window.jupyterapp.shell.currentWidget;
            return panel && panel.context && panel.context.path.endsWith(name) && panel.context.isReady
                && panel.content.widgets.length > 0;
        }""",
        arg=name,
    )
    return pg.evaluate(PANEL_JS)


def test_launcher_card_opens_the_starter_and_the_cell_command_inserts(page):
    pg = page
    card = pg.locator(".jp-Launcher-section", has=pg.locator(".jp-Launcher-sectionTitle", has_text="Notebook")).locator(
        ".jp-LauncherCard", has_text=CARD
    )
    card.wait_for(state="visible")
    card.click()
    panel = _wait_for_notebook(pg, "alpa_lab_workbench.ipynb")
    cells = _cells(pg)
    sources = [c["source"] for c in cells]
    assert cells[0]["type"] == "markdown" and "alpa_lab" in sources[0]
    assert any(s.strip() == "%load_ext alpa_lab" for s in sources), sources
    magic = [i for i, s in enumerate(sources) if s.startswith("%%parallelize")]
    assert magic and "def train_step(state, batch):" in sources[magic[0]], sources
    assert "--args state,batch" in sources[magic[0]].splitlines()[0]
    pg.wait_for_function("() => { const p = window.jupyterapp.shell.currentWidget; "
                         "return p.sessionContext.session && p.sessionContext.session.kernel; }")  # fmt: skip
    assert pg.evaluate(PANEL_JS)["kernel"] == "python3", panel

    # The cell below the magic line is highlighted as Python: `def` has the keyword colour.
    line = pg.locator(".jp-Notebook .jp-Cell").nth(magic[0]).locator(".cm-line", has_text="def train_step")
    line.wait_for(state="visible")
    colours = line.evaluate(
        """(line) => {
            const def = Array.from(line.querySelectorAll('span')).find(s => s.textContent === 'def');
            const probe = document.createElement('span');
            probe.style.color = 'var(--jp-mirror-editor-keyword-color)';
            line.appendChild(probe);
            const keyword = getComputedStyle(probe).color;
            probe.remove();
            return {def: def ? getComputedStyle(def).color : null, keyword, plain: getComputedStyle(line).color};
        }"""
    )
    assert colours["def"] == colours["keyword"] != colours["plain"], colours

    # Command palette, category alpa_lab: a %%parallelize cell below the active cell.
    pg.evaluate("() => { window.jupyterapp.shell.currentWidget.content.activeCellIndex = 1; }")
    before = len(cells)
    pg.evaluate("() => window.jupyterapp.commands.execute('apputils:activate-command-palette')")
    search = pg.locator(".jp-ModalCommandPalette input")
    search.fill("Insert %%parallelize")
    item = pg.locator(".jp-ModalCommandPalette .lm-CommandPalette-item", has_text="Insert %%parallelize cell")
    item.wait_for(state="visible")
    assert "alpa_lab" in pg.locator(".jp-ModalCommandPalette .lm-CommandPalette-header").all_inner_texts()[0].lower()
    item.click()
    pg.wait_for_function(f"() => window.jupyterapp.shell.currentWidget.content.widgets.length === {before + 1}")
    cells = _cells(pg)
    assert cells[2]["type"] == "code" and cells[2]["source"].startswith("%%parallelize --cluster"), cells[2]
    assert pg.evaluate(PANEL_JS)["active"] == 2

    # The same command from a cell's context menu, and by id (window.jupyterapp).
    pg.locator(".jp-Notebook .jp-Cell").nth(0).click(button="right")
    entry = pg.locator(".lm-Menu-item", has_text="Insert %%parallelize cell")
    entry.wait_for(state="visible")
    entry.click()
    pg.wait_for_function(f"() => window.jupyterapp.shell.currentWidget.content.widgets.length === {before + 2}")
    pg.evaluate(f"() => window.jupyterapp.commands.execute('{INSERT}')")
    pg.wait_for_function(f"() => window.jupyterapp.shell.currentWidget.content.widgets.length === {before + 3}")
    assert sum(c["source"].startswith("%%parallelize") for c in _cells(pg)) == len(magic) + 3


def test_starter_runs_in_the_kernel_and_shows_the_plan(page, lab):
    pg = page
    pg.evaluate(f"() => window.jupyterapp.commands.execute('{NEW}').then(() => true)")
    path = _wait_for_notebook(pg, ".ipynb")["path"]
    assert path.startswith("alpa_lab_workbench") and (lab.root / path).exists()
    saved = json.loads((lab.root / path).read_text())
    assert saved["metadata"]["kernelspec"]["name"] == "python3"
    pg.wait_for_function(
        "() => { const p = window.jupyterapp.shell.currentWidget; const k = p.sessionContext.session "
        "&& p.sessionContext.session.kernel; return k && k.status === 'idle'; }"
    )
    pg.evaluate("() => window.jupyterapp.commands.execute('notebook:run-all-cells')")
    magic = next(i for i, c in enumerate(_cells(pg)) if c["source"].startswith("%%parallelize"))
    try:
        pg.wait_for_function(
            """(magic) => {
                const p = window.jupyterapp.shell.currentWidget;
                const cells = p.content.widgets.filter(c => c.model.type === 'code');
                const errors = cells.some(c => c.model.outputs.toJSON().some(o => o.output_type === 'error'));
                const done = cells.every(c => c.model.executionCount !== null)
                    && p.sessionContext.session.kernel.status === 'idle';
                const cell = p.content.widgets[magic];
                const shown = JSON.stringify(cell.model.outputs.toJSON())
                    + ((cell.node.querySelector('.jp-OutputArea') || {}).innerText || '');
                return errors || (done && shown.includes('Plan'));
            }""",
            arg=magic,
            timeout=RUN_TIMEOUT_MS,
            polling=500,
        )
    except Exception as exc:  # a timeout: say what the cells showed
        pytest.fail(f"the starter did not finish within {RUN_TIMEOUT_MS / 1000:.0f} s ({exc}):\n{_describe(_cells(pg))}\n{lab.log_tail()}")
    cells = _cells(pg)
    errors = [o for c in cells for o in c["outputs"] if o.get("output_type") == "error"]
    assert not errors, _describe(cells)
    plan_cell = cells[magic]
    assert "Plan" in json.dumps(plan_cell["outputs"]) + plan_cell["rendered"], _describe(cells)
    assert all(c["count"] is not None for c in cells if c["type"] == "code"), _describe(cells)
    assert "step 2: loss" in json.dumps([c["outputs"] for c in cells]), _describe(cells)

    # The workbench widget is drawn (tabs, a plotly figure), and a pin made in the browser re-solves the plan.
    out = pg.locator(".jp-Notebook .jp-Cell").nth(magic).locator(".jp-OutputArea")
    for title in ("Overview", "Sharding", "Timeline", "Traffic", "Strategies", "Changes"):
        out.locator(".lm-TabBar-tab", has_text=title).first.wait_for(state="visible")
    out.locator(".js-plotly-plot").first.wait_for(state="visible")
    out.locator(".lm-TabBar-tab", has_text="Strategies").first.click()
    out.locator(".widget-text", has=pg.locator("label", has_text="filter")).locator("input").fill("dot_general")
    op = out.locator(".widget-dropdown", has=pg.locator("label", has_text="op")).locator("select").first
    strategy = out.locator(".widget-dropdown", has=pg.locator("label", has_text="strategy")).locator("select").first
    # The kernel answers the filter in steps (op list, then the chosen op, then its strategies and
    # explanation): wait until the strategies shown are those of the op shown, a dot.
    pg.wait_for_function(
        """([el, op, strategy]) => {
            const text = o => o.text.replace(/\u00a0/g, ' ');  // ipywidgets writes option spaces as nbsp
            const names = Array.from(op.options).map(text);
            const chosen = op.selectedIndex >= 0 ? text(op.options[op.selectedIndex]) : '';
            const name = chosen.split(' / ').pop().split(':')[0];
            const explained = Array.from(el.querySelectorAll('pre')).some(p => p.innerText.startsWith(name + ' ('));
            return names.length > 0 && names.every(n => n.includes('dot_general')) && name.startsWith('dot_general')
                && explained && strategy.options.length > 1;
        }""",
        arg=[out.element_handle(), op.element_handle(), strategy.element_handle()],
    )
    assert all("dot_general" in o for o in op.locator("option").all_inner_texts())
    other = next(o for o in strategy.locator("option").all_inner_texts() if ", chosen" not in o.replace("\xa0", " "))
    strategy.select_option(label=other)
    out.locator("button", has_text="Pin").first.click()
    pg.wait_for_function("(el) => el.innerText.includes('re-solved in')", arg=out.element_handle(), timeout=60_000)
    out.locator(".lm-TabBar-tab", has_text="Changes").first.click()
    pg.wait_for_function("(el) => el.innerText.includes('ops changed strategy')", arg=out.element_handle())
    assert f"= {other.split()[0]!r}" in out.inner_text() or other.split()[0] in out.inner_text()
    assert "\n0 ops changed strategy" not in out.inner_text()  # another strategy was pinned: the plan changed


def _describe(cells: list[dict]) -> str:
    parts = []
    for i, c in enumerate(cells):
        if c["type"] != "code":
            continue
        outs = [
            o.get("text") or o.get("evalue") or "".join(o.get("traceback", [])) or str(o.get("data", {}).get("text/plain", ""))
            for o in c["outputs"]
        ]
        parts.append(f"[{i}] {c['source'].splitlines()[0] if c['source'] else ''!r} -> {_plain(''.join(map(str, outs)))[:2000]}")
    return "\n".join(parts)
