"""Clusters, logical meshes and the alpha-beta cost of collectives (alpa_lab/cost/cluster.py).

Costs are checked against the formulas of the module docstring, recomputed here by hand from
the cluster's raw numbers (never from the mesh's own alpha/beta, so an axis mix-up shows).
"""

import math

import pytest

from alpa_lab.cost.cluster import (
    COLLECTIVE_KINDS,
    GB,
    PRESETS,
    ClusterError,
    ClusterSpec,
    Collective,
    LogicalMesh,
)

# --------------------------------------------------------------------------------------
# Presets
# --------------------------------------------------------------------------------------
PRESET_FACTS = {
    # name: (devices per host, device memory in GB)
    "p3.16xlarge": (8, 16),  # 8 x V100 16 GB
    "p3.8xlarge": (4, 16),  # 4 x V100 16 GB
    "dgx-a100": (8, 80),  # 8 x A100 80 GB
    "dgx-h100": (8, 80),  # 8 x H100 80 GB
}


@pytest.mark.parametrize("name", list(PRESET_FACTS))
def test_presets_are_sensible(name):
    devices, mem_gb = PRESET_FACTS[name]
    c = ClusterSpec.preset(name)
    assert name in PRESETS
    assert c.hosts == 1 and c.devices_per_host == devices and c.num_devices == devices
    assert c.device_memory == mem_gb * GB
    assert name in c.name
    assert not c.simulated
    # NVLink inside a host beats the network between hosts, in bandwidth and latency
    assert c.intra_host_bandwidth > c.inter_host_bandwidth > 0
    assert 0 < c.intra_host_latency < c.inter_host_latency < 1e-3
    # tens of TFLOP/s to about a PFLOP/s, HBM at hundreds of GB/s to a few TB/s
    assert 10e12 <= c.device_flops <= 2e15
    assert 500 * GB <= c.memory_bandwidth <= 5000 * GB
    assert 10 * GB <= c.intra_host_bandwidth <= 1000 * GB
    assert c.host_to_device_bandwidth > 0


def test_presets_order_by_generation():
    v100, a100, h100 = (ClusterSpec.preset(n) for n in ("p3.16xlarge", "dgx-a100", "dgx-h100"))
    assert v100.device_flops < a100.device_flops < h100.device_flops
    assert v100.memory_bandwidth < a100.memory_bandwidth < h100.memory_bandwidth
    assert v100.inter_host_bandwidth < a100.inter_host_bandwidth < h100.inter_host_bandwidth
    # the Alpa testbed: 25 Gbit/s per host shared by its 8 GPUs
    assert v100.inter_host_bandwidth == pytest.approx(25e9 / 8 / 8)


def test_preset_hosts():
    c = ClusterSpec.preset("p3.16xlarge", hosts=8)
    assert c.num_devices == 64
    assert c.hosts == 8 and c.devices_per_host == 8
    assert c.name == "p3.16xlarge:8"
    assert PRESETS["p3.16xlarge"].hosts == 1  # the preset itself is untouched
    assert ClusterSpec.preset("dgx-h100", hosts=2).num_devices == 16
    assert ClusterSpec.preset("p3.8xlarge", hosts=3).num_devices == 12


def test_unknown_preset_lists_known_ones():
    with pytest.raises(ClusterError) as info:
        ClusterSpec.preset("p4d.24xlarge")
    msg = str(info.value)
    assert "p4d.24xlarge" in msg
    for name in PRESET_FACTS:
        assert name in msg


@pytest.mark.parametrize("hosts", [0, -1])
def test_invalid_hosts(hosts):
    with pytest.raises(ClusterError, match="at least one host"):
        ClusterSpec.preset("p3.16xlarge", hosts=hosts)
    with pytest.raises(ClusterError, match="at least one host"):
        ClusterSpec.local(hosts, 4)


def test_invalid_cluster_numbers():
    with pytest.raises(ClusterError, match="devices_per_host=0"):
        ClusterSpec.local(1, 0)
    with pytest.raises(ClusterError, match="inter_host_bandwidth"):
        ClusterSpec(hosts=1, devices_per_host=1, intra_host_bandwidth=1.0, inter_host_bandwidth=0.0)
    with pytest.raises(ClusterError, match="device_memory"):
        ClusterSpec(hosts=1, devices_per_host=1, intra_host_bandwidth=1.0, inter_host_bandwidth=1.0, device_memory=-1)
    assert issubclass(ClusterError, ValueError)


def test_local_cluster():
    c = ClusterSpec.local(2, 4)
    assert c.simulated and c.num_devices == 8 and c.hosts == 2 and c.devices_per_host == 4
    base = PRESETS["p3.8xlarge"]
    assert c.intra_host_bandwidth == base.intra_host_bandwidth
    assert c.inter_host_bandwidth == base.inter_host_bandwidth
    d = c.to_dict()
    assert d["hosts"] == 2 and d["devices_per_host"] == 4 and d["simulated"] is True


# --------------------------------------------------------------------------------------
# Logical meshes
# --------------------------------------------------------------------------------------
CLUSTER = ClusterSpec.local(2, 4)
INTRA = (CLUSTER.intra_host_latency, 1 / CLUSTER.intra_host_bandwidth)
INTER = (CLUSTER.inter_host_latency, 1 / CLUSTER.inter_host_bandwidth)


def axis_link(mesh, axis):
    return (mesh.alpha[axis], mesh.beta[axis])


def test_inter_and_intra_differ():
    # the test below is only meaningful if the two links differ in both numbers
    assert INTRA[0] != INTER[0] and INTRA[1] != INTER[1]


@pytest.mark.parametrize(
    "shape,links",
    [
        ((2, 4), (INTER, INTRA)),  # a row is one host; axis 0 goes from host to host
        ((4, 2), (INTER, INTRA)),  # rows (0,1),(2,3) | (4,5),(6,7): axis 0 crosses between rows 1 and 2
        ((1, 8), (INTRA, INTER)),  # axis 1 runs over all 8 devices, both hosts
        ((8, 1), (INTER, INTRA)),
    ],
    ids=str,
)
def test_logical_mesh_links(shape, links):
    mesh = CLUSTER.logical_mesh(shape)
    assert mesh.shape == shape
    assert mesh.num_devices == 8
    assert mesh.device_ids == tuple(range(8))  # host-major: host * devices_per_host + local
    for axis in range(2):
        if shape[axis] > 1:
            assert axis_link(mesh, axis) == pytest.approx(links[axis]), (shape, axis)
    assert mesh.device_flops == CLUSTER.device_flops
    assert mesh.device_memory == CLUSTER.device_memory
    assert mesh.memory_bandwidth == CLUSTER.memory_bandwidth
    d = mesh.to_dict()
    assert d["shape"] == list(shape) and d["device_ids"] == list(range(8))


def test_logical_mesh_device_ids_grid():
    mesh = CLUSTER.logical_mesh((2, 4))
    grid = [mesh.device_ids[r * 4 : (r + 1) * 4] for r in range(2)]
    # row r is host r
    assert [sorted({d // CLUSTER.devices_per_host for d in row}) for row in grid] == [[0], [1]]
    big = ClusterSpec.preset("p3.16xlarge", hosts=4).logical_mesh((4, 8))
    assert big.device_ids == tuple(range(32))
    assert axis_link(big, 0)[1] == pytest.approx(1 / big_inter()) and axis_link(big, 1)[1] == pytest.approx(1 / big_intra())


def big_inter():
    return PRESETS["p3.16xlarge"].inter_host_bandwidth


def big_intra():
    return PRESETS["p3.16xlarge"].intra_host_bandwidth


def test_logical_mesh_on_chosen_devices():
    # two devices of each host: axis 0 crosses hosts, axis 1 stays inside one
    m = CLUSTER.logical_mesh((2, 2), devices=(0, 1, 4, 5))
    assert m.device_ids == (0, 1, 4, 5)
    assert axis_link(m, 0) == pytest.approx(INTER) and axis_link(m, 1) == pytest.approx(INTRA)
    # the same devices, transposed: now axis 1 crosses
    m = CLUSTER.logical_mesh((2, 2), devices=(0, 4, 1, 5))
    assert axis_link(m, 0) == pytest.approx(INTRA) and axis_link(m, 1) == pytest.approx(INTER)
    # one host only: everything intra
    m = CLUSTER.logical_mesh((2, 2), devices=(4, 5, 6, 7))
    assert axis_link(m, 0) == pytest.approx(INTRA) and axis_link(m, 1) == pytest.approx(INTRA)
    # default shape is the 1-D mesh
    assert CLUSTER.logical_mesh().shape == (1, 8)
    assert CLUSTER.logical_mesh(devices=(0, 1, 2)).shape == (1, 3)


def test_single_host_is_all_intra():
    c = ClusterSpec.preset("dgx-a100")
    for shape in c.logical_mesh_shapes():
        mesh = c.logical_mesh(shape)
        for axis in range(2):
            assert mesh.beta[axis] == pytest.approx(1 / c.intra_host_bandwidth)
            assert mesh.alpha[axis] == pytest.approx(c.intra_host_latency)


def test_logical_mesh_shapes():
    assert CLUSTER.logical_mesh_shapes() == [(1, 8), (2, 4), (4, 2), (8, 1)]
    assert ClusterSpec.local(1, 1).logical_mesh_shapes() == [(1, 1)]
    assert len(ClusterSpec.preset("p3.16xlarge", hosts=8).logical_mesh_shapes()) == 7  # divisors of 64


@pytest.mark.parametrize("shape", [(3, 3), (2, 2), (4, 4), (2, 2, 2), (8,), (-2, -4), (0, 8)], ids=str)
def test_logical_mesh_bad_shape(shape):
    with pytest.raises(ClusterError) as info:
        CLUSTER.logical_mesh(shape)
    msg = str(info.value)
    assert "8 devices" in msg
    assert "product is 8" in msg  # the fix
    assert "(1, 8)" in msg  # an example that works


# --------------------------------------------------------------------------------------
# Collective costs (module docstring formulas)
# --------------------------------------------------------------------------------------
def expected_cost(kind, nbytes, n, alpha, beta):
    if n == 1:
        return 0.0
    factor = {"all-reduce": 2, "all-gather": 1, "reduce-scatter": 1, "all-to-all": 1}[kind]
    return alpha + beta * factor * (n - 1) / n * nbytes


MESH_24 = CLUSTER.logical_mesh((2, 4))
NBYTES = 3.0e6


@pytest.mark.parametrize("kind", COLLECTIVE_KINDS)
@pytest.mark.parametrize(
    "axes,n,alpha,beta",
    [
        ((0,), 2, INTER[0], INTER[1]),
        ((1,), 4, INTRA[0], INTRA[1]),
        # both axes: all 8 devices, the two latencies add, the slower link bounds bandwidth
        ((0, 1), 8, INTER[0] + INTRA[0], max(INTER[1], INTRA[1])),
        ((1, 0), 8, INTER[0] + INTRA[0], max(INTER[1], INTRA[1])),
    ],
    ids=str,
)
def test_collective_cost_formulas_2x4(kind, axes, n, alpha, beta):
    got = MESH_24.collective_cost(kind, NBYTES, axes)
    assert got == pytest.approx(expected_cost(kind, NBYTES, n, alpha, beta), rel=1e-12)
    assert MESH_24.group(axes) == pytest.approx((n, alpha, beta))
    c = MESH_24.collective(kind, NBYTES, axes)
    assert isinstance(c, Collective)
    assert c.kind == kind and c.axes == tuple(axes) and c.nbytes == NBYTES and c.cost == pytest.approx(got)


def test_collective_cost_by_hand_numbers():
    # p3.8xlarge links: 130 GB/s NVLink, 10 Gbit/s / 4 devices network
    intra_beta, inter_beta = 1 / 130e9, 1 / (10e9 / 8 / 4)
    m = NBYTES
    assert MESH_24.collective_cost("all-reduce", m, (1,)) == pytest.approx(5e-6 + intra_beta * 2 * 3 / 4 * m)
    assert MESH_24.collective_cost("all-gather", m, (0,)) == pytest.approx(2e-5 + inter_beta * 1 / 2 * m)
    assert MESH_24.collective_cost("all-to-all", m, (0, 1)) == pytest.approx(2.5e-5 + inter_beta * 7 / 8 * m)
    assert MESH_24.collective_cost("reduce-scatter", m, (1,)) == pytest.approx(5e-6 + intra_beta * 3 / 4 * m)
    # all-reduce = reduce-scatter + all-gather in bandwidth terms
    ar = MESH_24.collective_cost("all-reduce", m, (1,)) - 5e-6
    rs = MESH_24.collective_cost("reduce-scatter", m, (1,)) - 5e-6
    assert ar == pytest.approx(2 * rs)


def test_cross_host_axis_is_slower():
    for kind in COLLECTIVE_KINDS:
        # same group size (2) on both axes of a 2x2 mesh over two hosts
        m = CLUSTER.logical_mesh((2, 2), devices=(0, 1, 4, 5))
        assert m.collective_cost(kind, NBYTES, (0,)) > m.collective_cost(kind, NBYTES, (1,))


@pytest.mark.parametrize("kind", COLLECTIVE_KINDS)
def test_collective_cost_1d_meshes(kind):
    m18 = CLUSTER.logical_mesh((1, 8))
    # size-1 axis: nobody to talk to
    assert m18.collective_cost(kind, NBYTES, (0,)) == 0.0
    assert m18.collective_cost(kind, NBYTES, ()) == 0.0
    assert m18.collective(kind, NBYTES, (0,)).cost == 0.0
    assert m18.collective(kind, NBYTES, (0,)).axes == ()
    want = expected_cost(kind, NBYTES, 8, INTER[0], INTER[1])
    assert m18.collective_cost(kind, NBYTES, (1,)) == pytest.approx(want)
    # combining with the size-1 axis changes nothing: its latency is not added
    assert m18.collective_cost(kind, NBYTES, (0, 1)) == pytest.approx(want)
    assert m18.collective(kind, NBYTES, (0, 1)).axes == (1,)
    m81 = CLUSTER.logical_mesh((8, 1))
    assert m81.collective_cost(kind, NBYTES, (0,)) == pytest.approx(want)
    assert m81.collective_cost(kind, NBYTES, (1,)) == 0.0
    assert m81.collective_cost(kind, NBYTES, (0, 1)) == pytest.approx(want)
    one = ClusterSpec.local(1, 1).logical_mesh((1, 1))
    assert one.collective_cost(kind, NBYTES, (0, 1)) == 0.0


def test_size1_axis_link_is_ignored_when_combined():
    # a size-1 axis has no link: neither its latency nor its bandwidth may enter the cost
    mesh = LogicalMesh(shape=(1, 4), device_ids=(0, 1, 2, 3), alpha=(1.0, 1e-6), beta=(1.0, 1e-9))
    want = 1e-6 + 1e-9 * 3 / 4 * NBYTES
    assert mesh.collective_cost("all-gather", NBYTES, (1,)) == pytest.approx(want)
    assert mesh.collective_cost("all-gather", NBYTES, (0, 1)) == pytest.approx(want)
    assert mesh.group((0, 1)) == pytest.approx((4, 1e-6, 1e-9))


def test_collective_cost_scales_with_bytes():
    for kind in COLLECTIVE_KINDS:
        a = MESH_24.collective_cost(kind, 1e6, (1,))
        b = MESH_24.collective_cost(kind, 2e6, (1,))
        alpha = MESH_24.alpha[1]
        assert b - alpha == pytest.approx(2 * (a - alpha))
        assert MESH_24.collective_cost(kind, 0.0, (1,)) == pytest.approx(alpha)


def test_unknown_collective_kind():
    with pytest.raises(ValueError, match="unknown collective 'broadcast'") as info:
        MESH_24.collective_cost("broadcast", NBYTES, (0,))
    for kind in COLLECTIVE_KINDS:
        assert kind in str(info.value)
    with pytest.raises(ValueError):
        MESH_24.collective("all_gather", NBYTES, (1,))


def test_collective_str():
    c = MESH_24.collective("all-gather", 2048.0, (0, 1))
    assert str(c) == "all-gather(2.0KB, 01)"
    assert str(MESH_24.collective("all-to-all", 512, (1,))) == "all-to-all(512B, 1)"
    assert str(MESH_24.collective("all-reduce", 3.5e9, (0,))) == "all-reduce(3.5GB, 0)"


def test_compute_cost_roofline():
    m = MESH_24
    flops, nbytes = 1e12, 1e9
    expect = max(flops / m.device_flops, nbytes / m.memory_bandwidth)
    assert m.compute_cost(flops, nbytes, 1) == pytest.approx(expect)
    assert m.compute_cost(flops, nbytes, 4) == pytest.approx(expect / 4)
    assert m.compute_cost(flops, nbytes, 0) == pytest.approx(expect)
    assert math.isclose(m.compute_cost(0, 0, 8), 0.0)


def test_logical_mesh_rejects_repeated_or_unknown_devices():
    cluster = ClusterSpec.local(1, 4)
    with pytest.raises(ClusterError, match="must be distinct device ids in 0..3"):
        cluster.logical_mesh((2, 2), devices=(0, 0, 1, 1))
    with pytest.raises(ClusterError, match="must be distinct device ids"):
        cluster.logical_mesh((1, 2), devices=(3, 4))


def test_a_cluster_is_named_by_the_text_the_command_line_takes():
    """``ClusterSpec.parse``: what ``alpa-lab demo --cluster`` and ``%%parallelize --cluster`` read, and what
    ``parallelize(cluster="local:2x4")`` takes; a text it cannot read says what to write."""
    assert ClusterSpec.parse("local:2x4") == ClusterSpec.local(2, 4)
    assert ClusterSpec.parse("local") == ClusterSpec.local(1, 4)
    assert ClusterSpec.parse(" P3.16xlarge:2 ") == ClusterSpec.preset("p3.16xlarge", hosts=2)
    assert ClusterSpec.parse("dgx-h100") == ClusterSpec.preset("dgx-h100")
    for bad, why in (("local:2x", "cannot read"), ("local:0x4", "at least one host"), ("p3.16xlarge:two", "cannot read"),
                     ("tpu:4", "unknown cluster 'tpu:4'"), ("", "unknown cluster")):
        with pytest.raises(ClusterError, match=why) as info:
            ClusterSpec.parse(bad)
        assert "local:HOSTSxDEVICES" in str(info.value)
    with pytest.raises(ClusterError, match="must be a string"):
        ClusterSpec.parse(8)
    with pytest.raises(ClusterError, match=r"a Ray cluster is an object, not a text: al.RayCluster.local\(2, 4\)"):
        ClusterSpec.parse("ray")
