"""The workbench's graph view (issue 10): the planned program as nodes and edges, checked without a browser.

Oracles: the traced op graph's own operands for the edges (every op input another op made),
the plans' ``reshardings`` for the red edges' costs, ``views.traffic`` (itself checked
against the unit tasks in ``test_workbench``) for the cross-mesh bytes, and the Strategies and
Sharding tabs' own widgets for what a click on a node selects.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import replace

import pytest
from plotly.callbacks import Points

import alpa_lab as al
from alpa_lab.models import tiny_example
from alpa_lab.notebook import render, views
from alpa_lab.notebook.workbench import Workbench

LOCAL = al.ClusterSpec.local(hosts=2, devices_per_host=4)
ALL = 10**9
"""``max_nodes`` that keeps one node per op."""

# The ILP lays the tiny models out without a single resharding (the GPT's heads split, the MLP's kernels by
# columns then rows): the fixtures pin their first matmul to another layout, so that there are reshardings to draw.


@pytest.fixture(scope="module")
def gpt():
    ex = tiny_example("gpt")
    step = al.parallelize(ex.train_step, cluster=LOCAL, microbatches=4, layers=4)
    plan = step.plan(ex.state, ex.batch).pin_stages([[0, 1], [2, 3]], submeshes=[(1, 4), (1, 4)])
    plan = plan.pin("dot_general_1", "RS1RR = RS1R x RRR")  # a resharding to draw, between two nodes
    step.current_plan = plan
    return ex, step, plan


@pytest.fixture(scope="module")
def mlp():
    ex = tiny_example("mlp")
    step = al.parallelize(ex.train_step, cluster=al.ClusterSpec.local(1, 4))
    return ex, step, step.plan(ex.state, ex.batch).pin("dot_general_0", "S1R = S1R x RR")  # a resharding to draw


def _ops(plan) -> list[str]:
    return [o.name for sp in views.stage_plans(plan) for o in sp.ops if o.kind == "op"]


def _dependencies(graph) -> set[tuple[str, str]]:
    """(producer, consumer) for every op input that another op computed: read off the op graph."""
    made_by = {v: op.name for op in graph.ops for v in op.outputs}
    return {(made_by[v], op.name) for op in graph.ops for v in op.inputs if v in made_by}


def _pipeline_graph(plan):
    return plan.problem.graph


def _single_graph(step, ex):
    return step.trace(ex.state, ex.batch)


# ----- nodes --------------------------------------------------------------------------------------


@pytest.mark.parametrize("which", ["gpt", "mlp"])
@pytest.mark.parametrize("max_nodes", [ALL, 150, 20])
def test_every_op_is_in_exactly_one_node(which, max_nodes, request):
    _, _, plan = request.getfixturevalue(which)
    g = views.program_graph(plan, max_nodes=max_nodes)
    counts = Counter(o for n in g.nodes for o in n.ops)
    assert counts == Counter(_ops(plan)) and set(counts.values()) == {1}
    assert g.num_ops == len(counts)
    assert g.grouped == (len(counts) > max_nodes)
    if g.grouped:
        assert len(g.nodes) <= max_nodes or g.module_depth == 0
    else:
        assert all(n.ops == (n.id,) == (n.main,) for n in g.nodes)
    stage_of = {o.name: i for i, sp in enumerate(views.stage_plans(plan)) for o in sp.ops}
    op = {o.name: o for sp in views.stage_plans(plan) for o in sp.ops}
    for n in g.nodes:
        assert {stage_of[o] for o in n.ops} == {n.stage} and n.main in n.ops
        assert n.spec == op[n.main].output_specs[0] and n.strategy == op[n.main].strategy
        assert n.key == views.sharding_key(n.spec)
        assert n.compute == pytest.approx(sum(op[o].compute_cost for o in n.ops))
        assert n.communication == pytest.approx(sum(op[o].communication_cost for o in n.ops))
    assert len({n.id for n in g.nodes}) == len(g.nodes)


def test_sharding_key_names_the_mesh_axes():
    assert [views.sharding_key(s) for s in ("S0R", "RS0R", "S0RS1", "RS01", "RR", "-", "S1")] == [
        "S0", "S0", "S0+S1", "S01", "R", "R", "S1"
    ]


# ----- edges --------------------------------------------------------------------------------------


def _drawn(g) -> dict[tuple[str, str], views.GraphEdge]:
    return {(e.src, e.dst): e for e in g.edges}


@pytest.mark.parametrize("which", ["gpt", "mlp"])
@pytest.mark.parametrize("max_nodes", [ALL, 150])
def test_edges_are_the_data_dependencies(which, max_nodes, request):
    ex, step, plan = request.getfixturevalue(which)
    graph = _pipeline_graph(plan) if which == "gpt" else _single_graph(step, ex)
    g = views.program_graph(plan, max_nodes=max_nodes)
    node = {o: n.id for n in g.nodes for o in n.ops}
    want = {(node[a], node[b]) for a, b in _dependencies(graph) if node[a] != node[b]}
    drawn = _drawn(g)
    # a new state leaf read next step by another stage is drawn too (phase "state"): the only extra edges
    assert want <= set(drawn)
    assert all("state" in drawn[k].phase for k in set(drawn) - want)
    assert len(drawn) == len(g.edges)
    if max_nodes == ALL:  # op by op: the columns follow the data
        x = {n.id: n.x for n in g.nodes}
        assert all(x[a] < x[b] for a, b in want)


@pytest.mark.parametrize("which", ["gpt", "mlp"])
def test_resharding_edges_carry_the_plans_reshardings(which, request):
    _, _, plan = request.getfixturevalue(which)
    total = sum(r.cost for sp in views.stage_plans(plan) for r in sp.reshardings)
    assert total > 0
    ops = set(_ops(plan))
    want: dict[tuple[str, str], float] = defaultdict(float)
    for sp in views.stage_plans(plan):
        for r in sp.reshardings:
            producer = r.producer[1:].rsplit(":", 1)[0] if r.producer.startswith("<") else r.producer
            if producer in ops and r.consumer in ops:
                want[(producer, r.consumer)] += r.cost
    g = views.program_graph(plan, max_nodes=ALL)
    got = {(e.src, e.dst): e.resharding for e in g.edges if e.resharding > 0}
    assert got.keys() == want.keys()
    assert all(got[k] == pytest.approx(want[k]) for k in want)
    assert all(e.kind in ("reshard", "cross_mesh") for e in g.edges if e.resharding > 0)
    for max_nodes in (ALL, 150, 20):  # what no edge shows is the nodes'; nothing is lost or counted twice
        g = views.program_graph(plan, max_nodes=max_nodes)
        shown = sum(e.resharding for e in g.edges) + sum(n.resharding for n in g.nodes)
        assert shown == pytest.approx(total)


@pytest.mark.parametrize("max_nodes", [ALL, 150])
def test_cross_mesh_edges_carry_the_traffic(gpt, max_nodes):
    _, _, plan = gpt
    g = views.program_graph(plan, max_nodes=max_nodes)
    stage = {n.id: n.stage for n in g.nodes}
    got: dict[tuple[int, int], int] = defaultdict(int)
    for e in g.edges:
        assert (e.kind == "cross_mesh") == (stage[e.src] != stage[e.dst])
        if e.nbytes:
            assert e.kind == "cross_mesh" and e.seconds > 0
            got[(stage[e.src], stage[e.dst])] += e.nbytes
    tr = views.traffic(plan)
    want = {(a, b): v for a, row in enumerate(tr.mesh_bytes) for b, v in enumerate(row) if v}
    assert dict(got) == want and len(want) == 2  # activations forward, gradients (and the update's reads) back
    kinds = Counter(e.kind for e in g.edges)
    assert kinds["data"] and kinds["reshard"] and kinds["cross_mesh"]


def test_a_single_mesh_plan_is_one_band_without_cross_mesh_edges(mlp):
    _, _, plan = mlp
    g = views.program_graph(plan)
    assert [b.stage for b in g.bands] == [0] and {n.stage for n in g.nodes} == {0}
    assert all(e.kind != "cross_mesh" and e.nbytes == 0 for e in g.edges)


@pytest.mark.parametrize("max_nodes", [ALL, 150])
def test_layout_is_deterministic_and_in_stage_bands(gpt, max_nodes):
    _, _, plan = gpt
    g = views.program_graph(plan, max_nodes=max_nodes)
    assert g == views.program_graph(plan, max_nodes=max_nodes)
    band = {b.stage: b for b in g.bands}
    assert sorted(band) == [0, 1]
    assert band[0].bottom < band[1].top
    for n in g.nodes:
        assert band[n.stage].top <= n.y <= band[n.stage].bottom
    assert len({(n.x, n.y) for n in g.nodes}) == len(g.nodes)  # no two nodes on one spot


def test_a_loaded_plan_without_planner_state_draws_its_ops(mlp, tmp_path):
    _, _, plan = mlp
    plan.save(tmp_path / "plan.json")
    loaded = al.Plan.load(tmp_path / "plan.json")
    g = views.program_graph(loaded)
    assert Counter(o for n in g.nodes for o in n.ops) == Counter(_ops(plan)) and g.edges == ()


# ----- the overview's device labels -------------------------------------------------------------------


def test_device_blocks_label_each_stage_once(gpt):
    _, _, plan = gpt
    ov = views.overview(plan)
    assert [(b.label, b.hosts, b.devices) for b in views.device_blocks(ov)] == [
        ("stage 0", (0, 0), (0, 3)), ("stage 1", (1, 1), (0, 3))
    ]
    # a mesh spanning hosts is one block; an interleaved device and an idle one are blocks of their own
    labels = (("stage 0", "stage 0", "stages 1,2", "idle"), ("stage 0", "stage 0", "stages 1,2", "stage 3"))
    blocks = views.device_blocks(replace(ov, device_labels=labels))
    assert [(b.label, b.hosts, b.devices) for b in blocks] == [
        ("stage 0", (0, 1), (0, 1)), ("stages 1,2", (0, 1), (2, 2)), ("idle", (0, 0), (3, 3)), ("stage 3", (1, 1), (3, 3))
    ]
    covered = Counter((h, d) for b in blocks for h in range(b.hosts[0], b.hosts[1] + 1) for d in range(b.devices[0], b.devices[1] + 1))
    assert set(covered.values()) == {1} and len(covered) == 8
    assert all(labels[h][d] == b.label for b in blocks for h in range(b.hosts[0], b.hosts[1] + 1)
               for d in range(b.devices[0], b.devices[1] + 1))
    fig = render.overview_figure(ov)
    assert sorted(a.text for a in fig.layout.annotations if a.text.startswith("stage ")) == ["stage 0", "stage 1"]


# ----- the figure and the widget ----------------------------------------------------------------------


def test_graph_figure_draws_every_node_and_edge(gpt):
    _, _, plan = gpt
    g = views.program_graph(plan)
    some = g.nodes[3]
    fig = render.graph_figure(g, selected=some.ops[-1])
    nodes = [t for t in fig.data if t.customdata is not None]
    assert sorted(c for t in nodes for c in t.customdata) == sorted(n.main for n in g.nodes)
    assert {t.name.split(":")[0] for t in nodes} == {n.key for n in g.nodes}  # a legend entry per colour
    lines = [t for t in fig.data if t.mode == "lines"]
    assert sum(list(t.x).count(None) for t in lines) == len(g.edges)
    width = {t.legendgroup: [] for t in lines}
    for t in lines:
        width[t.legendgroup].append(t.line.width)
    assert max(width["data"]) < min(width["cross_mesh"]) and max(width["data"]) < min(width["reshard"])
    ring = next(t for t in fig.data if t.name == "selected")
    assert (tuple(ring.x), tuple(ring.y)) == ((some.x,), (some.y,))


def test_select_op_shows_the_op_in_strategies_and_sharding(gpt):
    _, step, plan = gpt
    wb = Workbench(plan, step)
    assert wb.tabs.titles[-1] == "Graph" and wb.graph_box.children
    op = next(o for o in plan.stages[1].plan.ops if o.kind == "op" and o.primitive == "dot_general" and len(o.output_specs) == 1)
    wb.op_filter.value = "reduce_sum"  # a filter that hides it: selecting it clears the filter
    wb.select_op(op.name)
    assert wb.op_select.value == op.name and wb.strategy_select.value == op.strategy
    assert wb.explain_html.value.startswith(f"<pre>{op.name} (")
    assert wb.tensor_select.value == op.name
    heatmap = wb.heatmap_box.children[0]
    assert heatmap.layout.title.text.startswith(op.name) and op.output_specs[0] in heatmap.layout.title.text
    node = wb._graph.node_of(op.name)
    ring = next(t for t in wb._graph_widget.data if t.name == "selected")
    assert (tuple(ring.x), tuple(ring.y)) == ((node.x,), (node.y,))
    with pytest.raises(KeyError, match="no op named"):
        wb.select_op("dot_generl_3")
    # a click on a node (the widget's own dispatch, as the browser's click arrives) selects its op
    trace = next(t for t in wb._graph_widget.data if t.customdata is not None and t.customdata[0] != op.name)
    trace._dispatch_on_click(Points(point_inds=[0], trace_index=0), None)
    assert wb.op_select.value == trace.customdata[0] and wb.last_error == ""
    # an edit redraws the graph from the new plan
    before = wb._graph
    other = next(a.strategy for a in plan.stages[1].plan.explain(op.name).alternatives if not a.chosen)
    assert wb.pin(op.name, other)
    assert wb._graph is not before and wb._graph == views.program_graph(wb.plan)
    assert views.program_graph(wb.plan, max_nodes=ALL).node_of(op.name).strategy == other
    step.current_plan = plan
