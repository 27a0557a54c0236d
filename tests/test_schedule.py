"""Pipeline schedules: completeness, deadlock-freedom, in-flight memory and clock counts."""

from __future__ import annotations

import dataclasses
import itertools
import math

import pytest

from alpa_lab.passes.schedule import (
    BACKWARD,
    BACKWARD_INPUT,
    BACKWARD_WEIGHT,
    FORWARD,
    PHASES,
    Instruction,
    Schedule,
    ScheduleError,
    WARMUP_SCHEDULES,
    check,
    eager_one_f_one_b,
    gpipe,
    interleaved_one_f_one_b,
    make_schedule,
    one_f_one_b,
    one_f_one_b_estimate,
    one_f_one_b_windows,
    simulate,
    zb_h1,
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


def test_per_boundary_transfer_times():
    """Each boundary's SENDs take its own link's time: one micro-batch through 3 stages crosses
    boundary 0 and 1 forward, then 1 and 0 back (a sum we can write down)."""
    F, B, t = [1.0, 2.0, 3.0], [2.0, 4.0, 6.0], [0.25, 5.0]
    for name in NAMES:
        tl = simulate(make_schedule(name, 3, 1), F, B, t)
        assert tl.makespan == pytest.approx(sum(F) + sum(B) + 2 * sum(t))
        assert tl.transfer_times == (0.25, 5.0) and tl.transfer_time == 5.0
        assert (tl.link_time(0), tl.link_time(1)) == (0.25, 5.0)
    # one time per boundary equals the scalar form when they are all equal, on every schedule
    for name, (S, M) in itertools.product(NAMES, GRID[::7]):
        same = simulate(make_schedule(name, S, M), 1.0, 2.0, [0.5] * (S - 1))
        assert same.makespan == pytest.approx(simulate(make_schedule(name, S, M), 1.0, 2.0, 0.5).makespan)
    # a slow link costs more than a fast one at the same place; at steady state 1F1B pays it every micro-batch
    slow_first = simulate(one_f_one_b(3, 8), 1.0, 2.0, [3.0, 0.0]).makespan
    assert slow_first > simulate(one_f_one_b(3, 8), 1.0, 2.0, [0.0, 0.0]).makespan
    with pytest.raises(ValueError, match="1 entries for the 2 boundaries of 3 stages"):
        simulate(gpipe(3, 1), transfer_time=[1.0])
    with pytest.raises(ValueError, match="transfer_time must be finite"):
        simulate(gpipe(3, 1), transfer_time=[1.0, float("nan")])


def test_the_1f1b_estimate_follows_the_simulation_with_many_microbatches():
    """``one_f_one_b_estimate`` against ``simulate`` on random stage and link times: within 3% at B = 16 S,
    5% at B = 8 S (the fill is estimated, not simulated), and exact for one stage."""
    import random

    rng = random.Random(2026)
    worst = {8: 0.0, 16: 0.0}
    for _ in range(200):
        S, k = rng.randint(1, 10), rng.choice([8, 16])
        F = [rng.uniform(0.1, 2.0) for _ in range(S)]
        Bk = [f * rng.uniform(1.5, 3.0) for f in F]
        links = [rng.choice([0.0, rng.uniform(0, 0.2), rng.uniform(0, 3.0)]) for _ in range(S - 1)]
        sim = simulate(one_f_one_b(S, S * k), F, Bk, links).makespan
        est = one_f_one_b_estimate([f + b for f, b in zip(F, Bk)], links, S * k)
        worst[k] = max(worst[k], abs(est / sim - 1))
        if S == 1:
            assert est == pytest.approx(sim, rel=1e-12)
    assert worst[16] < 0.03 and worst[8] < 0.05, worst
    # the windows: one stage alone is its own time; two stages and their link
    w = one_f_one_b_windows([1.0, 3.0], [0.5])
    assert sorted(w) == pytest.approx([1.0, 2.5, 3.0])
    with pytest.raises(ValueError, match="2 transfer times for the 1 boundaries of 2 stages"):
        one_f_one_b_windows([1.0, 3.0], [0.5, 0.5])


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
    with pytest.raises(ValueError, match="unknown instruction kind"):
        Instruction(["RUN"], 0, 0, FORWARD)  # unhashable: the same error, not a TypeError
    with pytest.raises(ValueError, match="RUN takes no peer"):
        Instruction("RUN", 0, 0, FORWARD, 1)


# ---------------------------------------------------------------------------------------
# Interleaved 1F1B (Megatron-LM, SC'21): S = P v virtual stages, stage s on mesh s % P
# ---------------------------------------------------------------------------------------

# P meshes, v chunks per mesh, M a multiple of P up to 12
INTERLEAVED_GRID = [(P, v, M) for P in range(1, 5) for v in range(1, 4) for M in range(P, 13, P)]


def _interleaved(P: int, v: int, M: int) -> Schedule:
    return make_schedule("interleaved_1f1b", P * v, M, num_meshes=P)


def test_interleaved_checks_and_respects_dependencies():
    xfer = 0.5
    for P, v, M in INTERLEAVED_GRID:
        S = P * v
        sched = _interleaved(P, v, M)
        assert sched.num_meshes == P and sched.mesh_of_stage == tuple(s % P for s in range(S))
        assert all(sched.stages_of(p) == tuple(range(p, S, P)) for p in range(P))
        rep = check(sched)
        assert (rep.num_stages, rep.num_microbatches, rep.num_meshes) == (S, M, P)
        tl = simulate(sched, 1.0, 2.0, xfer)
        runs = [r for r in tl.records if r.kind == "RUN"]
        keys = [(r.stage, r.phase, r.microbatch) for r in runs]
        assert len(keys) == len(set(keys)) == 2 * S * M  # every (stage, phase, mb) exactly once
        assert all(r.mesh == r.stage % P for r in tl.records)
        for s in range(S):
            for m in range(M):
                f, b = tl.run(s, FORWARD, m), tl.run(s, BACKWARD, m)
                assert b.start >= f.end
                # a hand-over between meshes pays the transfer, one within a mesh does not
                if s > 0:
                    assert f.start >= tl.run(s - 1, FORWARD, m).end + (xfer if P > 1 else 0.0)
                if s < S - 1:
                    assert b.start >= tl.run(s + 1, BACKWARD, m).end + (xfer if P > 1 else 0.0)
        for p in range(P):  # a mesh runs one thing at a time, across all its chunks
            rs = [r for r in runs if r.mesh == p]
            assert len(rs) == 2 * v * M
            assert all(a.end <= b.start for a, b in itertools.pairwise(rs))
        if P == 1:  # all chunks on one mesh: nothing to send
            assert all(i.kind in ("RUN", "FREE") for i in sched.instructions[0])


def test_interleaved_clock_count_and_bubble_shrink_by_v():
    """Chunk times f = 1, b = 2, no transfer: makespan (M v + P - 1)(f + b).

    Against 1F1B on the same P meshes doing the same work (each mesh-stage is v chunks:
    F = v f, B = v b), whose makespan is (M + P - 1)(F + B): the work M v (f + b) per
    mesh is the same, the bubble time drops from (P - 1)(F + B) to (P - 1)(f + b), a
    factor v, as Megatron-LM claims.
    """
    for P, v, M in INTERLEAVED_GRID:
        sched = _interleaved(P, v, M)
        tl = simulate(sched, 1.0, 2.0)
        assert tl.makespan == pytest.approx(3 * (M * v + P - 1))
        assert tl.bubble_fraction == pytest.approx((P - 1) / (M * v + P - 1))
        assert tl.mesh_bubble_fractions == pytest.approx([(P - 1) / (M * v + P - 1)] * P)
        assert check(sched).clock_count == pytest.approx(3 * (M * v + P - 1))
        base = simulate(one_f_one_b(P, M), float(v), 2.0 * v)
        work = M * v * 3
        assert base.makespan == pytest.approx(3 * v * (M + P - 1))
        assert base.makespan - work == pytest.approx(v * (tl.makespan - work))
        if P > 1 and v > 1:
            assert tl.bubble_fraction < base.bubble_fraction - 1e-9
        else:
            assert tl.bubble_fraction == pytest.approx(base.bubble_fraction)


def test_interleaved_warmup_and_memory_follow_megatron():
    """Mesh p runs (v - 1) P + 2 (P - p - 1) warm-up forwards, then one more before its
    first backward (all M v forwards when M = P); that is also its peak in-flight chunks."""
    for P, v, M in INTERLEAVED_GRID:
        rep = check(_interleaved(P, v, M))
        expect = tuple(
            M * v if M == P else min((v - 1) * P + 2 * (P - p - 1) + 1, M * v) for p in range(P)
        )
        assert rep.mesh_warmup_forwards == expect
        assert rep.mesh_peak_in_flight == expect
        assert len(rep.peak_in_flight) == P * v
        assert rep.peak_unfreed == rep.peak_in_flight  # fused backward: FREE right after it
        assert rep.mesh_peak_unfreed == rep.mesh_peak_in_flight


def test_interleaved_program_order_per_mesh():
    sched = interleaved_one_f_one_b(4, 4, 2)  # P = 2, v = 2
    # Megatron's order: groups of P micro-batches through chunk 0 then chunk 1
    fwd0 = [(s, m) for s, ph, m in sched.mesh_runs(0) if ph == FORWARD]
    assert fwd0 == [(0, 0), (0, 1), (2, 0), (2, 1), (0, 2), (0, 3), (2, 2), (2, 3)]
    bwd0 = [(s, m) for s, ph, m in sched.mesh_runs(0) if ph == BACKWARD]
    assert bwd0 == [(2, 0), (2, 1), (0, 0), (0, 1), (2, 2), (2, 3), (0, 2), (0, 3)]
    assert sched.runs(2) == tuple((ph, m) for s, ph, m in sched.mesh_runs(0) if s == 2)


def test_interleaved_arguments():
    with pytest.raises(ScheduleError, match="num_stages 6 must be a multiple of num_meshes 4"):
        make_schedule("interleaved_1f1b", 6, 4, num_meshes=4)
    with pytest.raises(ValueError, match="num_microbatches 5 must be a multiple of num_meshes 3"):
        make_schedule("interleaved_1f1b", 6, 5, num_meshes=3)
    with pytest.raises(ValueError, match="needs num_meshes"):
        make_schedule("interleaved_1f1b", 4, 4)
    with pytest.raises(ValueError, match="num_meshes must be an int"):
        interleaved_one_f_one_b(4, 4, 2.0)
    with pytest.raises(ValueError, match="one stage per mesh: num_meshes must be 4 or None"):
        make_schedule("1f1b", 4, 4, num_meshes=2)
    assert make_schedule("zb_h1", 4, 4, num_meshes=4) == zb_h1(4, 4)
    prog = ((Instruction("RUN", 0, 0, FORWARD),),)
    with pytest.raises(ValueError, match="mesh_of_stage has 1 entries for 2 stages"):
        Schedule("x", 2, 1, prog, (0,))
    with pytest.raises(ValueError, match="must name meshes 0..0"):
        Schedule("x", 2, 1, prog, (0, 1))
    with pytest.raises(ValueError, match=r"meshes \[1\] run no stage"):
        Schedule("x", 2, 1, prog + ((),), (0, 0))


def _replace_mesh(sched: Schedule, mesh: int, prog) -> Schedule:
    lists = list(sched.instructions)
    lists[mesh] = tuple(prog)
    return dataclasses.replace(sched, instructions=tuple(lists))


def test_interleaved_structural_errors():
    one = interleaved_one_f_one_b(2, 2, 1)  # two chunks on one mesh: hand-over in memory
    prog = list(one.instructions[0])
    i = prog.index(Instruction("RUN", 0, 0, FORWARD))
    j = prog.index(Instruction("RUN", 1, 0, FORWARD))
    prog[i], prog[j] = prog[j], prog[i]
    bad = _replace_mesh(one, 0, prog)
    with pytest.raises(ScheduleError, match=r"mesh 0 runs forward of \(stage 1, micro-batch 0\) before"):
        check(bad)
    with pytest.raises(ScheduleError, match=r"deadlocks: stuck meshes \[0\]: mesh 0 waits at RUN forward mb 0 on stage 1"):
        simulate(bad)
    prog = list(one.instructions[0]) + [Instruction("SEND", 0, 0, FORWARD, 1)]
    with pytest.raises(ScheduleError, match="stages 0 and 1 share mesh 0"):
        check(_replace_mesh(one, 0, prog))
    two = interleaved_one_f_one_b(4, 2, 2)
    with pytest.raises(ScheduleError, match="is in mesh 1's list"):
        check(_replace_mesh(two, 1, [Instruction("RUN", 0, 0, FORWARD)] + list(two.instructions[1])))
    # both chunk boundaries 0->1 and 2->3 ride the channel mesh 0 -> mesh 1: receiving
    # stage 3's activation before stage 1's works when matched by tag, not in order
    prog = list(two.instructions[1])
    a = prog.index(Instruction("RECV", 1, 1, FORWARD, 0))
    b = prog.index(Instruction("RECV", 3, 0, FORWARD, 2))
    prog.insert(a, prog.pop(b))
    bad = _replace_mesh(two, 1, prog)
    simulate(bad)
    with pytest.raises(ScheduleError, match="channel mesh 0 -> mesh 1: message #1.*order must match"):
        check(bad)


# ---------------------------------------------------------------------------------------
# ZB-H1 (Zero Bubble Pipeline Parallelism, ICLR'24): backward split into B and W
# ---------------------------------------------------------------------------------------


def test_zb_h1_checks_and_respects_dependencies():
    xfer = 0.5
    for S, M in GRID:
        sched = make_schedule("zb_h1", S, M)
        assert sched.split_backward
        rep = check(sched)
        assert rep.num_stages == S and rep.num_microbatches == M
        tl = simulate(sched, 1.0, 2.0, xfer)  # B = W = 1
        runs = [r for r in tl.records if r.kind == "RUN"]
        keys = [(r.stage, r.phase, r.microbatch) for r in runs]
        assert len(keys) == len(set(keys)) == 3 * S * M
        assert {k[1] for k in keys} == {FORWARD, BACKWARD_INPUT, BACKWARD_WEIGHT}
        for s in range(S):
            prog = sched.instructions[s]
            for m in range(M):
                f = tl.run(s, FORWARD, m)
                b = tl.run(s, BACKWARD_INPUT, m)
                w = tl.run(s, BACKWARD_WEIGHT, m)
                assert f.end <= b.start and b.end <= w.start
                if s > 0:
                    assert f.start >= tl.run(s - 1, FORWARD, m).end + xfer
                    # the gradient goes out right after B, before W
                    send = prog.index(Instruction("SEND", s, m, BACKWARD_INPUT, s - 1))
                    assert prog[send - 1] == Instruction("RUN", s, m, BACKWARD_INPUT)
                if s < S - 1:
                    assert b.start >= tl.run(s + 1, BACKWARD_INPUT, m).end + xfer
                free = prog.index(Instruction("FREE", s, m, BACKWARD_WEIGHT))
                assert prog[free - 1] == Instruction("RUN", s, m, BACKWARD_WEIGHT)
            rs = [r for r in runs if r.stage == s]
            assert all(a.end <= b.start for a, b in itertools.pairwise(rs))


def test_zb_h1_memory_matches_1f1b():
    """F and B run in 1F1B's order, so the full forward stash is bounded as in 1F1B; the
    deferred Ws keep at most min(S, M) micro-batches unfreed, 1F1B's first-stage peak."""
    for S, M in GRID:
        rep = check(zb_h1(S, M))
        base = check(one_f_one_b(S, M))
        assert rep.peak_in_flight == base.peak_in_flight == tuple(min(S - i, M) for i in range(S))
        assert rep.warmup_forwards == base.warmup_forwards
        assert rep.peak_unfreed == rep.mesh_peak_unfreed == (min(S, M),) * S
        assert max(rep.peak_unfreed) <= max(base.peak_unfreed)


def test_zb_h1_clock_count():
    """F = B = W = 1, no transfer: makespan 2 M + S - 1 + max(M, S), i.e. 3 M + S - 1 for
    M >= S: bubble S - 1 per stage, the paper's (S - 1)(F + B - W), against 1F1B's
    3 (M + S - 1) with a fused backward of 2."""
    for S, M in GRID:
        sched = zb_h1(S, M)
        tl = simulate(sched, 1.0, 1.0, weight_time=1.0)
        assert tl.makespan == pytest.approx(2 * M + S - 1 + max(M, S))
        assert simulate(sched, 1.0, 2.0).makespan == pytest.approx(tl.makespan)  # None: split evenly
        assert check(sched).clock_count == pytest.approx(tl.makespan)
        one_f1b = simulate(one_f_one_b(S, M), 1.0, 2.0).makespan
        assert one_f1b == pytest.approx(simulate(one_f_one_b(S, M), 1.0, 1.0, weight_time=1.0).makespan)
        if S > 1:
            assert tl.makespan < one_f1b
        else:
            assert tl.makespan == pytest.approx(one_f1b)
        if M >= S:
            assert tl.makespan == pytest.approx(3 * M + S - 1)
            assert tl.bubble_fraction == pytest.approx((S - 1) / (3 * M + S - 1))
            assert tl.mesh_bubble_fractions == pytest.approx([(S - 1) / (3 * M + S - 1)] * S)


@pytest.mark.parametrize("F,B,W", [(1.0, 2.0, 1.0), (2.0, 1.0, 1.0), (3.0, 2.0, 1.0), (1.0, 1.0, 0.5), (2.0, 3.0, 1.5)])
def test_zb_h1_general_times(F, B, W):
    """With W <= min(F, B) and M >= S the makespan is M (F + B + W) + (S - 1)(F + B - W)."""
    for S, M in GRID:
        if M >= S:
            tl = simulate(zb_h1(S, M), F, B, weight_time=W)
            assert tl.makespan == pytest.approx(M * (F + B + W) + (S - 1) * (F + B - W))


def test_zb_h1_structural_errors():
    assert PHASES == (FORWARD, BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT)
    sched = zb_h1(1, 2)
    prog = list(sched.instructions[0])
    b0 = prog.index(Instruction("RUN", 0, 0, BACKWARD_INPUT))
    w0 = prog.index(Instruction("RUN", 0, 0, BACKWARD_WEIGHT))
    swapped = list(prog)
    swapped[b0], swapped[w0] = swapped[w0], swapped[b0]
    with pytest.raises(ScheduleError, match="runs the W of micro-batch 0 before its B"):
        check(_replace_stage(sched, 0, swapped))
    swapped = list(prog)
    swapped[w0], swapped[w0 + 1] = swapped[w0 + 1], swapped[w0]  # FREE before W
    with pytest.raises(ScheduleError, match="frees activations before the backward_weight"):
        check(_replace_stage(sched, 0, swapped))
    dropped = [i for i in prog if not (i.phase == BACKWARD_WEIGHT and i.microbatch == 1)]
    with pytest.raises(ScheduleError, match=r"missing backward_weight of \(stage 0, micro-batch 1\)"):
        check(_replace_stage(sched, 0, dropped))
    mixed = [*prog, Instruction("RUN", 0, 1, BACKWARD)]
    with pytest.raises(ScheduleError, match="backward is split into B and W"):
        check(_replace_stage(sched, 0, mixed))
    with pytest.raises(ValueError, match="weight_time has 1 entries for 2 stages"):
        simulate(zb_h1(2, 2), weight_time=[1.0])


def test_schedule_names_a_plan_may_carry_are_the_schedules_built():
    """``plan.timeline.SCHEDULE_NAMES`` (what a saved pipeline plan's ``schedule`` may be, below the
    passes) lists the schedules ``SCHEDULES`` builds; ``Timeline`` is the plan's, re-exported here."""
    from alpa_lab import plan
    from alpa_lab.passes import schedule

    assert tuple(schedule.SCHEDULES) == plan.SCHEDULE_NAMES
    assert schedule.Timeline is plan.Timeline and schedule.TimelineRecord is plan.TimelineRecord


def _ready(rec, by_key, mesh_of, link, S):
    """When ``rec``'s inputs exist, from the other records alone (the definitions in ``simulate``'s docstring)."""
    s, m, phase = rec.stage, rec.microbatch, rec.phase
    if rec.kind == "RECV":
        peer = s - 1 if phase == FORWARD else s + 1
        return by_key[("SEND", peer, phase, m)].start + link[min(s, peer)]
    if rec.kind in ("SEND", "FREE"):
        return by_key[("RUN", s, phase, m)].end
    if phase == FORWARD:
        if s == 0:
            return 0.0
        src = ("RUN", s - 1, FORWARD, m) if mesh_of[s - 1] == mesh_of[s] else ("RECV", s, FORWARD, m)
        return by_key[src].end
    if phase == BACKWARD_WEIGHT:
        return by_key[("RUN", s, BACKWARD_INPUT, m)].end
    own = by_key[("RUN", s, FORWARD, m)].end
    if s == S - 1:
        return own
    src = ("RUN", s + 1, phase, m) if mesh_of[s + 1] == mesh_of[s] else ("RECV", s, phase, m)
    return max(own, by_key[src].end)


@pytest.mark.parametrize("name", [*NAMES, "interleaved_1f1b", "zb_h1"])
def test_every_instruction_starts_when_its_mesh_is_free_and_its_inputs_exist(name):
    """``simulate`` works out the waits once per schedule and then times them in one pass: each record's
    start must be exactly the later of its mesh's previous end and its inputs' arrival, recomputed
    here from the records (random stage and link times), and ``records=False`` the same figures."""
    import random

    rng = random.Random(7)
    for S, M in [(1, 1), (2, 5), (3, 3), (4, 8), (6, 12), (5, 2)]:
        if name == "interleaved_1f1b":
            sched = interleaved_one_f_one_b(2 * S, 2 * M, 2) if S > 1 else interleaved_one_f_one_b(2, 2, 1)
        else:
            sched = make_schedule(name, S, M)
        n = sched.num_stages
        f = [rng.uniform(0.5, 2) for _ in range(n)]
        b = [rng.uniform(0.5, 3) for _ in range(n)]
        w = [rng.uniform(0.2, 1) for _ in range(n)] if sched.split_backward else None
        link = [rng.choice([0.0, rng.uniform(0.1, 1.5)]) for _ in range(n - 1)]
        tl = simulate(sched, f, b, link, w)
        mesh_of = [sched.mesh(s) for s in range(n)]
        by_key = {(r.kind, r.stage, r.phase, r.microbatch): r for r in tl.records}
        assert len(by_key) == len(tl.records) == sum(len(p) for p in sched.instructions)
        clock = {}
        for r in tl.records:  # each mesh's records come in its list order
            assert r.start == max(clock.get(r.mesh, 0.0), _ready(r, by_key, mesh_of, link, n)), r
            expected = {FORWARD: f, BACKWARD: b if w is None else [x + y for x, y in zip(b, w)],
                        BACKWARD_INPUT: b if w else [x / 2 for x in b], BACKWARD_WEIGHT: w or [x / 2 for x in b]}
            assert r.end == (r.start + expected[r.phase][r.stage] if r.kind == "RUN" else r.start), r
            clock[r.mesh] = r.end
        assert tl.makespan == max(clock.values())
        bare = simulate(sched, f, b, link, w, records=False)
        assert bare.records == () and bare == dataclasses.replace(tl, records=())


def test_split_backward_schedules_by_name():
    from alpa_lab.passes.schedule import SCHEDULES, SPLIT_BACKWARD

    for name in SCHEDULES:
        sched = make_schedule(name, 2, 2, num_meshes=1) if name == "interleaved_1f1b" else make_schedule(name, 2, 2)
        assert sched.split_backward == (name in SPLIT_BACKWARD)


def test_a_backward_of_weight_gradients_only_simulates_split():
    """Split backward (zb_h1): a stage whose backward is all weight gradients (the first stage of an MLP) has
    backward - weight-gradient time = a rounding error, which may come out as -5e-23 (it did with JAX 0.11):
    the schedule simulates it as 0, not as a negative time it refuses."""
    import alpa_lab as al
    from alpa_lab.models import tiny_example
    from alpa_lab.passes.pipeline import simulated_timeline

    ex = tiny_example("mlp")
    step = al.parallelize(ex.train_step, cluster=al.ClusterSpec.local(1, 4), microbatches=4, layers=4, schedule="zb_h1")
    plan = step.plan(*ex.args).pin_stages([[0, 1], [2, 3]], submeshes=[(1, 2), (1, 2)])
    problem = plan._require_problem()
    stages = list(plan.stages)
    w = stages[0].weight_gradient_time
    stages[0] = dataclasses.replace(stages[0], backward_time=math.nextafter(w, 0.0))  # one rounding step below W
    assert stages[0].backward_time - w < 0 and stages[0].backward_input_time == 0.0
    timeline = simulated_timeline(problem, stages, "zb_h1", 4)
    assert timeline.makespan > 0


@pytest.mark.parametrize("name", [*NAMES, "interleaved_1f1b", "zb_h1"])
def test_schedules_check_at_the_sizes_the_planner_uses_them(name):
    """The planner does not run ``check`` on the schedules it simulates (its program refuses a deadlock; the
    full proof cost GPT-39B's plan 0.7 s): the generators are proved here at the paper's sizes instead, 32
    stages (GPT-39B's plan; 8 meshes for the interleaved schedule) and 1,024 micro-batches (Table 6)."""
    S, M = 32, 1024
    sched = make_schedule(name, S, M, num_meshes=8 if name == "interleaved_1f1b" else None)
    report = check(sched)
    assert (report.num_stages, report.num_microbatches) == (S, M)
    assert report.peak_in_flight == sched.program.peak_in_flight  # what plan_stages reads from the program


@pytest.mark.parametrize("name", sorted(WARMUP_SCHEDULES))
def test_warmup_timeline_equals_the_simulated_schedule(name):
    """The planner's timeline of the plan it keeps, made without the instruction lists (``warmup_timeline``):
    every field and every record (kind, times, order) exactly ``simulate``'s, on random stage and link times
    (links of 0 too: ties), 1 stage and 1 micro-batch up, fewer micro-batches than stages too."""
    import random

    from alpa_lab.passes.schedule import warmup_peaks, warmup_timeline

    rng = random.Random(5)
    for S in range(1, 7):
        for M in (1, 2, 3, 5, 9):
            f = [rng.uniform(0.1, 3.0) for _ in range(S)]
            b = [rng.uniform(0.1, 5.0) for _ in range(S)]
            links = [rng.choice([0.0, rng.uniform(0.0, 2.0)]) for _ in range(S - 1)]
            sched = make_schedule(name, S, M)
            want = simulate(sched, f, b, links)
            assert warmup_timeline(name, f, b, links, M) == want, (S, M, f, b, links)
            assert warmup_timeline(name, f, b, links, M, records=False) == simulate(sched, f, b, links, records=False)
            assert warmup_peaks(name, S, M) == sched.program.peak_in_flight
    with pytest.raises(ValueError, match="warm-up schedules are"):
        warmup_timeline("zb_h1", [1.0], [1.0], [], 2)


@pytest.mark.parametrize("name", sorted(WARMUP_SCHEDULES))
def test_warmup_makespan_equals_the_simulated_schedule(name):
    """The planner's screening simulates each candidate's stage count without building its lists
    (``warmup_makespan``): exactly ``simulate``'s makespan, on random stage and link times (links of 0 too,
    where ties between a mesh's clock and an arrival decide), from 1 stage and 1 micro-batch up."""
    import random

    from alpa_lab.passes.schedule import warmup_makespan

    rng = random.Random(3)
    for S in range(1, 8):
        for M in (1, 2, 3, 5, 8, 13):
            for _ in range(3):
                f = [rng.uniform(0.1, 3.0) for _ in range(S)]
                b = [rng.uniform(0.1, 5.0) for _ in range(S)]
                links = [rng.choice([0.0, rng.uniform(0.0, 2.0)]) for _ in range(S - 1)]
                want = simulate(make_schedule(name, S, M), f, b, links, records=False).makespan
                assert warmup_makespan(name, f, b, links, M) == want, (S, M, f, b, links)
    f, b = [rng.uniform(1, 2) for _ in range(16)], [rng.uniform(2, 4) for _ in range(16)]
    assert warmup_makespan(name, f, b, [0.05] * 15, 256) == simulate(make_schedule(name, 16, 256), f, b, 0.05, records=False).makespan
    with pytest.raises(ValueError, match="forward_time must be finite and >= 0"):
        warmup_makespan(name, [1.0, -1.0], [1.0, 1.0], [0.0], 4)
    with pytest.raises(ValueError, match="transfer_time must be 1 finite times"):
        warmup_makespan(name, [1.0, 1.0], [1.0, 1.0], [], 4)
    with pytest.raises(ValueError, match="not 'zb_h1'"):
        warmup_makespan("zb_h1", [1.0], [1.0], [], 4)
