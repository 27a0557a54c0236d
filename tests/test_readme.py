"""The README's Python examples, run as a new user runs them: copied in order into one fresh process.

Its first example pinned ``dot_general_3`` to ``RS1 = RR x RS1``, a strategy of a 2-D matmul, while the GPT it
plans has 3-D activations (``dot_general_3`` is attention's ``bqhd,bkhd->bhqk``): the pin raised a ``PinError``
and nothing checked it. Here every ```python block runs (a local Ray included, started and stopped by the
example itself), and the edits the examples make are checked to have taken effect.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"

AFTER = {  # what to record after block i: later blocks rebind plan, plan2, ...
    0: '_checks = {"single_pin": plan2.op("dot_general_6").strategy, "single_before": plan.op("dot_general_6").strategy}',
    2: '_checks.update(stage_pin=plan3.op("dot_general_6").strategy, loaded=len(al.PipelinePlan.load("gpt.plan.json").stages))',
}
END = 'import json as _json\n_checks["loss"] = float(loss)\nprint("README-CHECKS " + _json.dumps(_checks))'


def python_blocks(text: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", text, flags=re.S)


def test_the_readme_examples_run_as_written(tmp_path):
    blocks = python_blocks(README.read_text())
    assert len(blocks) >= 5  # quick start, export, pipelining, Ray, training runs
    script = tmp_path / "readme_examples.py"
    script.write_text("\n".join(b + AFTER.get(i, "") for i, b in enumerate(blocks)) + "\n" + END + "\n")
    env = {**os.environ, "ALPA_LAB_CACHE": str(tmp_path / "cache")}  # the user's calibrations stay untouched
    out = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=600, env=env)
    assert out.returncode == 0, (out.stdout[-2000:], out.stderr[-4000:])
    line = next(x for x in out.stdout.splitlines() if x.startswith("README-CHECKS "))
    checks = json.loads(line.split(" ", 1)[1])
    assert checks["single_pin"] == "S1RR = S1RR x RR" != checks["single_before"]  # the pin took
    assert checks["stage_pin"] == "RS1R = RS1R x RR"
    assert checks["loaded"] == 2  # the pinned stages, saved and loaded
    assert checks["loss"] == checks["loss"] and checks["loss"] > 0  # a finite loss from the last run
    assert (tmp_path / "plan.json").exists()
