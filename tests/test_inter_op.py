"""Inter-op stage-construction DP (sec. 5.2, eq. 2-4) against exhaustive search."""

from __future__ import annotations

import bisect
import math
import random
from dataclasses import replace as dataclass_replace
from collections import Counter

import numpy as np
import pytest

from alpa_lab.passes.inter_op import (
    InterOpError,
    InterOpPlan,
    RangeCosts,
    StageCost,
    brute_force_stages,
    logical_shapes,
    profile_stage_options,
    stage_dp,
    stage_dp_uniform,
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


def random_instances(seed: int, count: int):
    """(trial, L, N, M, B, cost, max_stages) of the DP's random tests. Costs draw lazily from
    the same generator, so an instance also depends on what the caller asked of the earlier ones."""
    rng = random.Random(seed)
    for trial in range(count):
        L = rng.randint(1, 5)
        N, M = rng.choice(CLUSTERS)
        B = rng.randint(1, 8)
        if trial % 2 == 0:
            cost = random_cost(rng, p_none=rng.choice([0.0, 0.2, 0.6, 0.95]))
        else:
            cost = structured_cost(rng, L, mem_cap=rng.choice([None, 3.0, 8.0]))
        max_stages = rng.choice([None, None, None, 1, 2])
        yield trial, L, N, M, B, cost, max_stages


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
    infeasible = feasible = multi_stage = 0
    for trial, L, N, M, B, cost, max_stages in random_instances(20220711, 200):
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
    with pytest.raises(InterOpError, match="would try .* combinations"):
        brute_force_stages(12, 4, 8, 4, _compute_heavy)


@pytest.mark.parametrize("L, N, M, cap", [(3, 1, 4, None), (4, 2, 2, None), (5, 2, 4, 3), (2, 1, 1, None)])
def test_brute_force_counts_its_search_before_it_starts(monkeypatch, L, N, M, cap):
    """The up-front count is the number of (slicing, sub-meshes, logical views) the search visits: the search
    runs with the limit set to that count, and is refused at one less. Oracle: the combinations enumerated."""
    import itertools

    from alpa_lab.passes import inter_op

    S = min(L, N * M, cap or L)
    shapes = submesh_shapes(N, M)
    count = 0
    for parts in range(1, S + 1):
        for _cuts in itertools.combinations(range(1, L), parts - 1):
            for assignment in itertools.product(shapes, repeat=parts):
                if sum(r * c for r, c in assignment) == N * M:
                    count += math.prod(len(logical_shapes(sh)) for sh in assignment)
    monkeypatch.setattr(inter_op, "_MAX_BRUTE_FORCE_COMBINATIONS", count)
    assert brute_force_stages(L, N, M, 4, _compute_heavy, max_stages=cap) > 0
    monkeypatch.setattr(inter_op, "_MAX_BRUTE_FORCE_COMBINATIONS", count - 1)
    with pytest.raises(InterOpError, match=f"would try {count} combinations"):
        brute_force_stages(L, N, M, 4, _compute_heavy, max_stages=cap)


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
            F = inter_op._solve_f(dense, t_max, S)
            want = float(F[1:, 0, dense.D].min())  # devices in the table's units
            assert got == want or (math.isinf(got) and math.isinf(want))
        B = rng.randint(1, 9)
        try:
            a = stage_dp(L, N, M, B, cost)
        except InterOpError:
            with pytest.raises(InterOpError):
                stage_dp(L, N, M, B, cost, max_stages=S + 1)
            continue
        assert a == stage_dp(L, N, M, B, cost, max_stages=S + 1)


def test_dp_rows_equal_eq_3_written_as_loops():
    """``_solve_f`` (runs of each width and sub-mesh size combined with blocks of rows) equals eq. 3
    written as plain loops over (s, k, d) and every (end, sub-mesh, option), bit for bit: at every
    t_max, with per-position memory limits, with ranges that have no option between allowed ones
    (holes in a run), and with max in place of + (``_bottlenecks``)."""
    import numpy as np

    from alpa_lab.passes import inter_op

    rng = random.Random(11)
    checked = 0
    for _ in range(30):
        L = rng.randint(1, 6)
        N, M = rng.choice(CLUSTERS)
        B = rng.randint(1, 6)
        base = random_cost(rng, 0.35)  # infeasible ranges leave holes inside the runs

        def cost(start, end, shape, logical, base=base, rng=random.Random(rng.random())):
            c = base(start, end, shape, logical)
            # integers times 1.37: ties stay, and sums are rounded, so an addition in another order would show
            return None if c is None else StageCost(round(c.time) * 1.37, max_in_flight=rng.choice([None, 1, 2, 3]))

        table = inter_op._profile(cost, L, submesh_shapes(N, M))
        if not table:
            continue
        dense = inter_op._Dense(table, L, N * M)
        S = min(L, dense.D) if dense.sizes else 0
        needs = [0] + [min(s, B) for s in range(1, S + 1)]
        times = sorted({opt.time for opts in table.values() for opt in opts.options})
        for t_max in [times[0], times[len(times) // 2], times[-1], math.inf]:
            for use_needs, combine, base_value in ((None, np.add, 0.0), (needs, np.add, 0.0), (needs, np.maximum, -math.inf)):
                want = np.full((S + 1, L + 1, dense.D + 1), np.inf)
                want[0, L, 0] = base_value
                for s in range(1, S + 1):
                    for (start, end, shape), opts in table.items():
                        size = shape[0] * shape[1]
                        if size % dense.unit or end > L - s + 1:
                            continue
                        opt = opts.best(None if use_needs is None else use_needs[s])
                        if opt is None or opt.time > t_max:
                            continue
                        u = size // dense.unit
                        for d in range(u, dense.D + 1):
                            value = combine(opt.time, want[s - 1, end, d - u])
                            want[s, start, d] = min(want[s, start, d], value)
                got = np.full_like(want, np.inf)
                got[0, L, 0] = base_value
                for s, row in inter_op._f_rows(dense, t_max, S, use_needs, combine, base_value):
                    got[s] = row
                assert np.array_equal(got, want), (L, N, M, t_max)
                checked += 1
    assert checked > 50


# --------------------------------------------------------------------------- #
# memory-aware DP (eq. 5): max_in_flight limits against in_flight(position)
# --------------------------------------------------------------------------- #


def one_f_one_b(B):
    return lambda s: min(s, B)


def gpipe(B):
    return lambda s: B


def eager_one_f_one_b(B):
    return lambda s: min(2 * s - 1, B)


def with_limits(rng: random.Random, base, B: int):
    """base's costs with a random max_in_flight per argument tuple (None, 0, or 1..B+1)."""
    limits: dict = {}

    def cost(start, end, shape, logical):
        c = base(start, end, shape, logical)
        if c is None:
            return None
        key = (start, end, shape, logical)
        if key not in limits:
            limits[key] = None if rng.random() < 0.25 else rng.randint(0, B + 1)
        return StageCost(c.time, c.memory, limits[key])

    return cost


def without_limits(cost):
    """cost with max_in_flight dropped (0, which never fits, becomes infeasible)."""

    def stripped(*args):
        c = cost(*args)
        if c is None or c.max_in_flight == 0:
            return None
        return StageCost(c.time, c.memory)

    return stripped


def check_positions(plan: InterOpPlan, cost, in_flight) -> None:
    """Each stage's (range, sub-mesh, logical mesh) holds its position's micro-batches."""
    S = len(plan.stages)
    for i, st in enumerate(plan.stages):
        c = cost(*st.layers, st.submesh_shape, st.logical_shape)
        assert c is not None and c.time == st.time
        assert c.max_in_flight != 0
        if in_flight is not None and c.max_in_flight is not None:
            assert c.max_in_flight >= in_flight(S - i), (i, S, c)


def test_memory_aware_dp_matches_brute_force():
    rng = random.Random(5_2022)
    outcomes: Counter = Counter()
    for trial in range(160):
        L = rng.randint(1, 5)
        N, M = rng.choice(CLUSTERS)
        B = rng.randint(1, 6)
        if trial % 2 == 0:
            base = random_cost(rng, p_none=rng.choice([0.0, 0.2, 0.5]))
        else:
            base = structured_cost(rng, L, mem_cap=rng.choice([None, 8.0]))
        cost = with_limits(rng, base, B)
        max_stages = rng.choice([None, None, None, 2, 3])
        for rule in (one_f_one_b(B), gpipe(B), eager_one_f_one_b(B)):
            calls: Counter = Counter()

            def counted(*args, calls=calls):
                calls[args] += 1
                return cost(*args)

            try:
                plan = stage_dp(L, N, M, B, counted, max_stages=max_stages, in_flight=rule)
            except InterOpError as err:
                plan, msg = None, str(err)
            try:
                ref = brute_force_stages(L, N, M, B, cost, max_stages=max_stages, in_flight=rule)
            except InterOpError:
                ref = None
            assert all(v == 1 for v in calls.values()), "stage_cost called twice for one tuple"
            assert (plan is None) == (ref is None), (trial, L, N, M, B)
            if plan is None:
                outcomes["memory message" if "device memory" in msg else "infeasible"] += 1
                continue
            outcomes["feasible"] += 1
            assert plan.total_time == pytest.approx(ref, rel=1e-9), (trial, L, N, M, B)
            check_plan(plan, L, N, M, B)
            check_positions(plan, cost, rule)
            if max_stages is not None:
                assert len(plan.stages) <= max_stages
            outcomes["multi-stage"] += len(plan.stages) > 1
            # the limits actually changed the answer somewhere
            try:
                free = brute_force_stages(L, N, M, B, without_limits(cost), max_stages=max_stages)
            except InterOpError:
                free = None
            if free is not None and ref > free * (1 + 1e-9):
                outcomes["limits bind"] += 1
    assert outcomes["feasible"] >= 150 and outcomes["multi-stage"] >= 40, outcomes
    assert outcomes["limits bind"] >= 30 and outcomes["memory message"] >= 5, outcomes


def test_in_flight_none_ignores_limits_except_zero():
    """in_flight=None: the plans of the existing random instances are unchanged, with or
    without max_in_flight (0 excepted, which never fits), and non-binding limits with an
    in_flight rule give the very same plans (fast path)."""
    for trial, L, N, M, B, base, max_stages in random_instances(20220711, 200):
        limited = with_limits(random.Random(trial), base, B)
        roomy = lambda *a, base=base, B=B: (  # noqa: E731
            None if (c := base(*a)) is None else StageCost(c.time, c.memory, max_in_flight=B)
        )
        plans = []
        for cost, in_flight in (
            (base, None),
            (without_limits(limited), None),
            (limited, None),
            (base, one_f_one_b(B)),
            (roomy, gpipe(B)),
        ):
            try:
                plans.append(stage_dp(L, N, M, B, cost, max_stages=max_stages, in_flight=in_flight))
            except InterOpError:
                plans.append(None)
        assert plans[0] == plans[3] == plans[4], trial
        assert plans[1] == plans[2], trial


def _memory_case(start, end, shape, logical):
    """2 layers on 1x2 devices. One layer per device is fastest but holds 1 micro-batch;
    both layers on both devices: logical (1, 2) is faster but holds 1, (2, 1) holds any."""
    if shape == (1, 1):
        return StageCost(1.0, max_in_flight=1) if end - start == 1 else None
    if end - start < 2:
        return None
    if logical == (1, 2):
        return StageCost(1.5, max_in_flight=1)
    return StageCost(1.8, max_in_flight=None)


def test_memory_limits_change_slicing_and_logical_shape():
    B = 4
    free = stage_dp(2, 1, 2, B, _memory_case)
    # unconstrained: two 1-device stages, 2 + 3 * 1 = 5 (the first holds 2 under 1F1B)
    assert [(st.layers, st.submesh_shape) for st in free.stages] == [((0, 1), (1, 1)), ((1, 2), (1, 1))]
    assert free.total_time == pytest.approx(5.0)
    with pytest.raises(AssertionError):
        check_positions(free, _memory_case, one_f_one_b(B))

    # 1F1B: a lone stage is at position 1 (1 in flight): the fast (1, 2) view fits
    plan = stage_dp(2, 1, 2, B, _memory_case, in_flight=one_f_one_b(B))
    assert [(st.layers, st.submesh_shape, st.logical_shape) for st in plan.stages] == [
        ((0, 2), (1, 2), (1, 2))
    ]
    assert plan.total_time == pytest.approx(4 * 1.5)
    check_positions(plan, _memory_case, one_f_one_b(B))

    # GPipe: all B in flight everywhere: only the slower (2, 1) view fits
    plan = stage_dp(2, 1, 2, B, _memory_case, in_flight=gpipe(B))
    assert [(st.logical_shape, st.time) for st in plan.stages] == [((2, 1), 1.8)]
    assert plan.total_time == pytest.approx(4 * 1.8)
    for rule, want in ((one_f_one_b(B), 6.0), (gpipe(B), 7.2), (None, 5.0)):
        assert brute_force_stages(2, 1, 2, B, _memory_case, in_flight=rule) == pytest.approx(want)

    # B = 1: one micro-batch in flight anywhere, so the fast (1, 2) view fits again
    for rule in (one_f_one_b(1), gpipe(1)):
        plan = stage_dp(2, 1, 2, 1, _memory_case, in_flight=rule)
        assert [st.logical_shape for st in plan.stages] == [(1, 2)]
        assert plan.total_time == pytest.approx(1.5)


def test_memory_infeasible_messages():
    # nothing holds 4 micro-batches: with GPipe(B=4) no slicing fits, memory is the reason
    small = lambda s, e, shape, lg: StageCost(1.0, max_in_flight=2)  # noqa: E731
    with pytest.raises(InterOpError, match="fits in device memory.*fewer micro-batches"):
        stage_dp(2, 1, 2, 4, small, in_flight=gpipe(4))
    with pytest.raises(InterOpError, match="no slicing"):
        brute_force_stages(2, 1, 2, 4, small, in_flight=gpipe(4))
    # 1F1B(4): two stages would put 2 in flight on the first, a lone stage holds 1: 4 * 1
    plan = stage_dp(2, 1, 2, 4, small, in_flight=one_f_one_b(4))
    assert plan.num_stages == 1 and plan.total_time == pytest.approx(4.0)
    # max_in_flight = 0 never fits, with or without in_flight
    zero = lambda s, e, shape, lg: StageCost(1.0, max_in_flight=0)  # noqa: E731
    for rule in (None, one_f_one_b(2)):
        with pytest.raises(InterOpError, match="device memory"):
            stage_dp(2, 1, 2, 2, zero, in_flight=rule)
        with pytest.raises(InterOpError, match="no slicing"):
            brute_force_stages(2, 1, 2, 2, zero, in_flight=rule)
    # not a memory problem: the old message stands
    only_one = lambda s, e, shape, lg: StageCost(1.0) if shape == (1, 1) else None  # noqa: E731
    with pytest.raises(InterOpError, match="exactly 8 devices"):
        stage_dp(4, 2, 4, 2, only_one, in_flight=gpipe(2))


def test_bad_in_flight_and_limits():
    with pytest.raises(InterOpError, match="in_flight must be callable"):
        stage_dp(2, 1, 2, 2, _compute_heavy, in_flight=3)  # type: ignore[arg-type]
    with pytest.raises(InterOpError, match=r"in_flight\(1\) must be >= 1"):
        stage_dp(2, 1, 2, 2, _compute_heavy, in_flight=lambda s: s - 1)
    with pytest.raises(InterOpError, match=r"in_flight\(2\) must be an int"):
        brute_force_stages(2, 1, 2, 2, _compute_heavy, in_flight=lambda s: 1 if s == 1 else 2.0)
    for bad in (-1, 1.5, True):
        with pytest.raises(InterOpError, match="max_in_flight"):
            stage_dp(2, 1, 2, 2, lambda *a, bad=bad: StageCost(1.0, max_in_flight=bad))


def test_variants_per_logical_mesh_match_brute_force():
    """stage_cost may offer several plans of one logical mesh (a fast one, a lean one); the DP
    picks, per position, the fastest that fits, and says which (StagePlan.variant)."""
    rng = random.Random(77)
    chosen_lean = 0
    for trial in range(120):
        L = rng.randint(1, 4)
        N, M = rng.choice(CLUSTERS)
        B = rng.randint(1, 6)
        base = with_limits(rng, random_cost(rng, p_none=0.2), B)
        lean: dict = {}

        def cost(start, end, shape, logical, base=base, lean=lean):
            c = base(start, end, shape, logical)
            if c is None:
                return None
            key = (start, end, shape, logical)
            if key not in lean:
                lean[key] = StageCost(c.time * rng.uniform(1.1, 3.0), c.memory, None if rng.random() < 0.5 else B + 1, "lean")
            return [dataclass_replace(c, variant="fast"), lean[key]]

        for rule in (one_f_one_b(B), gpipe(B)):
            try:
                plan = stage_dp(L, N, M, B, cost, in_flight=rule)
            except InterOpError:
                plan = None
            try:
                ref = brute_force_stages(L, N, M, B, cost, in_flight=rule)
            except InterOpError:
                ref = None
            assert (plan is None) == (ref is None), trial
            if plan is None:
                continue
            assert plan.total_time == pytest.approx(ref, rel=1e-9), trial
            S = len(plan.stages)
            for i, st in enumerate(plan.stages):
                options = {c.variant: c for c in cost(*st.layers, st.submesh_shape, st.logical_shape)}
                c = options[st.variant]
                assert c.time == st.time
                assert c.max_in_flight is None or c.max_in_flight >= rule(S - i)
                chosen_lean += st.variant == "lean"
    assert chosen_lean > 0


def test_one_capped_search_equals_the_dp_per_cap():
    """``stage_dp_capped`` (every cap from one search) gives ``stage_dp(max_stages=k)``'s optimum for every k, with and
    without memory limits (one search prunes per cap: the case where it could lose is a cap pruned too early)."""
    from alpa_lab.passes.inter_op import stage_dp_capped

    rng = random.Random(11_2026)
    compared = Counter()
    for trial in range(60):
        L = rng.randint(2, 7)
        N, M = rng.choice(CLUSTERS[1:] + [(2, 8), (4, 2)])
        B = rng.randint(1, 8)
        base = structured_cost(rng, L, mem_cap=rng.choice([None, 3.0])) if trial % 2 else random_cost(rng, 0.2)
        limited = trial % 3 == 0
        cost = with_limits(rng, base, B) if limited else base
        in_flight = one_f_one_b(B) if limited else None
        caps = [1, 2, 3, 4, 6]
        joint = stage_dp_capped(L, N, M, B, cost, caps, in_flight=in_flight)
        for k in caps:
            try:
                alone = stage_dp(L, N, M, B, cost, max_stages=k, in_flight=in_flight)
            except InterOpError:
                alone = None
            if k > min(L, N * M):
                continue
            if alone is None:
                assert k not in joint, (trial, k)
                compared["infeasible"] += 1
                continue
            assert joint[k].total_time == pytest.approx(alone.total_time, rel=1e-12), (trial, k)
            assert joint[k].num_stages <= k
            check_plan(joint[k], L, N, M, B)
            check_positions(joint[k], cost, in_flight)
            compared["limited" if limited else "plain"] += 1
    assert compared["plain"] > 50 and compared["limited"] > 20 and compared["infeasible"] > 0, compared


@pytest.mark.parametrize("caps, match", [([0, 2], "a stage cap must be >= 1, got 0"), ([1.5], "a stage cap must be an int")])
def test_capped_search_refuses_bad_caps(caps, match):
    from alpa_lab.passes.inter_op import stage_dp_capped

    with pytest.raises(InterOpError, match=match):
        stage_dp_capped(3, 1, 2, 4, _compute_heavy, caps)


def test_submesh_spaces_are_alpas():
    """``all`` is the paper's (1, 2^m) and (n, M) for n = 2..N; ``power_of_two`` and ``small_power_of_two``
    are Alpa's AutoStageOption spaces (host counts 2, 4, 8, ... <= N; 2 and 4 only)."""
    one_host = [(1, 1), (1, 2), (1, 4), (1, 8)]
    assert submesh_shapes(6, 8) == one_host + [(n, 8) for n in range(2, 7)]
    assert submesh_shapes(6, 8, "power_of_two") == one_host + [(2, 8), (4, 8)]
    assert submesh_shapes(128, 8, "power_of_two") == one_host + [(2**k, 8) for k in range(1, 8)]
    assert submesh_shapes(128, 8, "small_power_of_two") == one_host + [(2, 8), (4, 8)]
    assert submesh_shapes(1, 8, "power_of_two") == one_host
    for N in (1, 2):
        assert submesh_shapes(N, 4, "power_of_two") == submesh_shapes(N, 4)
    with pytest.raises(ValueError, match="unknown sub-mesh space 'pow2'.*power_of_two"):
        submesh_shapes(4, 8, "pow2")
    with pytest.raises(InterOpError, match="unknown sub-mesh space"):
        stage_dp(2, 3, 2, 2, lambda *a: StageCost(1.0), submesh_space="pow2")


def test_the_dp_over_a_smaller_sub_mesh_space_is_optimal_there_and_never_better_than_all():
    """On 3 and 5 hosts (where the spaces differ) the DP over ``power_of_two`` equals brute force over that
    space; it is never better than the DP over every host count, and its stages are power-of-two shapes
    that tile the cluster."""
    rng = random.Random(7)
    lost = 0
    for trial in range(24):
        L, N, M, B = rng.randint(2, 4), rng.choice([3, 5]), rng.choice([1, 2]), rng.randint(1, 6)
        cost = structured_cost(rng, L, mem_cap=None) if trial % 2 else random_cost(rng, p_none=0.2)
        try:
            plan = stage_dp(L, N, M, B, cost, submesh_space="power_of_two")
        except InterOpError:
            with pytest.raises(InterOpError):
                brute_force_stages(L, N, M, B, cost, submesh_space="power_of_two")
            continue
        ref = brute_force_stages(L, N, M, B, cost, submesh_space="power_of_two")
        assert plan.total_time == pytest.approx(ref, rel=1e-12)
        assert {st.submesh_shape for st in plan.stages} <= set(submesh_shapes(N, M, "power_of_two"))
        assert sorted(d for st in plan.stages for d in st.device_ids) == list(range(N * M))
        every = stage_dp(L, N, M, B, cost)
        assert every.total_time <= plan.total_time * (1 + 1e-12)
        lost += every.total_time < plan.total_time * (1 - 1e-9)
    assert lost  # the smaller space does lose on some instances: it is a search space, not a free speed-up


def test_counting_devices_in_units_of_the_smallest_feasible_sub_meshes_keeps_the_optimum():
    """Where no stage fits on fewer than u devices, the DP counts devices in units of the sizes' gcd
    (``_Dense.unit``; 8x smaller tables on 128 hosts of 8): equal to brute force, also where N*M is not a
    multiple of the unit (no slicing) and where one odd size brings the unit back to 1."""
    from alpa_lab.passes import inter_op

    rng = random.Random(11)
    units = set()
    for trial in range(40):
        N, M = rng.choice([(2, 4), (3, 2), (4, 2), (2, 2)])
        L, B = rng.randint(1, 4), rng.randint(1, 6)
        smallest = rng.choice([2, 4, 8])
        odd = rng.random() < 0.2  # one range feasible on a single device too
        base = structured_cost(rng, L, None)

        def cost(start, end, shape, logical, base=base, smallest=smallest, odd=odd):
            size = shape[0] * shape[1]
            if size < smallest and not (odd and size == 1 and (start, end) == (0, 1)):
                return None
            return base(start, end, shape, logical)

        table = inter_op._profile(cost, L, submesh_shapes(N, M))
        if table:
            units.add(inter_op._Dense(table, L, N * M).unit)
        plan, ref, _ = solve_both(L, N, M, B, cost)
        if ref is None:
            assert plan is None
            continue
        assert plan is not None and plan.total_time == pytest.approx(ref, rel=1e-12)
        check_plan(plan, L, N, M, B)
    assert {1, 2, 4} <= units


def test_uniform_optima_match_brute_force_over_one_shape():
    """stage_dp_uniform's plan for each sub-mesh shape is brute force's optimum over the plans
    whose stages all take that shape (the cost of every other shape hidden), with memory limits;
    shapes it leaves out have no such plan."""
    rng = random.Random(11_2023)
    outcomes: Counter = Counter()
    for trial in range(60):
        L = rng.randint(1, 5)
        N, M = rng.choice(CLUSTERS)
        B = rng.randint(1, 6)
        base = random_cost(rng, p_none=0.2) if trial % 2 else structured_cost(rng, L, mem_cap=rng.choice([None, 8.0]))
        cost = with_limits(rng, base, B)
        rule = rng.choice([one_f_one_b(B), gpipe(B), eager_one_f_one_b(B)])
        space = rng.choice(["all", "power_of_two"])
        found = stage_dp_uniform(L, N, M, B, cost, in_flight=rule, submesh_space=space)
        for shape in submesh_shapes(N, M, space):

            def only(start, end, s, logical, shape=shape):
                return cost(start, end, s, logical) if s == shape else None

            try:
                ref = brute_force_stages(L, N, M, B, only, in_flight=rule, submesh_space=space)
            except InterOpError:
                ref = None
            if ref is None:
                assert shape not in found, (trial, shape)
                continue
            plan = found[shape]
            outcomes["shape planned"] += 1
            outcomes["several stages"] += plan.num_stages > 1
            assert {st.submesh_shape for st in plan.stages} == {shape}
            assert plan.total_time == pytest.approx(ref, rel=1e-9), (trial, shape)
            check_plan(plan, L, N, M, B)
            check_positions(plan, cost, rule)
    assert outcomes["shape planned"] >= 40 and outcomes["several stages"] >= 15, outcomes


def _dense_instance(rng: random.Random):
    """A profiled table (integer times: ties are common) with random memory limits, its dense form and needs."""
    from alpa_lab.passes import inter_op

    L = rng.randint(2, 8)
    N, M = rng.choice(CLUSTERS[1:] + [(2, 8), (4, 2)])
    B = rng.choice([1, 1, 2, 3, 8])  # few micro-batches: the optimum is often far above the first feasible t_max
    base = random_cost(rng, rng.choice([0.0, 0.3])) if rng.random() < 0.5 else structured_cost(rng, L, None)

    def cost(start, end, shape, logical):
        c = base(start, end, shape, logical)
        return None if c is None else StageCost(float(round(c.time)))

    limited = with_limits(rng, cost, B)
    table = inter_op._profile(limited, L, submesh_shapes(N, M))
    dense = inter_op._Dense(table, L, N * M)
    S = min(L, dense.D)
    needs = inter_op._in_flight_needs(rng.choice([one_f_one_b(B), gpipe(B), eager_one_f_one_b(B)]), S)
    if not inter_op._limits_bind(table, needs):
        needs = None
    return table, dense, S, B, needs


def test_bottleneck_dp_gives_the_first_feasible_t_max_of_every_stage_count():
    """``_bottlenecks`` (one min-max DP) against scanning the t_max candidates with a full DP each."""
    from alpa_lab.passes import inter_op

    rng = random.Random(24_11)
    seen = Counter()
    for _ in range(60):
        table, dense, S, B, needs = _dense_instance(rng)
        if not dense.sizes:
            continue
        lowest = inter_op._bottlenecks(dense, S, needs)
        candidates = inter_op._tmax_candidates(table, needs)
        for s in range(1, S + 1):
            scan = next((t for t in candidates if math.isfinite(inter_op._solve_f(dense, t, S, needs)[s, 0, dense.D])), math.inf)
            assert lowest[s] == scan, (s, lowest, scan)
            seen["feasible" if math.isfinite(scan) else "infeasible"] += 1
    assert seen["feasible"] > 40 and seen["infeasible"] > 10, seen


def test_branch_and_bound_over_t_max_equals_scanning_every_candidate():
    """``_least_latency`` skips t_max values by bounds; where it could lose (ties, memory limits, stage caps)
    it must give the scan's optimum and the scan's (smallest) t_max."""
    from alpa_lab.passes import inter_op

    rng = random.Random(23_11)
    seen = Counter()
    for _ in range(80):
        table, dense, S, B, needs = _dense_instance(rng)
        if not dense.sizes:
            continue
        candidates = inter_op._tmax_candidates(table, needs)
        rows = [inter_op._solve_f(dense, t, S, needs)[:, 0, dense.D] for t in candidates]
        every = inter_op._solve_f(dense, math.inf, S, needs)[:, 0, dense.D]
        lowest = inter_op._bottlenecks(dense, S, needs)
        totals: dict = {}
        for k in sorted(range(1, S + 1), reverse=True):
            floor = float(every[1 : k + 1].min())
            if math.isinf(floor):
                continue
            first = bisect.bisect_left(candidates, float(lowest[1 : k + 1].min()))
            scan = min((float(rows[i][1 : k + 1].min()) + (B - 1) * t, i) for i, t in enumerate(candidates))
            got = inter_op._least_latency(
                candidates, first, floor, B, k, totals, lambda t, k=k: inter_op._totals(dense, t, k, needs)
            )
            assert got == scan, (k, got, scan)
            seen["ties"] += sum(float(r[1 : k + 1].min()) + (B - 1) * t == scan[0] for r, t in zip(rows, candidates)) > 1
            seen["compared"] += 1
        seen["evaluated"] += len(totals)
        seen["candidates"] += len(candidates)
    assert seen["compared"] > 100 and seen["ties"] > 5, seen


def test_no_slicing_when_the_cluster_is_not_a_multiple_of_the_feasible_sub_meshes():
    """3 devices, stages only on 2: the device unit (2) does not divide the cluster, so the dense tables are empty."""
    from alpa_lab.passes.inter_op import stage_dp_capped

    def cost(start, end, shape, logical):
        return StageCost(1.0) if shape[0] * shape[1] == 2 else None

    with pytest.raises(InterOpError, match="none combine into contiguous stages"):
        stage_dp(2, 1, 3, 2, cost)
    with pytest.raises(InterOpError):
        stage_dp(2, 1, 3, 2, cost, in_flight=one_f_one_b(2))
    assert stage_dp_capped(2, 1, 3, 2, cost, [1, 2]) == {}


def test_options_given_over_whole_ranges_profile_as_asked_one_range_at_a_time():
    """``RangeCosts`` (every range of a mesh at once) against the same random costs asked per range: the same
    table, with several plans per logical mesh, ties, limits of 0 (dropped and counted) and no limit."""
    from alpa_lab.passes import inter_op

    rng = random.Random(5)
    for _ in range(25):
        L = rng.randint(1, 6)
        N, M = rng.choice(CLUSTERS)
        variants = ["", "saver"][: rng.randint(1, 2)]
        plans = {}  # (shape, logical) -> [(time, limit) arrays per variant]
        for shape in submesh_shapes(N, M):
            for logical in inter_op.logical_shapes(shape):
                plans[shape, logical] = []
                for _ in variants:
                    time = np.array([[float(rng.randint(1, 4)) if rng.random() > 0.3 else np.nan for _ in range(L + 1)]
                                     for _ in range(L + 1)])
                    limit = np.array([[rng.choice([-1, 0, 1, 2, 3]) for _ in range(L + 1)] for _ in range(L + 1)])
                    plans[shape, logical].append((time, limit))

        def cost(start, end, shape, logical):
            return [StageCost(float(t[start, end]), max_in_flight=None if m[start, end] < 0 else int(m[start, end]), variant=v)
                    for (t, m), v in zip(plans[shape, logical], variants) if not np.isnan(t[start, end])]

        def range_costs(shape, logical):
            return [RangeCosts(t, m, v) for (t, m), v in zip(plans[shape, logical], variants)]

        slow_stats, fast_stats = {}, {}
        slow = inter_op._profile(cost, L, submesh_shapes(N, M), slow_stats)
        fast = inter_op._profile(cost, L, submesh_shapes(N, M), fast_stats, range_costs)
        assert list(fast) == list(slow) and fast_stats == slow_stats
        assert all(fast[k].options == slow[k].options for k in slow)


@pytest.mark.parametrize("bad, match", [
    (lambda L: RangeCosts(np.ones((L, L)), np.zeros((L, L), dtype=int)), r"must be \(4, 4\)"),
    (lambda L: RangeCosts(-np.ones((L + 1, L + 1)), -np.ones((L + 1, L + 1), dtype=int)), r"time -1.0 for layers \[0, 1\)"),
    (lambda L: RangeCosts(np.full((L + 1, L + 1), np.inf), -np.ones((L + 1, L + 1), dtype=int)), "finite"),
    (lambda L: RangeCosts(np.ones((L + 1, L + 1)), np.ones((L + 1, L + 1)) * 0.5), "must be integers"),
    (lambda L: RangeCosts(np.ones((L + 1, L + 1)), np.full((L + 1, L + 1), -2)), "below -1"),
    (lambda L: StageCost(1.0), "must give RangeCosts"),
])
def test_bad_range_costs_are_refused_with_what_was_wrong(bad, match):
    L = 3
    with pytest.raises(InterOpError, match=match):
        profile_stage_options(L, 1, 2, lambda *a: StageCost(1.0), {}, range_costs=lambda shape, logical: [bad(L)])
