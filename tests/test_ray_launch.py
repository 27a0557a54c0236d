"""``step.launch`` in the two forms a user types: on a Ray cluster they started (``launch(ray_cluster,
state)``, the rest of the Ray tests) and with a plan (``launch(plan, state)``, as the design sketch has
it), which starts a local Ray of the plan's shape for the run and stops it with the run, or joins the
one at ``address``. The oracle for the numbers is the same plan run in this process.
"""

from __future__ import annotations

import time

import numpy as np
import psutil
import pytest

import alpa_lab as al
from alpa_lab.models import tiny_example
from alpa_lab.runtime.ray_cluster import RayCluster
from alpa_lab.runtime.ray_run import _room_shortage

pytestmark = pytest.mark.timeout(600)

ray = pytest.importorskip("ray")


def ray_processes() -> list[int]:
    """Ray's raylet and GCS processes that this test process started (another Ray on the machine is not ours)."""
    found = []
    for p in psutil.Process().children(recursive=True):
        try:
            if any(name in " ".join(p.cmdline()) for name in ("raylet", "gcs_server")):
                found.append(p.pid)
        except psutil.Error:  # gone meanwhile
            pass
    return found


def listening_off_loopback() -> list[tuple[str, str]]:
    """(process, address) of every socket this process's children listen on outside 127.0.0.1."""
    found = []
    for p in psutil.Process().children(recursive=True):
        try:
            for con in p.net_connections(kind="inet"):
                if con.status == psutil.CONN_LISTEN and con.laddr.ip not in ("127.0.0.1", "::ffff:127.0.0.1"):
                    found.append((p.name(), f"{con.laddr.ip}:{con.laddr.port}"))
        except psutil.Error:  # gone meanwhile
            pass
    return found


def wait_for_no_ray_processes(timeout: float = 20.0) -> list[str]:
    deadline = time.time() + timeout
    while (left := ray_processes()) and time.time() < deadline:
        time.sleep(0.5)
    return left


@pytest.fixture(scope="module")
def planned():
    """A two-stage MLP plan for local 2 x 4 devices and its in-process losses and state (the reference)."""
    if ray.is_initialized():  # another module's Ray: these tests start their own
        ray.shutdown()
    ex = tiny_example("mlp")
    step = al.parallelize(ex.train_step, cluster=al.ClusterSpec.local(2, 4), microbatches=4, layers=4)
    plan = step.plan(*ex.args).pin_stages([[0, 1], [2, 3]], submeshes=[(1, 4), (1, 4)])
    step.use(plan)
    state, losses = ex.state, []
    for _ in range(2):
        state, loss = step(state, ex.batch)
        losses.append(float(loss))
    return ex, step, plan, losses, state


def assert_trains_like_reference(run, ex, losses, state) -> None:
    got = [float(run.step(ex.batch)) for _ in range(2)]
    np.testing.assert_allclose(got, losses, rtol=1e-5)
    import jax

    for a, b in zip(jax.tree_util.tree_leaves(run.state()), jax.tree_util.tree_leaves(state), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


def test_launching_a_plan_starts_a_local_ray_of_its_shape_and_closing_the_run_stops_it(planned):
    ex, step, plan, losses, state = planned
    edited = plan.with_schedule("gpipe")
    with step.launch(edited, ex.state) as run:
        assert run.owns_cluster and run.cluster.started_here
        assert ray_processes(), "the check below could not see the Ray this run started"
        assert run.cluster.address.startswith("127.0.0.1:")
        assert not listening_off_loopback(), "a process of the local Ray listens beyond 127.0.0.1"
        assert (run.cluster.hosts, run.cluster.devices_per_host) == (2, 4)
        assert step.current_plan is run.plan and run.plan.schedule == "gpipe"  # the plan launched became current
        assert len(run.workers) == 2
        assert_trains_like_reference(run, ex, losses, state)  # GPipe and 1F1B sum the same micro-batches
    assert not ray.is_initialized()
    assert not wait_for_no_ray_processes(), "the Ray started for the run was left running"
    step.use(plan)


def test_a_plan_launched_at_an_address_joins_that_ray_and_leaves_it_running(planned):
    ex = planned[0]
    # a local Ray is one node: joined at its address it is one host of 8 devices, so plan for 1 x 8
    step = al.parallelize(ex.train_step, cluster=al.ClusterSpec.local(1, 8), microbatches=4, layers=4)
    plan = step.use(step.plan(*ex.args).pin_stages([[0, 1], [2, 3]], submeshes=[(1, 4), (1, 4)]))
    state, losses = ex.state, []
    for _ in range(2):
        state, loss = step(state, ex.batch)
        losses.append(float(loss))
    with RayCluster.local(1, 8) as mine:
        with step.launch(plan, ex.state, address="auto") as run:
            assert not run.owns_cluster and not run.cluster.started_here
            assert_trains_like_reference(run, ex, losses, state)
        assert ray.is_initialized() and not mine._closed  # the user's Ray is theirs to stop
        assert repr(run).startswith("RayRun(closed, 2 step(s) done, 2 stage(s) on 2 mesh worker(s)") and len(repr(run)) < 200
        # another run holding the cluster's CPUs: on a Ray started here, refused at once, saying so (it waited 60 s
        # for Ray's placement once; a cluster joined at an address may grow, so there the placement is waited for)
        held = ray.util.placement_group([{"CPU": 7}])
        assert held.wait(timeout_seconds=30)
        t0 = time.monotonic()
        step.on_ray(mine)
        try:
            with pytest.raises(al.LaunchError, match=r"need 2 CPU \(1 of the cluster's 8 free\): another run holds the rest"):
                step.launch(plan, ex.state)
        finally:
            step.on_ray(None)
        assert time.monotonic() - t0 < 30
        ray.util.remove_placement_group(held)
        assert _room_shortage(ray, [{"CPU": 1}, {"CPU": 1}], wait=5.0) is None
        assert "the plan needs 1 mesh workers, 100 CPU (it has 8)" in _room_shortage(ray, [{"CPU": 100}])
        step.on_ray(mine)  # on a step bound to a Ray cluster, a plan launches there
        try:
            with step.launch(plan, ex.state) as run:
                assert run.cluster is mine and not run.owns_cluster
        finally:
            step.on_ray(None)
        # the Ray cluster as parallelize's cluster=: planned for its devices, each call run on its mesh workers
        given = al.parallelize(ex.train_step, cluster=mine, microbatches=4, layers=4)
        try:
            assert given.ray_cluster is mine
            _, loss = given(ex.state, ex.batch)
            assert given.ray_run is not None and given.ray_run.cluster is mine
            assert (given.current_plan.cluster["hosts"], given.current_plan.cluster["devices_per_host"]) == (1, 8)
            assert float(loss) == pytest.approx(losses[0], rel=1e-4)
        finally:
            given.on_ray(None)
        assert ray.is_initialized()
    assert not wait_for_no_ray_processes()


def test_bad_launches_say_what_to_pass_and_start_nothing(planned):
    ex, step, plan, *_ = planned
    with pytest.raises(ValueError, match="backend must be 'ray'.*call the step"):
        step.launch(plan, ex.state, backend="inprocess")
    with pytest.raises(al.LaunchError, match=r"needs the training state.*step\.launch\(plan, state\)"):
        step.launch(plan)
    with pytest.raises(TypeError, match="takes a RayCluster or a plan"):
        step.launch("local:2x4", ex.state)
    fresh = al.parallelize(ex.train_step, cluster=al.ClusterSpec.local(2, 4), microbatches=4, layers=4)
    with pytest.raises(al.LaunchError, match="no plan yet"):
        fresh.launch(state=ex.state)
    assert step.current_plan is plan
    assert not ray.is_initialized() and not wait_for_no_ray_processes()


def test_a_launch_that_fails_after_starting_ray_stops_it_and_keeps_the_current_plan(planned):
    ex, step, plan, *_ = planned
    step.use(plan)
    with pytest.raises(al.TraceError, match=r"argument \[0\]\['not'\]: a str .* is not an array"):
        step.launch(plan.with_schedule("gpipe"), {"not": "the state"})
    assert step.current_plan is plan
    assert not ray.is_initialized() and not wait_for_no_ray_processes(), "the Ray started for the launch was left running"
    with RayCluster.local(2, 4) as mine:
        with pytest.raises(ValueError, match="not both"):
            step.launch(mine, ex.state, address="auto")
    step.on_ray(mine)  # shut down since: said, not replaced by a new Ray
    try:
        with pytest.raises(al.LaunchError, match=r"step's Ray cluster \(on_ray\) was shut down"):
            step.launch(plan, ex.state)
    finally:
        step.on_ray(None)
    assert step.current_plan is plan and not ray.is_initialized()


def test_step_timeout_spares_the_first_step_and_closes_a_run_whose_later_step_takes_too_long(planned):
    """The first step compiles the programs on the workers (seconds for a tiny model): ``step_timeout`` is
    for the steps after it. A later step slower than it closes the run and names the workers still busy."""
    ex, step, plan, losses, _ = planned
    step.use(plan)
    with step.launch(plan, ex.state, step_timeout=1e-3, keep_state_every=100) as run:  # no timed state copies
        assert float(run.step(ex.batch)) == pytest.approx(losses[0], rel=1e-5)  # compiled there, not timed out
        with pytest.raises(al.MeshWorkerError, match=r"step 1 did not finish within step_timeout=0\.001 s; still waiting on"):
            run.step(ex.batch)
        assert run.closed and run.last_state is not None
    assert not ray.is_initialized() and not wait_for_no_ray_processes()
