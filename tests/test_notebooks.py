"""The example notebooks in ``notebooks/`` run top to bottom in a fresh ``python3`` kernel.

Every ``notebooks/*.ipynb`` is executed with nbclient in a temporary copy of the folder (so
the files a notebook writes, such as Chrome traces, stay out of the repository), in a kernel
with 8 simulated CPU devices. A cell that raises fails the test with the cell and its
traceback. The notebooks hold their own checks (numerics against ``jax.jit`` with stated
tolerances); here we check that the views they promise were shown: the workbench widget
with its static HTML copy, and a few facts per notebook from the outputs. Committed
notebooks carry no outputs.
"""

from __future__ import annotations

import os
import shutil
import sys
import time
from pathlib import Path

import nbformat
import pytest
from jupyter_client.manager import KernelManager
from nbclient import NotebookClient

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"
PATHS = sorted(NOTEBOOKS.glob("*.ipynb"))
WIDGET = "application/vnd.jupyter.widget-view+json"
DEVICE_FLAG = "--xla_force_host_platform_device_count=8"

# Facts each notebook's outputs must show (text of streams, text/plain and text/html).
# A notebook not listed here is still executed and must not raise.
EXPECT = {
    "01_quickstart_mlp.ipynb": ["Plan (alpa)", "logical mesh 1x4", "chose ", "data_parallel", "losses equal jax.jit"],
    "02_gpt_pipelining.ipynb": [
        "Pipeline plan (alpa)", "sub-mesh", "bubble", "zb_h1", "gpipe", "wrote gpt_pipeline_trace.json",
        "measured against predicted", "parameter update relative error", "p3.16xlarge:2",
    ],
    "03_moe.ipynb": ["MoEFFN_0", "egcm,emh->egch", "reshardings by all-to-all", "all-to-all", "expert parallel"],
    "04_wide_resnet.ipynb": ["2 stages", "ResidualBlock_0/Conv_0", "in flight", "capacity", "running statistics = mean"],
    "05_editing_a_plan.ipynb": [
        "pinned: dot_general", "cannot hold together", "after two undos, pins: ()", "-> layers 0..1 on (1, 4)",
        "pin_stages with a gap: False",
    ],
    "06_flax_nnx.ipynb": [
        "hands the NNX objects' changes back after each call: True", "losses equal nnx.jit", "Pipeline plan (alpa)",
        "dropout key counter 3", "refused: a training run",
    ],
}
FILES_WRITTEN = {"02_gpt_pipelining.ipynb": ["gpt_pipeline_trace.json"]}


def _kernel_env() -> dict[str, str]:
    """This process's environment, with 8 simulated CPU devices for JAX in the kernel."""
    env = dict(os.environ)
    flags = env.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        env["XLA_FLAGS"] = f"{flags} {DEVICE_FLAG}".strip()
    env.setdefault("JAX_PLATFORMS", "cpu")
    return env


def _outputs_text(nb: nbformat.NotebookNode) -> str:
    parts = []
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            if out.get("output_type") == "stream":
                parts.append(out.get("text", ""))
            data = out.get("data", {})
            parts += [str(data.get(mime, "")) for mime in ("text/plain", "text/html")]
    return "\n".join(parts)


def test_python3_kernel_is_this_interpreter():
    """The notebooks run in the ``python3`` kernel: it must start this very interpreter."""
    cmd = KernelManager(kernel_name="python3").format_kernel_cmd()
    assert os.path.realpath(cmd[0]) == os.path.realpath(sys.executable), (
        f"the python3 kernelspec starts {cmd[0]}, not {sys.executable}: install ipykernel into this "
        "environment (it installs a python3 kernelspec there) or remove the other python3 kernelspec "
        "(`jupyter kernelspec list`)"
    )


def test_there_are_notebooks():
    assert len(PATHS) >= 5, f"expected the example notebooks in {NOTEBOOKS}"


@pytest.mark.parametrize("path", PATHS, ids=[p.name for p in PATHS])
def test_committed_without_outputs(path: Path):
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    assert nb.metadata.get("kernelspec", {}).get("name") == "python3"
    for i, cell in enumerate(nb.cells):
        if cell.cell_type == "code":
            assert not cell.outputs and cell.execution_count is None, f"cell {i} of {path.name} has outputs: clear them"


@pytest.mark.parametrize("path", PATHS, ids=[p.name for p in PATHS])
def test_notebook_runs(path: Path, tmp_path: Path):
    work = tmp_path / "notebooks"
    shutil.copytree(NOTEBOOKS, work)
    nb = nbformat.read(work / path.name, as_version=4)
    client = NotebookClient(nb, kernel_name="python3", timeout=300, resources={"metadata": {"path": str(work)}})
    t0 = time.perf_counter()
    client.execute(env=_kernel_env())  # a cell that raises raises CellExecutionError here, with its traceback
    print(f"{path.name}: executed in {time.perf_counter() - t0:.1f} s")

    widgets = [out for cell in nb.cells for out in cell.get("outputs", []) if WIDGET in out.get("data", {})]
    if path.name in EXPECT:
        workbenches = [out for out in widgets if "alpa-lab" in out["data"].get("text/html", "")]
        assert workbenches, f"{path.name} shows no workbench (a widget output with a static text/html copy)"
    text = _outputs_text(nb)
    for fact in EXPECT.get(path.name, []):
        assert fact in text, f"{path.name}: expected {fact!r} in the outputs"
    for name in FILES_WRITTEN.get(path.name, []):
        assert (work / name).is_file(), f"{path.name} should have written {name} next to itself"
