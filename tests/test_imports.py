"""The layering of the code: imports run one way, lower layers never import higher ones.

The layers, lowest first (a module may import its own layer and any lower one)::

    graph < cost < sharding < plan < passes < runtime < api < notebook

(below them all, ``_gc``: a helper the tracer and the planners use, which imports none of them)

``plan`` is pure data: it imports no pass, so editing a plan (``pin``, ``pin_stages``,
``with_schedule``, ``recalibrated``) is done by the planner state the passes attach to it.
Every ``import`` statement counts, top-level or nested in a function (a lazy import is still
an arrow). ``alpa_lab/__init__.py`` (the public namespace) may import anything.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "alpa_lab"

LAYERS = ("graph", "cost", "sharding", "plan", "passes", "runtime", "api", "notebook")
RANK = {name: i for i, name in enumerate(LAYERS)}
RANK.update(
    {
        "models": RANK["api"],  # example programs, written against the public markers
        "testing": RANK["api"],  # Alpa's test helpers: models and steps written against the public markers
        "util": RANK["api"],  # Alpa's alpa.util helpers: HLO counts, FLOP counts, a timing loop
        "cli": RANK["api"],  # the command line: calls the public API
        "test_install": RANK["api"],  # `python -m alpa_lab.test_install`: runs the public API
        "parallel_method": RANK["api"],  # Alpa's method objects: the options parallelize takes
        "__main__": RANK["api"],
        "": RANK["api"],  # ``import alpa_lab``: the public namespace, the API and all below it
        "_gc": -1,  # the collector's settings while tracing and planning: imports nothing of ours
    }
)


def _layer(module: str) -> str:
    """``alpa_lab.passes.pipeline`` -> ``passes``; ``alpa_lab`` -> ``""``."""
    parts = module.split(".")
    assert parts[0] == "alpa_lab", module
    return parts[1] if len(parts) > 1 else ""


def _module_name(path: Path) -> str:
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imported(tree: ast.AST, module: str, is_package: bool) -> list[tuple[int, str]]:
    """(line, module) of every alpa_lab module ``tree`` imports, at any depth (functions included)."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against this module's package
                base = module.split(".") if is_package else module.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            # ``from alpa_lab import plan`` imports the submodule alpa_lab.plan
            out += [(node.lineno, f"{target}.{a.name}" if target == "alpa_lab" else target) for a in node.names]
    return sorted({(line, m) for line, m in out if m == "alpa_lab" or m.startswith("alpa_lab.")})


def _modules() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if "labextension" not in p.parts)


def _violations() -> list[str]:
    bad = []
    for path in _modules():
        module = _module_name(path)
        if module == "alpa_lab":
            continue  # the public namespace may import anything
        own = _layer(module)
        assert own in RANK, f"{module}: not in any layer; add it to LAYERS/RANK in {Path(__file__).name}"
        tree = ast.parse(path.read_text(), str(path))
        for line, target in _imported(tree, module, path.name == "__init__.py"):
            other = _layer(target)
            if RANK.get(other, len(LAYERS)) > RANK[own]:
                bad.append(f"{path.relative_to(PACKAGE.parent)}:{line}: {own} imports {target} ({other or 'alpa_lab'})")
    return bad


def test_every_module_is_in_a_layer():
    layers = {_layer(_module_name(p)) for p in _modules()} - {""}
    assert layers <= set(RANK), f"modules outside the layers: {sorted(layers - set(RANK))}"


def test_imports_run_one_way():
    """No module imports a module of a higher layer, not even lazily inside a function."""
    bad = _violations()
    assert not bad, "imports against the layering (" + " < ".join(LAYERS) + "):\n" + "\n".join(bad)


def test_plan_imports_no_pass():
    """The plan package is data: it imports nothing of passes/, runtime/, api, notebook/ or the
    ``alpa_lab`` namespace (which the layer check above implies; said here plainly)."""
    bad = []
    for path in sorted((PACKAGE / "plan").rglob("*.py")):
        module = _module_name(path)
        for line, target in _imported(ast.parse(path.read_text()), module, path.name == "__init__.py"):
            if _layer(target) in ("passes", "runtime", "api", "notebook", ""):
                bad.append(f"{path.relative_to(PACKAGE.parent)}:{line}: {target}")
    assert not bad, "the plan imports:\n" + "\n".join(bad)


@pytest.mark.parametrize("module", ["alpa_lab.plan", "alpa_lab"])
def test_importing_the_plan_loads_no_pass(module):
    """In a fresh interpreter, ``import alpa_lab.plan`` (and ``import alpa_lab``) load no module of
    passes/, runtime/, api or notebook/: a script that only loads and exports plans runs without them."""
    code = (
        f"import sys, {module}\n"
        "higher = ('alpa_lab.passes', 'alpa_lab.runtime', 'alpa_lab.api', 'alpa_lab.notebook')\n"
        "print(sorted(m for m in sys.modules if m.startswith(higher)))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=PACKAGE.parent)
    assert out.stdout.strip() == "[]", f"import {module} loaded: {out.stdout.strip()}"


def test_the_checker_sees_nested_and_relative_imports():
    """The checker itself: an import inside a function counts, relative imports resolve."""
    tree = ast.parse(
        "def f():\n    from alpa_lab.passes.pipeline import plan_stages\n"
        "from ..passes import intra_op\nfrom alpa_lab import api\n"
    )
    found = [m for _, m in _imported(tree, "alpa_lab.plan.single", False)]
    assert sorted(found) == ["alpa_lab.api", "alpa_lab.passes", "alpa_lab.passes.pipeline"]
