"""Inter-op stage-construction DP (sec. 5.2, eq. 2-4) against exhaustive search."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from alpa_lab.passes.inter_op import (
    InterOpError,
    InterOpPlan,
    StageCost,
    brute_force_stages,
    logical_shapes,
    stage_dp,
)
from alpa_lab.passes.submesh import submesh_shapes

CLUSTERS = [(1, 1), (1, 2), (1, 4), (2, 2), (2, 4)]


def random_cost(rng: random.Random, p_none: float):
    """Independent random time per argument tuple, some infeasible (None)."""
    table: dict = {}

    def cost(start, end, shape, logical):
        key = (start, end, shape, logical)
        if key not in table:
            table[key] = None if rng.random() < p_none else StageCost(rng.uniform(0.1, 10.0))
        return table[key]

    return cost


def structured_cost(rng: random.Random, num_layers: int, mem_cap: float | None):
    """time = flops(range) / devices + communication penalty; None when out of memory."""
    flops = [rng.uniform(1.0, 20.0) for _ in range(num_layers)]
    params = [rng.uniform(1.0, 5.0) for _ in range(num_layers)]
    alpha, beta = rng.uniform(0.0, 2.0), rng.uniform(0.0, 1.0)

    def cost(start, end, shape, logical):
        n, m = shape
        a, b = logical
        devices = n * m
        work = sum(flops[start:end])
        # cross-host all-reduce is slower than intra-host; uneven logical meshes pay more
        comm = alpha * (n - 1) + beta * (a - 1) + 0.3 * beta * (b - 1)
        memory = sum(params[start:end]) / devices
        if mem_cap is not None and memory > mem_cap:
            return None
        return StageCost(work / devices + comm, memory)

    return cost


def check_plan(plan: InterOpPlan, L: int, N: int, M: int, B: int) -> None:
    ids = [d for st in plan.stages for d in st.device_ids]
    assert len(ids) == len(set(ids)) == N * M
    assert sorted(ids) == list(range(N * M))
    assert plan.stages[0].layers[0] == 0 and plan.stages[-1].layers[1] == L
    for prev, nxt in zip(plan.stages, plan.stages[1:]):
        assert prev.layers[1] == nxt.layers[0]
    valid = set(submesh_shapes(N, M))
    for st in plan.stages:
        assert st.layers[0] < st.layers[1]
        assert st.submesh_shape in valid
        assert st.logical_shape in logical_shapes(st.submesh_shape)
        assert len(st.device_ids) == st.submesh_shape[0] * st.submesh_shape[1]
    times = [st.time for st in plan.stages]
    assert plan.total_time == pytest.approx(sum(times) + (B - 1) * max(times), rel=1e-12)
    assert plan.t_max == max(times)
    assert plan.num_microbatches == B


def solve_both(L, N, M, B, cost, max_stages=None):
    """(dp result or None, brute-force value or None), plus the DP's call counter."""
    calls: Counter = Counter()

    def counted(*args):
        calls[args] += 1
        return cost(*args)

    try:
        plan = stage_dp(L, N, M, B, counted, max_stages=max_stages)
    except InterOpError:
        plan = None
    try:
        ref = brute_force_stages(L, N, M, B, cost, max_stages=max_stages)
    except InterOpError:
        ref = None
    return plan, ref, calls


def test_logical_shapes():
    assert logical_shapes((1, 1)) == ((1, 1),)
    assert logical_shapes((1, 4)) == ((1, 4), (2, 2), (4, 1))
    assert logical_shapes((2, 4)) == ((1, 8), (2, 4), (4, 2), (8, 1))


def test_dp_matches_brute_force_on_random_instances():
    rng = random.Random(20220711)
    infeasible = feasible = multi_stage = 0
    for trial in range(200):
        L = rng.randint(1, 5)
        N, M = rng.choice(CLUSTERS)
        B = rng.randint(1, 8)
        if trial % 2 == 0:
            cost = random_cost(rng, p_none=rng.choice([0.0, 0.2, 0.6, 0.95]))
        else:
            cost = structured_cost(rng, L, mem_cap=rng.choice([None, 3.0, 8.0]))
        max_stages = rng.choice([None, None, None, 1, 2])
        plan, ref, calls = solve_both(L, N, M, B, cost, max_stages)
        assert all(v == 1 for v in calls.values()), "stage_cost called twice for one tuple"
        assert (plan is None) == (ref is None), (trial, L, N, M, B)
        if plan is None:
            infeasible += 1
            continue
        feasible += 1
        assert plan.total_time == pytest.approx(ref, rel=1e-9), (trial, L, N, M, B)
        check_plan(plan, L, N, M, B)
        if max_stages is not None:
            assert len(plan.stages) <= max_stages
        multi_stage += len(plan.stages) > 1
    # the generator exercises both outcomes and real pipelines
    assert infeasible >= 5 and feasible >= 100 and multi_stage >= 20


def test_stage_cost_called_once_per_tuple():
    rng = random.Random(1)
    cost = structured_cost(rng, 4, None)
    calls: Counter = Counter()

    def counted(*args):
        calls[args] += 1
        return cost(*args)

    stage_dp(4, 2, 4, 8, counted)
    assert calls and max(calls.values()) == 1


def _compute_heavy(start, end, shape, logical):
    """1 unit of work per layer, perfectly split, but 0.5 per extra device of overhead."""
    devices = shape[0] * shape[1]
    return StageCost((end - start) / devices + 0.5 * (devices - 1))


def test_pipelining_wins_with_many_microbatches():
    plan = stage_dp(4, 1, 4, 64, _compute_heavy)
    assert len(plan.stages) > 1
    assert plan.total_time == pytest.approx(brute_force_stages(4, 1, 4, 64, _compute_heavy))
    # four single-device stages: 4 + 63 * 1 beats one 4-device stage: 64 * 2.5
    assert plan.total_time == pytest.approx(67.0)
    check_plan(plan, 4, 1, 4, 64)


def test_no_pipelining_with_one_microbatch():
    # B = 1: T = sum of stage times, so splitting only adds per-stage overhead:
    # one 4-device stage 1.0 + 0.3 + 0.5 = 1.8 beats e.g. four 1-device stages 4 * 1.5 = 6
    cost = lambda s, e, shape, logical: StageCost(  # noqa: E731
        (e - s) / (shape[0] * shape[1]) + 0.1 * (shape[0] * shape[1] - 1) + 0.5
    )
    plan = stage_dp(4, 1, 4, 1, cost)
    assert len(plan.stages) == 1
    assert plan.stages[0].submesh_shape == (1, 4)
    assert plan.total_time == pytest.approx(brute_force_stages(4, 1, 4, 1, cost))
    check_plan(plan, 4, 1, 4, 1)


def test_max_stages_limits_pipeline():
    plan = stage_dp(4, 1, 4, 64, _compute_heavy, max_stages=2)
    assert len(plan.stages) <= 2
    assert plan.total_time == pytest.approx(
        brute_force_stages(4, 1, 4, 64, _compute_heavy, max_stages=2)
    )


def test_picks_logical_shape():
    # only the (2, 2) view of a 4-device sub-mesh is fast
    def cost(start, end, shape, logical):
        if shape != (1, 4):
            return None
        return StageCost(1.0 if logical == (2, 2) else 5.0)

    plan = stage_dp(2, 1, 4, 3, cost)
    assert [st.logical_shape for st in plan.stages] == [(2, 2)]
    assert plan.total_time == pytest.approx(3.0)


def test_device_ids_on_two_hosts():
    plan = stage_dp(4, 2, 4, 64, _compute_heavy)
    check_plan(plan, 4, 2, 4, 64)


def test_infeasible_message():
    with pytest.raises(InterOpError, match="no slicing of 4 layers fits 2x4 devices"):
        stage_dp(4, 2, 4, 2, lambda *a: None)
    # feasible stages exist, but only on 1 device: 8 devices cannot be covered by 4 layers
    only_one = lambda s, e, shape, lg: StageCost(1.0) if shape == (1, 1) else None  # noqa: E731
    with pytest.raises(InterOpError, match="exactly 8 devices"):
        stage_dp(4, 2, 4, 2, only_one)
    with pytest.raises(InterOpError, match="no slicing"):
        brute_force_stages(4, 2, 4, 2, only_one)


@pytest.mark.parametrize(
    "args, match",
    [
        ((0, 1, 4, 2), "num_layers"),
        ((3, 0, 4, 2), "num_hosts"),
        ((3, 1, 0, 2), "devices_per_host"),
        ((3, 1, 4, 0), "num_microbatches"),
        ((3.0, 1, 4, 2), "num_layers must be an int"),
        ((3, 1, 4, True), "num_microbatches"),
    ],
)
def test_bad_arguments(args, match):
    with pytest.raises(InterOpError, match=match):
        stage_dp(*args, _compute_heavy)
    with pytest.raises(InterOpError, match=match):
        brute_force_stages(*args, _compute_heavy)


def test_bad_callable_and_cost():
    with pytest.raises(InterOpError, match="callable"):
        stage_dp(2, 1, 2, 2, None)  # type: ignore[arg-type]
    with pytest.raises(InterOpError, match="max_stages"):
        stage_dp(2, 1, 2, 2, _compute_heavy, max_stages=0)
    with pytest.raises(InterOpError, match="StageCost or None"):
        stage_dp(2, 1, 2, 2, lambda *a: 1.0)
    with pytest.raises(InterOpError, match="finite"):
        stage_dp(2, 1, 2, 2, lambda *a: StageCost(float("nan")))


def test_brute_force_refuses_huge_search():
    with pytest.raises(InterOpError, match="combinations"):
        brute_force_stages(12, 4, 8, 4, _compute_heavy)


def test_min_over_stages_matches_full_table():
    """The stage-count-free DP used when max_stages does not bind equals min_s F(s, 0, D)
    bit for bit, for every t_max and after incremental row updates, and uncapped plans
    equal those with a non-binding cap."""
    import math

    from alpa_lab.passes import inter_op

    rng = random.Random(7)
    for _ in range(40):
        L = rng.randint(1, 7)
        N, M = rng.choice(CLUSTERS)
        D = N * M
        # integer times make ties (and exact-equality traps) common
        base = random_cost(rng, 0.3)

        def cost(start, end, shape, logical, base=base):
            c = base(start, end, shape, logical)
            return None if c is None else StageCost(float(round(c.time)))

        table = inter_op._profile(cost, L, submesh_shapes(N, M))
        if not table:
            continue
        dense = inter_op._Dense(table, L, D)
        S = min(L, D)
        solver = inter_op._MinOverStages(dense)
        for t_max in sorted({opt.time for opt in table.values()}):
            allowed = dense.allowed(t_max)
            # only rows up to the last start of a newly allowed option change
            top = max(s for (s, _, _), o in table.items() if o.time == t_max)
            got = solver.solve(allowed, top)
            F = inter_op._solve_f(dense, allowed, S)
            want = float(F[1:, 0, D].min())
            assert got == want or (math.isinf(got) and math.isinf(want))
        B = rng.randint(1, 9)
        try:
            a = stage_dp(L, N, M, B, cost)
        except InterOpError:
            with pytest.raises(InterOpError):
                stage_dp(L, N, M, B, cost, max_stages=S + 1)
            continue
        assert a == stage_dp(L, N, M, B, cost, max_stages=S + 1)
