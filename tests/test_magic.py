"""The %%parallelize magic in a real in-process IPython shell (issue 4, part 1)."""

from __future__ import annotations

import pytest
from IPython.core.error import UsageError
from IPython.testing import globalipapp

import alpa_lab as al
from alpa_lab.models import tiny_example


@pytest.fixture(scope="module")
def ip():
    shell = globalipapp.start_ipython() or globalipapp.get_ipython()  # one IPython app per process: another test module may have started it
    shell.run_line_magic("load_ext", "alpa_lab")
    ex = tiny_example("mlp")
    shell.user_ns.update(ex_step=ex.train_step, state=ex.state, batch=ex.batch)
    return shell


CELL = """
def train_step(state, batch):
    return ex_step(state, batch)
"""


def test_magic_plans_binds_and_runs(ip, capsys):
    wb = ip.run_cell_magic("parallelize", "--cluster local:1x4 --args state,batch --name mlp_plan", CELL)
    step, plan = ip.user_ns["train_step"], ip.user_ns["mlp_plan"]
    assert isinstance(step, al.ParallelizedStep) and isinstance(plan, al.Plan)
    assert step.current_plan is plan and plan.cluster["name"] == "local:1x4"
    assert "Plan (alpa)" in repr(wb)  # a terminal shows the summary; a notebook the widget
    state, loss = step(ip.user_ns["state"], ip.user_ns["batch"])
    assert float(loss) > 0


def test_magic_pipelined(ip, capsys):
    line = "--cluster local:2x4 --microbatches 4 --layers 3 --schedule gpipe --args state,batch --name p --no-display"
    ip.run_cell_magic("parallelize", line, CELL)
    plan = ip.user_ns["p"]
    assert plan.schedule == "gpipe" and plan.num_microbatches == 4
    assert capsys.readouterr().out == ""  # --no-display


def test_magic_remat(ip):
    line = "--cluster local:1x4 --microbatches 4 --layers 3 --remat --args state,batch --name r --no-display"
    ip.run_cell_magic("parallelize", line, CELL)
    assert ip.user_ns["train_step"].remat is True
    plain = al.parallelize(ip.user_ns["ex_step"], cluster=al.ClusterSpec.local(1, 4), microbatches=4, layers=3)
    plain_plan = plain.plan(ip.user_ns["state"], ip.user_ns["batch"])
    kept = sum(st.activation_memory for st in ip.user_ns["r"].stages)
    assert kept < sum(st.activation_memory for st in plain_plan.stages)
    with pytest.raises(UsageError, match="single-mesh plan has no layers"):
        ip.run_cell_magic("parallelize", "--cluster local:1x4 --remat --args state,batch", CELL)


def test_magic_batch_argnums(ip):
    """``--batch-argnums 1``: the step's second argument is its batch (Alpa's ``batch_argnums``)."""
    line = "--cluster local:1x4 --microbatches 4 --layers 3 --batch-argnums 1 --args state,batch --name b --no-display"
    ip.run_cell_magic("parallelize", line, CELL)
    step = ip.user_ns["train_step"]
    assert step.batch_argnums == (1,)
    assert ip.user_ns["b"].split_inputs and all(p.startswith("[1]") for p in ip.user_ns["b"].split_inputs)
    with pytest.raises(UsageError, match="--batch-argnums takes argument positions"):
        ip.run_cell_magic("parallelize", "--cluster local:1x4 --microbatches 4 --batch-argnums batch --args state,batch", CELL)
    with pytest.raises(UsageError, match="names argument 2, but the step was called with 2"):
        ip.run_cell_magic("parallelize", "--cluster local:1x4 --microbatches 4 --batch-argnums 2 --args state,batch", CELL)


def test_magic_submesh_space(ip):
    """``--submesh-space power_of_two``: on 3 hosts the DP may not use a 3-host sub-mesh; a bad space is a usage error."""
    line = "--cluster local:3x1 --microbatches 4 --layers 3 --submesh-space power_of_two --args state,batch --name s --no-display"
    ip.run_cell_magic("parallelize", line, CELL)
    assert ip.user_ns["train_step"].submesh_space == "power_of_two"
    assert all(st.submesh_shape != (3, 1) for st in ip.user_ns["s"].stages)
    with pytest.raises(UsageError, match="unknown sub-mesh space 'pow2'"):
        ip.run_cell_magic("parallelize", "--cluster local:3x1 --microbatches 4 --submesh-space pow2 --args state,batch", CELL)


def test_magic_logical_meshes(ip):
    """``--logical-meshes same_as_physical``: every stage keeps its sub-mesh's own shape; a bad space is a usage error."""
    line = "--cluster local:1x4 --microbatches 4 --layers 3 --logical-meshes same_as_physical --args state,batch --name s --no-display"
    ip.run_cell_magic("parallelize", line, CELL)
    assert ip.user_ns["train_step"].logical_meshes == "same_as_physical"
    assert ip.user_ns["s"].stages and all(st.logical_shape == st.submesh_shape for st in ip.user_ns["s"].stages)
    with pytest.raises(UsageError, match="unknown logical mesh space 'dp'"):
        ip.run_cell_magic("parallelize", "--cluster local:1x4 --microbatches 4 --logical-meshes dp --args state,batch", CELL)


def test_magic_without_args_only_wraps(ip):
    ip.run_cell_magic("parallelize", "--cluster p3.16xlarge:2", CELL)
    step = ip.user_ns["train_step"]
    assert step.current_plan is None and step.cluster.name == "p3.16xlarge:2"


@pytest.mark.parametrize(
    "line, cell, match",
    [
        ("--cluster local:two", CELL, "bad --cluster"),
        ("--args state,nope", CELL, "nope are not defined"),
        ("--method fastest", CELL, "unknown --method"),
        ("--name 1x", CELL, "not a Python identifier"),
        ("--workbench a-b", CELL, "--workbench 'a-b' is not a Python identifier"),
        ("--device-memory -1", CELL, "--device-memory must be a positive"),
        ("--memory-budget lots", CELL, "memory_budget is bytes per device: a number .* got 'lots'"),
        ("--microbatches 2 --schedule nope", CELL, "unknown pipeline schedule"),
        ("", "x = 1\n", "must define the training step"),
        ("--bogus", CELL, "unrecognized arguments"),
    ],
)
def test_magic_errors_are_usage_errors(ip, line, cell, match):
    before = ip.user_ns.get("train_step")
    with pytest.raises(UsageError, match=match):
        ip.run_cell_magic("parallelize", line, cell)
    assert ip.user_ns.get("train_step") is before  # nothing rebound


def test_error_in_the_users_cell_shows_their_code(ip, capsys):
    cell = "def train_step(state, batch):\n    return 1\nraise RuntimeError('in the user cell')\n"
    ip.run_cell_magic("parallelize", "", cell)
    err = capsys.readouterr()
    text = err.out + err.err
    assert "in the user cell" in text and "alpa_lab" not in text.split("RuntimeError")[0].split("Traceback")[-1]


def test_magic_shows_the_workbench_and_its_edits_rebind_the_name(ip):
    from alpa_lab.notebook import Workbench

    wb = ip.run_cell_magic("parallelize", "--cluster local:1x4 --args state,batch --name wb_plan", CELL)
    assert isinstance(wb, Workbench) and wb.plan is ip.user_ns["wb_plan"]
    op = next(o for o in wb.plan.ops if o.kind == "op" and o.num_strategies > 1)
    other = next(a.strategy for a in wb.plan.explain(op.name).alternatives if not a.chosen)
    assert wb.pin(op.name, other)
    assert ip.user_ns["wb_plan"] is wb.plan and ip.user_ns["train_step"].current_plan is wb.plan
    assert ip.user_ns["wb_plan"].op(op.name).strategy == other



def test_help_prints_every_option_and_runs_nothing(ip, capsys):
    ip.user_ns.pop("helped", None)
    assert ip.run_cell_magic("parallelize", "--help", "def helped(state, batch):\n    return state\n") is None
    out = capsys.readouterr().out
    for option in ("--cluster", "--microbatches", "--schedule", "--layers", "--method", "--memory-budget", "--args", "--name",
                   "--no-display", "--remat", "p3.16xlarge:8"):
        assert option in out
    assert "helped" not in ip.user_ns


def test_workbench_name_max_stages_and_device_memory(ip):
    line = ("--cluster local:2x4 --microbatches 4 --layers 4 --max-stages 1 --device-memory 2 "
            "--args state,batch --name one_stage --workbench wb1")
    wb = ip.run_cell_magic("parallelize", line, CELL)
    assert ip.user_ns["wb1"] is wb and wb.plan is ip.user_ns["one_stage"]
    assert wb.plan.num_stages == 1 and wb.plan.cluster["device_memory"] == 2 * 2**30
    assert ip.user_ns["train_step"].max_stages == 1


@pytest.mark.parametrize("pipelined", ["", "--microbatches 4 "])
def test_an_error_in_the_step_shows_the_users_line_only(ip, capsys, pipelined):
    ip.user_ns["kept"] = "previous plan"
    cell = "def train_step(state, batch):\n    x = batch['no_such_key']\n    return state, x\n"
    ip.run_cell_magic("parallelize", f"--cluster local:2x4 {pipelined}--args state,batch --name kept", cell)
    err = capsys.readouterr()
    text = err.out + err.err
    assert "x = batch['no_such_key']" in text and "KeyError" in text
    assert "alpa_lab" not in text.split("KeyError")[1].split("%%parallelize:")[0]  # no library frames
    assert "the step was not planned" in text and ip.user_ns["kept"] == "previous plan"


def test_a_step_that_cannot_be_planned_as_asked_is_a_usage_error(ip):
    ip.user_ns["kept"] = "previous plan"
    with pytest.raises(UsageError, match="microbatches=3 does not divide the batch size"):
        ip.run_cell_magic("parallelize", "--cluster local:2x4 --microbatches 3 --args state,batch --name kept", CELL)
    assert ip.user_ns["kept"] == "previous plan"
