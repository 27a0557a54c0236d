"""RayCluster.connect against a Ray head started separately on 127.0.0.1 (as a user's cluster would be).

Runs before ``test_ray_runtime.py`` (its own Ray, started and stopped here); a connected
cluster is left running by ``shutdown`` and is stopped by this module itself.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time

import pytest

import alpa_lab as al
from alpa_lab.models import tiny_example

from test_pipeline import assert_close

pytest.importorskip("ray")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def head():
    ray_bin = shutil.which("ray", path=os.path.dirname(sys.executable)) or shutil.which("ray")
    port = free_port()
    cmd = [ray_bin, "start", "--head", f"--port={port}", "--node-ip-address=127.0.0.1", "--num-cpus=4",
           "--include-dashboard=false", "--disable-usage-stats"]
    subprocess.run(cmd, check=True, capture_output=True, timeout=120)
    yield f"127.0.0.1:{port}"
    subprocess.run([ray_bin, "stop", "--force"], capture_output=True, timeout=60)
    time.sleep(1)
    left = subprocess.run(["pgrep", "-f", "raylet|gcs_server"], capture_output=True, text=True).stdout.split()
    assert not left, f"Ray processes left running: {left}"


def test_connect_describes_the_cluster_and_runs_a_plan(head):
    # "auto": the head this machine runs (Ray 2.60 here rewrites an explicit 127.0.0.1:port to the
    # node's other address and then refuses the token, so the test joins the way `ray start` says to)
    cluster = al.RayCluster.connect("auto", devices_per_host=4)
    try:
        assert (cluster.hosts, cluster.devices_per_host, cluster.platform) == (1, 4, "cpu")
        assert not cluster.started_here
        ex = tiny_example("mlp")
        step = al.parallelize(ex.train_step, cluster=cluster.spec, mesh_shape=(1, 4))
        step.plan(*ex.args)
        with step.launch(cluster, ex.state) as run:
            loss = run.step(ex.batch)
            state, ref = step(ex.state, ex.batch)
            assert_close(loss, ref, "loss")
            assert_close(run.state(), state, "state")
    finally:
        cluster.shutdown()
    # the connected cluster is left running: a new connection finds it
    again = al.RayCluster.connect("auto", devices_per_host=4)
    assert again.hosts == 1
    again.shutdown()


def test_an_address_that_does_not_answer_fails_fast():
    t = time.monotonic()
    with pytest.raises(al.RayClusterError, match=r"no Ray cluster answers at '127.0.0.1:\d+'"):
        al.RayCluster.connect(f"127.0.0.1:{free_port()}", timeout=3)
    assert time.monotonic() - t < 5
