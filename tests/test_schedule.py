"""Pipeline schedules: completeness, deadlock-freedom, in-flight memory and clock counts."""

from __future__ import annotations

import dataclasses
import itertools

import pytest

from alpa_lab.passes.schedule import (
    BACKWARD,
    FORWARD,
    Instruction,
    Schedule,
    ScheduleError,
    check,
    eager_one_f_one_b,
    gpipe,
    make_schedule,
    one_f_one_b,
    simulate,
)

NAMES = ("gpipe", "1f1b", "eager_1f1b")
GRID = [(s, m) for s in range(1, 7) for m in range(1, 11)]


@pytest.mark.parametrize("name", NAMES)
def test_all_schedules_check_and_respect_dependencies(name):
    for S, M in GRID:
        sched = make_schedule(name, S, M)
        report = check(sched)
        assert report.num_stages == S and report.num_microbatches == M
        tl = simulate(sched, 1.0, 2.0, 0.5)
        runs = [r for r in tl.records if r.kind == "RUN"]
        keys = [(r.stage, r.phase, r.microbatch) for r in runs]
        assert len(keys) == len(set(keys)) == 2 * S * M
        for s in range(S):
            for m in range(M):
                f = tl.run(s, FORWARD, m)
                b = tl.run(s, BACKWARD, m)
                assert b.start >= f.end
                if s > 0:
                    assert f.start >= tl.run(s - 1, FORWARD, m).end + 0.5
                if s < S - 1:
                    assert b.start >= tl.run(s + 1, BACKWARD, m).end + 0.5
        # a stage never runs two things at once
        for s in range(S):
            rs = [r for r in runs if r.stage == s]
            assert all(a.end <= b.start for a, b in itertools.pairwise(rs))


def test_peak_in_flight():
    for S, M in GRID:
        assert check(one_f_one_b(S, M)).peak_in_flight == tuple(min(S - i, M) for i in range(S))
        assert check(gpipe(S, M)).peak_in_flight == (M,) * S
        rep = check(eager_one_f_one_b(S, M))
        # stage i (1-based) runs min(2(S-i)+1, M) forwards before its first backward
        assert rep.warmup_forwards == tuple(min(2 * (S - i) + 1, M) for i in range(1, S + 1))
        assert rep.peak_in_flight == rep.warmup_forwards
        assert check(one_f_one_b(S, M)).warmup_forwards == tuple(min(S - i, M) for i in range(S))


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_clock_counts_and_bubble(name):
    for S, M in GRID:
        sched = make_schedule(name, S, M)
        assert simulate(sched, 1.0, 1.0).makespan == pytest.approx(2 * (M + S - 1))
        tl = simulate(sched, 1.0, 2.0)
        assert tl.makespan == pytest.approx(3 * (M + S - 1))
        assert tl.bubble_fraction == pytest.approx((S - 1) / (M + S - 1))
        rep = check(sched)
        assert rep.clock_count == pytest.approx(3 * (M + S - 1))
        assert rep.bubble_fraction == pytest.approx((S - 1) / (M + S - 1))


def test_eager_never_slower_than_1f1b_with_transfer():
    for S, M in GRID:
        eager = simulate(eager_one_f_one_b(S, M), 1.0, 2.0, 0.5).makespan
        assert eager <= simulate(one_f_one_b(S, M), 1.0, 2.0, 0.5).makespan + 1e-9


def test_per_stage_times():
    tl = simulate(gpipe(2, 1), [1.0, 3.0], [2.0, 6.0])
    assert tl.makespan == pytest.approx(1 + 3 + 6 + 2)
    with pytest.raises(ValueError, match="3 entries for 2 stages"):
        simulate(gpipe(2, 1), [1.0, 1.0, 1.0])
    with pytest.raises(ValueError, match="transfer_time"):
        simulate(gpipe(2, 1), transfer_time=-1.0)


def _replace_stage(sched: Schedule, stage: int, prog) -> Schedule:
    lists = list(sched.instructions)
    lists[stage] = tuple(prog)
    return dataclasses.replace(sched, instructions=tuple(lists))


def test_swapped_recv_order_deadlocks():
    sched = one_f_one_b(2, 3)
    prog = list(sched.instructions[1])
    recv = [i for i, ins in enumerate(prog) if ins.kind == "RECV" and ins.phase == FORWARD]
    a, b = recv[0], recv[2]  # receive micro-batch 2 first: it is only sent after backward 0
    prog[a], prog[b] = prog[b], prog[a]
    bad = _replace_stage(sched, 1, prog)
    with pytest.raises(ScheduleError, match=r"deadlocks: stuck stages \[0, 1\]") as e:
        check(bad)
    msg = str(e.value)
    assert "stage 0 waits at RECV backward mb 0" in msg
    assert "stage 1 waits at RECV forward mb 2" in msg
    with pytest.raises(ScheduleError, match="deadlocks"):
        simulate(bad)


def test_recv_order_mismatch_without_deadlock():
    sched = gpipe(2, 2)
    prog = [i for i in sched.instructions[1] if not (i.kind == "RECV" and i.phase == FORWARD)]
    prog = [Instruction("RECV", 1, 1, FORWARD, 0), Instruction("RECV", 1, 0, FORWARD, 0)] + prog
    bad = _replace_stage(sched, 1, prog)
    simulate(bad)  # runs fine when messages are matched by tag...
    with pytest.raises(ScheduleError, match="order must match"):
        check(bad)  # ...but in-order transport would mismatch


def test_missing_backward_is_named():
    sched = one_f_one_b(3, 4)
    prog = [i for i in sched.instructions[1]
            if not (i.phase == BACKWARD and i.microbatch == 2 and i.kind in ("RUN", "FREE"))]
    with pytest.raises(ScheduleError, match=r"missing backward of \(stage 1, micro-batch 2\)"):
        check(_replace_stage(sched, 1, prog))


def test_other_structural_errors():
    sched = gpipe(2, 2)
    prog = [i for i in sched.instructions[0] if not (i.kind == "SEND" and i.microbatch == 1)]
    with pytest.raises(ScheduleError, match=r"stage 0 -> stage 1.*unmatched.*\('forward', 1\)"):
        check(_replace_stage(sched, 0, prog))
    prog = list(sched.instructions[0])
    prog[0], prog[1] = prog[1], prog[0]  # SEND before RUN
    with pytest.raises(ScheduleError, match="before the RUN"):
        check(_replace_stage(sched, 0, prog))
    one = gpipe(1, 1)  # RUN f0, RUN b0, FREE 0 -> RUN b0, RUN f0, FREE 0
    prog = list(one.instructions[0])
    prog[0], prog[1] = prog[1], prog[0]
    with pytest.raises(ScheduleError, match="backward of micro-batch 0 before its forward"):
        check(_replace_stage(one, 0, prog))
    prog = list(one.instructions[0])
    prog[1], prog[2] = prog[2], prog[1]
    with pytest.raises(ScheduleError, match="frees activations before the backward"):
        check(_replace_stage(one, 0, prog))
    with pytest.raises(ScheduleError, match="RUN forward of micro-batch 0 2 times"):
        check(_replace_stage(one, 0, (prog[0],) + tuple(one.instructions[0])))
    bad_peer = _replace_stage(sched, 0, [Instruction("RECV", 0, 0, FORWARD, 1)] + list(sched.instructions[0]))
    with pytest.raises(ScheduleError, match="must pair with stage -1 \\(no such stage\\)"):
        check(bad_peer)


def test_bad_arguments():
    with pytest.raises(ValueError, match="unknown pipeline schedule 'zb'.*1f1b, eager_1f1b, gpipe"):
        make_schedule("zb", 2, 2)
    with pytest.raises(ValueError, match="num_stages must be >= 1"):
        make_schedule("gpipe", 0, 2)
    with pytest.raises(ValueError, match="num_microbatches must be >= 1"):
        make_schedule("1f1b", 2, 0)
    with pytest.raises(ValueError, match="num_microbatches must be an int"):
        eager_one_f_one_b(2, 2.5)
    with pytest.raises(ValueError, match="unknown instruction kind"):
        Instruction("JUMP", 0, 0, FORWARD)
    with pytest.raises(ValueError, match="unknown phase"):
        Instruction("RUN", 0, 0, "sideways")
