"""Cross-mesh resharding as unit tasks (MLSys'23, sec. 3-4) and a pipeline plan's transfers.

Oracles, none of them the module's own tiling code:
* which part of a tensor a device holds comes from JAX (``NamedSharding.devices_indices_map``)
  and is compared as numpy boolean masks: every receiver's regions cover its destination
  tile exactly once, every sender holds what it sends, and the bytes moved are what each
  destination device lacks (its tile minus what it already holds);
* ``jax.device_put`` between two sub-meshes really leaves on each device the tile the
  module says, with the data the unit tasks deliver;
* for a planned pipeline, an independent scan of the graph and stage plans, and the
  runtime's own compiled unit tasks (what it ``device_put``s), name the same transfers.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import random

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding

import alpa_lab as al
from alpa_lab.graph.subgraph import cross_path
from alpa_lab.models import tiny_example
from alpa_lab.passes.stages import APPLY, BACKWARD, FORWARD
from alpa_lab.passes.transfers import host_traffic, pipeline_transfers, stage_traffic
from alpa_lab.plan import PlanFormatError
from alpa_lab.sharding.cross_mesh import cross_mesh_resharding, list_schedule, tile_regions
from alpa_lab.sharding.spec import ShardingSpec, ShardingSpecError, enumerate_specs

MESH_SHAPES = [(1, 2), (2, 2), (1, 4), (2, 1), (4, 1)]
DEVICES_PER_HOST = 4  # 8 simulated devices as 2 hosts x 4


def jax_tiles(shape, spec: ShardingSpec, mesh_shape, devices) -> dict[int, np.ndarray]:
    """Device id -> boolean mask of the part of the tensor JAX puts on it."""
    all_devices = jax.devices()
    mesh = Mesh(np.array([all_devices[d] for d in devices], dtype=object).reshape(mesh_shape), ("x", "y"))
    index = NamedSharding(mesh, spec.to_partition_spec()).devices_indices_map(tuple(shape))
    out = {}
    for dev, idx in index.items():
        mask = np.zeros(shape, dtype=bool)
        mask[idx] = True
        out[dev.id] = mask
    return out


def region_mask(shape, region) -> np.ndarray:
    mask = np.zeros(shape, dtype=bool)
    mask[tuple(slice(a, b) for a, b in region)] = True
    return mask


def random_case(rng: random.Random, overlap: bool):
    rank = rng.randint(0, 3)
    shape = tuple(rng.choice([1, 2, 3, 4, 6, 8, 12]) for _ in range(rank))
    src_mesh, dst_mesh = rng.choice(MESH_SHAPES), rng.choice(MESH_SHAPES)
    if overlap:  # both meshes drawn from the same 4 devices (host 0 or host 1), or all 8
        pool = rng.choice([list(range(4)), list(range(4, 8)), list(range(8))])
        src = rng.sample(pool, math.prod(src_mesh))
        dst = rng.sample(pool, math.prod(dst_mesh))
    else:
        perm = rng.sample(range(8), 8)
        src, dst = perm[: math.prod(src_mesh)], perm[math.prod(src_mesh) : math.prod(src_mesh) + math.prod(dst_mesh)]
    src_spec = rng.choice(enumerate_specs(shape, src_mesh))
    dst_spec = rng.choice(enumerate_specs(shape, dst_mesh))
    return shape, src_spec, src_mesh, src, dst_spec, dst_mesh, dst


# ----- coverage and bytes against JAX's tiles, on random cases -----------------------------------
@pytest.mark.parametrize("overlap", [False, True], ids=["disjoint", "overlapping"])
def test_unit_tasks_cover_each_destination_tile_exactly(overlap):
    rng = random.Random(1234 + overlap)
    saw_local_copy = False
    for _ in range(150):
        shape, src_spec, src_mesh, src, dst_spec, dst_mesh, dst = random_case(rng, overlap)
        r = cross_mesh_resharding(
            shape, "float32", src_spec, src_mesh, src, dst_spec, dst_mesh, dst, devices_per_host=DEVICES_PER_HOST
        )
        what = f"{shape} {src_spec}@{src_mesh}{src} -> {dst_spec}@{dst_mesh}{dst}"
        src_tiles = jax_tiles(shape, src_spec, src_mesh, src)
        dst_tiles = jax_tiles(shape, dst_spec, dst_mesh, dst)
        received = {d: np.zeros(shape, dtype=int) for d in dst}
        for t in r.tasks:
            m = region_mask(shape, t.region)
            assert t.nbytes == m.sum() * 4, what
            # senders: exactly the source devices holding the whole region; receivers likewise
            assert set(t.senders) == {d for d, tile in src_tiles.items() if (tile | ~m).all()}, what
            assert set(t.receivers) == {d for d, tile in dst_tiles.items() if (tile | ~m).all()}, what
            assert sorted(rcv for _, rcv in t.assignment) == sorted(t.receivers), what  # one sender each
            # broadcast: a receiver gets the region from a source device holding it, or (a hop of
            # the host's chain) from an earlier receiver of the same task on its own host
            source = dict((rcv, s) for s, rcv in t.assignment)
            for s, rcv in t.assignment:
                if s not in src_tiles or not (src_tiles[s] | ~m).all():
                    assert s in t.receivers and s // DEVICES_PER_HOST == rcv // DEVICES_PER_HOST, f"{what}: {s} lacks {t.region}"
                    assert t.receivers.index(s) < t.receivers.index(rcv), f"{what}: the chain to {rcv} loops"
                if rcv in t.senders:  # it holds the region already: a local copy, never traffic
                    assert s == rcv, what
                    saw_local_copy = True
                elif any(x // DEVICES_PER_HOST == rcv // DEVICES_PER_HOST for x in t.senders):
                    assert s // DEVICES_PER_HOST == rcv // DEVICES_PER_HOST, f"{what}: a same-host sender was passed over"
                received[rcv] += m
            # the region enters each receiving host at most once (one broadcast per host)
            entering = [rcv for s, rcv in t.assignment if s // DEVICES_PER_HOST != rcv // DEVICES_PER_HOST]
            assert len(entering) == len({rcv // DEVICES_PER_HOST for rcv in entering}), what
            for rcv in t.receivers:  # every chain ends at a holder of the source tile
                d, seen = rcv, set()
                while d in source and source[d] != d and d not in seen:
                    seen.add(d)
                    d = source[d]
                assert d in t.senders, f"{what}: {rcv}'s chain does not reach a sender"
        for d in dst:
            np.testing.assert_array_equal(received[d], dst_tiles[d].astype(int), err_msg=f"{what}: device {d}")
        # bytes over links: per destination device, its tile minus what it holds on the source mesh
        own = {d: src_tiles.get(d, np.zeros(shape, dtype=bool)) for d in dst}
        assert r.total_bytes == 4 * sum(int((dst_tiles[d] & ~own[d]).sum()) for d in dst), what
        assert sum(r.sent_bytes().values()) == sum(r.received_bytes().values()) == r.total_bytes
        assert sum(r.bytes_between(lambda d: d // DEVICES_PER_HOST).values()) == r.total_bytes
        inter = sum(n for (a, b), n in r.bytes_between(lambda d: d // DEVICES_PER_HOST).items() if a != b)
        assert r.inter_host_bytes(DEVICES_PER_HOST) == inter
    assert saw_local_copy or not overlap


def test_tile_regions_are_jax_tiles():
    for mesh_shape, spec in [((2, 2), "S0S1"), ((2, 2), "S01R"), ((1, 4), "RS1"), ((4, 1), "S0R"), ((2, 2), "RR")]:
        devices = [5, 2, 7, 0]
        spec = ShardingSpec.parse(spec)
        ours = tile_regions((8, 12), spec, mesh_shape, devices)
        for d, mask in jax_tiles((8, 12), spec, mesh_shape, devices).items():
            np.testing.assert_array_equal(region_mask((8, 12), ours[d]), mask)


# ----- bytes, hand-computed ------------------------------------------------------------------
def test_replicated_to_replicated_sends_the_tensor_to_every_destination_device():
    for src_mesh, dst_mesh in [((1, 2), (2, 2)), ((2, 2), (1, 4)), ((4, 1), (1, 2))]:
        n_src = math.prod(src_mesh)
        src, dst = range(n_src), range(n_src, n_src + math.prod(dst_mesh))
        r = cross_mesh_resharding((6, 4), "float32", "RR", src_mesh, src, "RR", dst_mesh, dst)
        assert r.total_bytes == 6 * 4 * 4 * math.prod(dst_mesh)
        assert len(r.tasks) == 1
        loads = r.sent_bytes()  # the greedy spreads the receivers over the replicas
        assert max(loads.values()) - min(loads.values()) <= 96 and len(loads) == min(n_src, math.prod(dst_mesh))


def test_sharded_to_equally_sharded_moves_the_tensor_once():
    for mesh, spec in [((1, 4), "RS1"), ((2, 1), "S0R"), ((2, 2), "S0S1"), ((2, 2), "S01R"), ((4, 1), "RS0")]:
        n = math.prod(mesh)
        r = cross_mesh_resharding((8, 8), "float16", spec, mesh, range(n), spec, mesh, range(n, 2 * n))
        assert r.total_bytes == 8 * 8 * 2
        assert all(len(t.receivers) == 1 and len(t.senders) == 1 for t in r.tasks)


def test_hand_computed_cases():
    # rows split on 2 devices -> columns split on 2 others: each receiver gets a quarter from each sender
    r = cross_mesh_resharding((4, 6), "float32", "S0R", (2, 1), (0, 1), "RS0", (2, 1), (2, 3))
    assert [(t.region, t.senders, t.receivers) for t in r.tasks] == [
        (((0, 2), (0, 3)), (0,), (2,)), (((0, 2), (3, 6)), (0,), (3,)),
        (((2, 4), (0, 3)), (1,), (2,)), (((2, 4), (3, 6)), (1,), (3,)),
    ]
    assert r.total_bytes == 4 * 6 * 4 and r.bytes_by_pair() == {(0, 2): 24, (0, 3): 24, (1, 2): 24, (1, 3): 24}
    # S1 on 1x2 -> S1 on 1x4: each destination tile is half a source tile
    r = cross_mesh_resharding((2, 8), "int32", "RS1", (1, 2), (0, 1), "RS1", (1, 4), (4, 5, 6, 7))
    assert r.bytes_by_pair() == {(0, 4): 16, (0, 5): 16, (1, 6): 16, (1, 7): 16}
    # the same devices, rows split -> replicated: each device lacks the other's half (an all-gather)
    r = cross_mesh_resharding((4, 2), "float32", "S1R", (1, 2), (0, 1), "RR", (1, 2), (0, 1))
    assert r.bytes_by_pair() == {(1, 0): 16, (0, 1): 16}
    # a scalar, replicated on 1x2 -> on devices (1, 2): device 1 has it, device 2 gets it
    r = cross_mesh_resharding((), "float32", "-", (1, 2), (0, 1), "-", (2, 1), (1, 2))
    assert r.total_bytes == 4 and r.tasks[0].assignment == ((1, 1), (0, 2))


def test_a_transfer_between_hosts_gets_the_hosts_network_link_where_devices_share_one_nic():
    """A p3.16xlarge has one 25 Gbit/s NIC for its 8 V100s (AWS's figure). A collective across hosts sends from all
    8 at once, each at an eighth of it (the mesh's beta: unchanged); one transfer between two hosts' stages has the
    whole link: 100 MB in 32 ms, not 256 ms. Presets whose devices have their own NICs (DGX) and local or calibrated
    clusters (whose calibration measures one transfer) keep one figure for both."""
    from alpa_lab.passes.pipeline import link_bandwidths

    p3 = al.ClusterSpec.preset("p3.16xlarge", hosts=2)
    nic = 25e9 / 8
    assert p3.host_link == pytest.approx(nic) and p3.inter_host_bandwidth == pytest.approx(nic / 8)
    assert p3.logical_mesh((2, 8)).beta[0] == pytest.approx(8 / nic)  # a collective's devices share the NIC
    r = cross_mesh_resharding((25_000_000,), "float32", "S1", (1, 8), tuple(range(8)), "S1", (1, 8), tuple(range(8, 16)),
                              devices_per_host=8)
    assert r.inter_host_bytes(8) == 100_000_000
    assert r.cost(p3) == pytest.approx(100e6 / nic + p3.inter_host_latency)

    class Placed:  # two stages' devices, as a placed stage gives them
        def __init__(self, ids):
            self.device_ids = ids

    assert link_bandwidths(p3, [Placed((0, 1)), Placed((2, 3)), Placed((8, 9))]) == [p3.intra_host_bandwidth, p3.host_link]
    for c in (al.ClusterSpec.preset("dgx-a100", hosts=2), al.ClusterSpec.local(2, 4)):
        assert c.host_link == c.inter_host_bandwidth and "host_link_bandwidth" not in c.to_dict()
    assert al.ClusterSpec(**p3.to_dict()) == p3  # a plan's record of its cluster keeps the link
    # a calibration measures one transfer between hosts as inter_host_bandwidth: a preset's link goes with it
    from alpa_lab.cost.calibrate import Calibration

    measured = Calibration("gpu", 16, 1e14, 9e11, 1e-6, 1e-5, 1e11, 1e-6, inter_host_bandwidth=1e10).apply(p3)
    assert measured.host_link == measured.inter_host_bandwidth == 1e10
    with pytest.raises(al.ClusterError, match="host_link_bandwidth must be positive"):
        dataclasses.replace(p3, host_link_bandwidth=0.0)


def test_the_greedy_prefers_a_sender_on_the_receivers_host_and_balances_load():
    # replicas on both hosts: each receiver is fed from its own host
    r = cross_mesh_resharding((4,), "float32", "R", (1, 2), (0, 4), "R", (1, 2), (1, 5), devices_per_host=4)
    assert r.bytes_by_pair() == {(0, 1): 16, (4, 5): 16} and r.inter_host_bytes(4) == 0
    # four equal unit tasks, two replicas: two each
    r = cross_mesh_resharding((8,), "float32", "R", (1, 2), (0, 1), "S1", (1, 4), (2, 3, 4, 5))
    assert r.sent_bytes() == {0: 16, 1: 16}


def test_cost_is_the_host_link_schedule_with_intra_host_chains_overlapped():
    cluster = al.ClusterSpec.local(hosts=2, devices_per_host=4)
    # device 0 holds 1 KB that 1 and 2 (same host) and 4 (the other host) need: a chain 0 -> 1 -> 2
    # on NVLink, and one network transfer 0 -> host 1, at the same time
    r = cross_mesh_resharding((256,), "float32", "R", (1, 1), (0,), "R", (1, 3), (1, 2, 4), devices_per_host=4)
    assert r.bytes_by_pair() == {(0, 1): 1024, (1, 2): 1024, (0, 4): 1024}
    assert [(x.sender_host, x.receiver_host, x.start, x.end) for x in r.schedule] == [(0, 1, 0.0, 1024.0)]
    expect = max(1024 / cluster.inter_host_bandwidth, 1024 / cluster.intra_host_bandwidth) + cluster.inter_host_latency
    assert r.cost(cluster) == pytest.approx(expect)
    # point to point: the same, but device 0 feeds 1 and 2 itself (2 KB over its NVLink)
    p = cross_mesh_resharding((256,), "float32", "R", (1, 1), (0,), "R", (1, 3), (1, 2, 4), devices_per_host=4, method="send_recv")
    expect = max(1024 / cluster.inter_host_bandwidth, 2048 / cluster.intra_host_bandwidth) + cluster.inter_host_latency
    assert p.cost(cluster) == pytest.approx(expect)
    same = cross_mesh_resharding((256,), "float32", "R", (1, 1), (0,), "R", (1, 1), (0,))
    assert same.total_bytes == 0 and same.cost(cluster) == 0.0


# ----- against jax.device_put between two sub-meshes ------------------------------------------
def test_device_put_between_sub_meshes_delivers_what_the_unit_tasks_say():
    rng = random.Random(7)
    all_devices = jax.devices()
    assert len(all_devices) >= 8, "tests/conftest.py gives this process 8 simulated devices"

    def sharding(spec, mesh_shape, devices):
        mesh = Mesh(np.array([all_devices[d] for d in devices], dtype=object).reshape(mesh_shape), ("x", "y"))
        return NamedSharding(mesh, spec.to_partition_spec())

    for _ in range(25):
        shape, src_spec, src_mesh, src, dst_spec, dst_mesh, dst = random_case(rng, overlap=False)
        x = np.random.default_rng(0).integers(-1000, 1000, size=shape).astype(np.int32)
        on_src = jax.device_put(x, sharding(src_spec, src_mesh, src))
        on_dst = jax.device_put(on_src, sharding(dst_spec, dst_mesh, dst))
        r = cross_mesh_resharding(shape, "int32", src_spec, src_mesh, src, dst_spec, dst_mesh, dst)
        src_shards = {s.device.id: s for s in on_src.addressable_shards}
        dst_shards = {s.device.id: s for s in on_dst.addressable_shards}
        assert set(src_shards) == set(src) and set(dst_shards) == set(dst)
        for shards, spec, mesh_shape, devices in ((src_shards, src_spec, src_mesh, src), (dst_shards, dst_spec, dst_mesh, dst)):
            tiles = tile_regions(shape, spec, mesh_shape, devices)
            for d, shard in shards.items():
                assert box(shard.index, shape) == tiles[d], f"device {d}: JAX holds {box(shard.index, shape)}, the module says {tiles[d]}"
        for t in r.tasks:  # the sender holds the region's data, and the receiver ends up with it
            for s, rcv in t.assignment:
                for shard in (src_shards[s], dst_shards[rcv]):
                    offset = [a for a, _ in box(shard.index, shape)]
                    local = tuple(slice(a - o, b - o) for (a, b), o in zip(t.region, offset))
                    np.testing.assert_array_equal(np.asarray(shard.data)[local], x[t.slices])


def box(index: tuple[slice, ...], shape) -> tuple[tuple[int, int], ...]:
    """A shard's numpy index as [start, stop) per axis."""
    return tuple((sl.start or 0, n if sl.stop is None else sl.stop) for sl, n in zip(index, shape))


# ----- a planned pipeline's transfers -----------------------------------------------------------
@pytest.fixture(scope="module")
def pipeline():
    """GPT, 4 layers on 2x4 devices, 4 micro-batches: the DP's plan and its compiled runtime."""
    ex = tiny_example("gpt")
    step = al.parallelize(ex.train_step, cluster=al.ClusterSpec.local(2, 4), microbatches=4, layers=4)
    plan = step.plan(*ex.args)
    assert plan.num_stages >= 2
    return plan, step.compiled(*ex.args), pipeline_transfers(plan)


def test_every_tensor_crossing_stages_is_a_transfer(pipeline):
    plan, _, transfers = pipeline
    graph, sl = plan.problem.graph, plan.problem.slicing
    stage_of_layer = {lay: st.index for st in plan.stages for lay in range(*st.layers)}
    expect = set()
    for op in graph.ops:
        dst = stage_of_layer[sl.layer[op.index]]
        for v in op.inputs:
            p = graph.vars[v].producer
            if p is not None and stage_of_layer[sl.layer[p]] != dst:
                expect.add((v, stage_of_layer[sl.layer[p]], dst, sl.phase[op.index] == APPLY))
    # new state made on one stage and read on another next step (GPT's tied embedding): the step returns the state first
    n = len(jax.tree_util.tree_leaves(tiny_example("gpt").state))
    for o, v in zip(graph.outvars[:n], graph.invars[:n]):
        p = graph.vars[o].producer
        if p is None:
            continue
        for op in graph.ops:
            if v in op.inputs and stage_of_layer[sl.layer[op.index]] != stage_of_layer[sl.layer[p]]:
                expect.add((v, stage_of_layer[sl.layer[p]], stage_of_layer[sl.layer[op.index]], True))
    assert any(t.phase == "state" for t in transfers), "the tied embedding's new value moves between stages"
    got = [(t.var, t.src_stage, t.dst_stage, not t.per_microbatch) for t in transfers]
    assert len(got) == len(set(got)), "a tensor moves once per destination stage (and per step or micro-batch)"
    assert set(got) == expect
    assert {t.phase for t in transfers} >= {FORWARD, BACKWARD}
    for t in transfers:
        if t.phase == FORWARD:
            assert t.src_stage < t.dst_stage, t
        elif t.phase == BACKWARD:
            assert t.src_stage > t.dst_stage, t
        assert (t.shape, t.dtype) == (graph.vars[t.var].shape, graph.vars[t.var].dtype)


def test_transfer_specs_and_meshes_are_the_stage_plans(pipeline):
    plan, _, transfers = pipeline
    graph = plan.problem.graph
    made_as = dict((v, o) for o, v in zip(graph.outvars, graph.invars))  # a state argument -> its new value
    for t in transfers:
        a, b = plan.stages[t.src_stage], plan.stages[t.dst_stage]
        made = made_as[t.var] if t.phase == "state" else t.var
        producer = graph.ops[graph.vars[made].producer]
        assert t.name == (graph.in_paths[graph.invars.index(t.var)] if t.phase == "state" else cross_path(graph, t.var))
        src_spec = a.plan.op(producer.name).output_specs[producer.outputs.index(made)]
        dst_spec = {x.path: x.spec for x in b.plan.inputs}[t.name]
        r = t.resharding
        assert (str(r.src_spec), str(r.dst_spec)) == (src_spec, dst_spec)
        assert (r.src_mesh_shape, r.src_devices) == (a.logical_shape, a.device_ids)
        assert (r.dst_mesh_shape, r.dst_devices) == (b.logical_shape, b.device_ids)


def test_transfers_are_what_the_runtime_moves(pipeline):
    """The compiled pipeline's unit tasks read each crossing tensor with the transfer's target sharding."""
    plan, compiled, transfers = pipeline
    graph = plan.problem.graph
    by_key = {(t.var, t.dst_stage, not t.per_microbatch): t for t in transfers if t.phase != "state"}  # state: placed
    seen = set()
    for task in list(compiled.tasks.values()) + list(compiled.update):
        for v, sh in zip(task.invars, task.in_shardings):
            p = graph.vars[v].producer
            if p is None or compiled.stage_of_op[p] == task.stage:
                continue
            t = by_key[(v, task.stage, task.phase == APPLY)]
            seen.add((v, task.stage, task.phase == APPLY))
            assert ShardingSpec.from_partition_spec(sh.spec, len(t.shape)) == t.resharding.dst_spec
            assert tuple(d.id for d in sh.mesh.devices.reshape(-1)) == t.resharding.dst_devices
            assert sh.mesh.devices.shape == t.resharding.dst_mesh_shape
    assert seen == set(by_key)


def test_pipeline_bytes_per_microbatch_and_per_step(pipeline):
    plan, _, transfers = pipeline
    graph, M = plan.problem.graph, plan.num_microbatches
    per_mb = [t for t in transfers if t.per_microbatch]
    # disjoint sub-meshes: every destination device receives its whole tile
    for t in transfers:
        b = plan.stages[t.dst_stage]
        dst = ShardingSpec.parse({x.path: x.spec for x in b.plan.inputs}[t.name])
        assert t.nbytes == graph.vars[t.var].nbytes // dst.num_shards(b.logical_shape) * len(b.device_ids)
    assert sum(t.nbytes for t in per_mb) == sum(r.total_bytes for r in (t.resharding for t in per_mb)) > 0
    traffic = stage_traffic(transfers, M)
    assert sum(traffic.values()) == M * sum(t.nbytes for t in per_mb) + sum(t.nbytes for t in transfers if not t.per_microbatch)
    hosts = host_traffic(transfers, M, devices_per_host=4)
    assert sum(hosts.values()) == sum(traffic.values())
    # between sub-meshes on disjoint hosts every byte crosses hosts; inside one host none does
    host_sets = [{d // 4 for d in st.device_ids} for st in plan.stages]
    for t in transfers:
        a, b = host_sets[t.src_stage], host_sets[t.dst_stage]
        if not a & b:
            # broadcast: each region enters a receiving host once, whatever number of its devices need it
            r = t.resharding
            need: dict[int, int] = {}
            for u in r.tasks:
                for h in {d // 4 for d in u.receivers}:
                    need[h] = need.get(h, 0) + u.nbytes
            assert r.inter_host_bytes_into(4) == need
            assert r.inter_host_bytes(4) == sum(need.values()) <= t.nbytes
        elif len(a | b) == 1:
            assert t.resharding.inter_host_bytes(4) == 0
    assert any(not host_sets[t.src_stage] & host_sets[t.dst_stage] for t in transfers), "the plan should cross hosts"
    for t in transfers:
        assert t.resharding.cost(plan.problem.cluster) > 0


def test_a_plan_without_planner_state_has_no_transfers(pipeline):
    import dataclasses

    plan = dataclasses.replace(pipeline[0], problem=None)
    with pytest.raises(PlanFormatError, match="planner state"):
        pipeline_transfers(plan)


# ----- bad input ------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "args, match",
    [
        (((4, 4), "S0", (2, 2), range(4), "RR", (2, 2), range(4, 8)), r"source spec S0 has 1 entries but .* shape \(4, 4\) has rank 2"),
        (((4, 4), "RR", (2, 2), range(4), "S0RR", (2, 2), range(4, 8)), "destination spec S0RR has 3 entries"),
        (((6, 4), "S01R", (2, 2), range(4), "RR", (2, 2), range(4, 8)), "source spec S01R splits tensor axis 0 \\(size 6\\) into 4 parts"),
        (((4, 4), "RS1", (4,), range(4), "RR", (2, 2), range(4, 8)), r"source spec RS1 splits over mesh axis 1 but the mesh \(4,\) has 1"),
        (((4, 4), "RR", (2, 2), range(3), "RR", (2, 2), range(4, 8)), "source mesh \\(2, 2\\) holds 4 devices but 3"),
        (((4, 4), "RR", (1, 2), (0, 0), "RR", (2, 2), range(4, 8)), "source mesh device ids \\(0, 0\\) repeat"),
        (((4, 4), "RR", (2, 2), range(4), "S2R", (2, 2), range(4, 8)), "cannot parse sharding spec 'S2R'"),
    ],
)
def test_bad_input_is_refused_with_a_clear_error(args, match):
    with pytest.raises(ShardingSpecError, match=match):
        cross_mesh_resharding(args[0], "float32", *args[1:])
    assert issubclass(ShardingSpecError, ValueError)


def test_every_valid_spec_pair_on_a_small_case_moves_each_tile():
    """All pairs of specs of a 2-D tensor between 2x2 meshes: bytes = replication x tensor when disjoint."""
    shape = (4, 4)
    for a, b in itertools.product(enumerate_specs(shape, (2, 2)), repeat=2):
        r = cross_mesh_resharding(shape, "float32", a, (2, 2), range(4), b, (2, 2), range(4, 8))
        assert r.total_bytes == 64 * b.replication((2, 2))


# ----- broadcast-based resharding and its schedule on the paper's Table 2 (MLSys'23 sec. 5.1.2) --------
# (send spec, recv spec, send mesh, recv mesh, devices per host). Senders on the first hosts, receivers
# on the next ones (disjoint). Case 4 is printed like case 3 in the paper but "schedules 64 unit tasks":
# RS01R -> S01RR has 64. Case 5's "S_0RR" is read as S0RR. Case 6's axis 0 (96) divides by 3 (the paper
# pads). Case 8 uses 2 devices per host: senders on hosts 0-2, receivers on hosts 3-5.
TABLE2 = {
    1: ("S0RR", "S0RR", (2, 4), (2, 4), 4),
    2: ("RRR", "S0RR", (2, 4), (2, 4), 4),
    3: ("RS0R", "S0RR", (2, 4), (2, 4), 4),
    4: ("RS01R", "S01RR", (2, 4), (2, 4), 4),
    5: ("S1RR", "S0RR", (2, 4), (2, 4), 4),
    6: ("S0RR", "S0RR", (2, 4), (3, 4), 4),
    7: ("S1RR", "RRR", (1, 4), (2, 4), 4),
    8: ("RRR", "RRR", (2, 3), (3, 2), 2),
    9: ("RS0R", "RRS0", (2, 4), (2, 4), 4),
}
TABLE2_SHAPE = (96, 64, 32)


def table2_case(case, method="broadcast", order="search"):
    ss, ds, sm, dm, dph = TABLE2[case]
    n_src, n_dst = math.prod(sm), math.prod(dm)
    start = -(-n_src // dph) * dph
    src, dst = list(range(n_src)), list(range(start, start + n_dst))
    r = cross_mesh_resharding(TABLE2_SHAPE, "float32", ss, sm, src, ds, dm, dst, devices_per_host=dph, method=method, order=order)
    return r, (ss, sm, src), (ds, dm, dst), dph


def numpy_tiles(shape, spec: str, mesh_shape, devices) -> dict[int, np.ndarray]:
    """Device id -> mask of its tile, from the spec's definition (tensor axis split over the listed mesh
    axes, major first), independent of the module (and of JAX, whose 8 test devices are too few here)."""
    spec = ShardingSpec.parse(spec)
    out = {}
    for pos, d in enumerate(devices):
        coord = np.unravel_index(pos, mesh_shape)
        idx = []
        for size, axes in zip(shape, spec.dims):
            parts, block = 1, 0
            for a in axes:
                block = block * mesh_shape[a] + int(coord[a])
                parts *= mesh_shape[a]
            step = size // parts
            idx.append(slice(block * step, (block + 1) * step))
        mask = np.zeros(shape, dtype=bool)
        mask[tuple(idx)] = True
        out[d] = mask
    return out


def independent_bounds(shape, src_side, dst_side, dph, itemsize=4):
    """Per receiving host, the bytes it must receive over the network (every element some device of it
    needs and no source device of it holds, once); and the makespan bound in byte time: the busiest
    receiving host, or the busiest sender host counting the elements only that host holds."""
    src_tiles = numpy_tiles(shape, *src_side)
    dst_tiles = numpy_tiles(shape, *dst_side)
    hosts_src = sorted({d // dph for d in src_tiles})
    held = {h: np.logical_or.reduce([m for d, m in src_tiles.items() if d // dph == h]) for h in hosts_src}
    into = {}
    for h in sorted({d // dph for d in dst_tiles}):
        need = np.logical_or.reduce([m for d, m in dst_tiles.items() if d // dph == h])
        if h in held:
            need &= ~held[h]
        into[h] = int(need.sum()) * itemsize
    holders = sum(held[h].astype(int) for h in hosts_src)
    send_bound = 0
    for s in hosts_src:
        only_s = held[s] & (holders == 1)
        n = sum(int((np.logical_or.reduce([m for d, m in dst_tiles.items() if d // dph == h]) & only_s).sum()) for h in into if h != s)
        send_bound = max(send_bound, n * itemsize)
    return into, float(max(max(into.values()), send_bound))


def check_schedule(r, dph, broadcast=True):
    """The schedule is feasible: none overlapping on a sender host's or a receiver host's link, from a
    device holding the region, into the chain's host; broadcast: one transfer per (unit task, receiving
    host lacking it); send_recv: one per (unit task, receiver device off the sender's host)."""
    seen = set()
    busy = {}
    for x in r.schedule:
        t = r.tasks[x.task]
        assert x.end - x.start == t.nbytes and x.start >= 0
        assert x.sender in t.senders and x.sender // dph == x.sender_host != x.receiver_host
        assert all(d // dph == x.receiver_host and d in t.receivers for d in x.receivers)
        key = (x.task, x.receiver_host) if broadcast else (x.task, x.receivers)
        assert key not in seen
        seen.add(key)
        for link in (("send", x.sender_host), ("recv", x.receiver_host)):
            for a, b in busy.get(link, []):
                assert x.end <= a or x.start >= b, f"{link} carries two transfers at once"
            busy.setdefault(link, []).append((x.start, x.end))
    if broadcast:
        expect = {(k, d // dph) for k, t in enumerate(r.tasks) for d in t.receivers
                  if not any(s // dph == d // dph for s in t.senders)}
    else:
        expect = {(k, (d,)) for k, t in enumerate(r.tasks) for s, d in t.assignment if s // dph != d // dph}
    assert seen == expect
    assert r.makespan == max(x.end for x in r.schedule)


@pytest.mark.parametrize("case", sorted(TABLE2))
def test_table2_broadcast_brings_each_region_once_into_each_receiving_host(case):
    r, src_side, dst_side, dph = table2_case(case)
    p2p, *_ = table2_case(case, method="send_recv", order="naive")
    into, _ = independent_bounds(TABLE2_SHAPE, src_side, dst_side, dph)
    assert r.inter_host_bytes_into(dph) == into
    # point to point brings a region into a host once per device of it that needs it
    ratio = {h: p2p.inter_host_bytes_into(dph)[h] / n for h, n in into.items()}
    expect = {8: 2.0, 4: 1.0}.get(case, 4.0)  # case 8: 2 receivers per host; case 4: one receiver per region
    assert all(v == pytest.approx(expect) for v in ratio.values()), ratio
    # the same data reaches the same devices either way
    assert r.total_bytes == p2p.total_bytes
    check_schedule(r, dph)
    check_schedule(p2p, dph, broadcast=False)


@pytest.mark.parametrize("case", sorted(TABLE2))
def test_table2_ordering_reaches_the_lower_bound(case):
    r, src_side, dst_side, dph = table2_case(case)
    _, bound = independent_bounds(TABLE2_SHAPE, src_side, dst_side, dph)
    assert r.makespan >= bound - 1e-9
    if case in (3, 4, 9):
        assert r.makespan <= 1.05 * bound
    assert r.makespan == pytest.approx(bound)  # in fact every case reaches it


def test_table2_broadcast_and_ordering_beat_point_to_point_in_naive_order():
    cluster = al.ClusterSpec.local(hosts=6, devices_per_host=4)
    factors = {}
    for case in sorted(TABLE2):
        r, *_ , dph = table2_case(case)
        p2p, *_ = table2_case(case, method="send_recv", order="naive")
        factors[case] = p2p.makespan / r.makespan
        if dph == cluster.devices_per_host:
            assert r.cost(cluster) < p2p.cost(cluster)
    print("send/recv (naive order) makespan / broadcast+ordering makespan:", {k: round(v, 2) for k, v in factors.items()})
    # the paper reports 3-10x on cases 3, 4 and 9; in this model cases 3 and 9 give 6x; case 4 (one
    # receiver per region, so no fewer bytes) gains from the order only: 1.88x
    assert factors[3] >= 5 and factors[9] >= 5 and factors[4] >= 1.8
    assert all(v >= 1 for v in factors.values())


def brute_force_makespan(jobs):
    """Exhaustive: every order of the transfers and every sender host of each, list-scheduled."""
    best = math.inf
    for perm in itertools.permutations(range(len(jobs))):
        for hosts in itertools.product(*(jobs[j][0] for j in perm)):
            free_s, free_r, end = {}, {}, 0.0
            for j, h in zip(perm, hosts):
                _, r, n = jobs[j]
                start = max(free_s.get(h, 0.0), free_r.get(r, 0.0))
                free_s[h] = free_r[r] = start + n
                end = max(end, start + n)
            best = min(best, end)
    return best


def test_the_search_finds_the_exhaustive_best_makespan_on_small_cases():
    rng = random.Random(11)
    checked = 0
    while checked < 25:
        shape, src_spec, src_mesh, src, dst_spec, dst_mesh, dst = random_case(rng, overlap=rng.random() < 0.3)
        dph = rng.choice([1, 2])
        r = cross_mesh_resharding(shape, "float32", src_spec, src_mesh, src, dst_spec, dst_mesh, dst, devices_per_host=dph)
        # the transfers, from the unit tasks: into each host lacking the region, from any host holding it
        jobs = []
        for t in r.tasks:
            have = tuple(sorted({s // dph for s in t.senders}))
            for h in sorted({d // dph for d in t.receivers} - set(have)):
                jobs.append((have, h, t.nbytes))
        if not 2 <= len(jobs) <= 5 or math.prod(len(c) for c, _, _ in jobs) > 64:
            continue
        assert r.makespan == brute_force_makespan(jobs), (shape, src_spec, src_mesh, src, dst_spec, dst_mesh, dst, dph)
        checked += 1


def test_branch_and_bound_alone_equals_exhaustive_search():
    """The DFS with pruning, started with no incumbent, on random transfers of unequal sizes."""
    from alpa_lab.sharding.cross_mesh import _branch_and_bound, _Job

    rng = random.Random(5)
    for _ in range(40):
        n = rng.randint(2, 5)
        jobs = [
            _Job(k, rng.choice([1, 2, 3, 5]), tuple(sorted(rng.sample(range(3), rng.randint(1, 2)))), rng.randint(3, 5), (0,))
            for k in range(n)
        ]
        order, t, exact = _branch_and_bound(jobs, math.inf, 0.0, 10**7, math.inf)
        assert exact
        assert t == brute_force_makespan([(j.candidates, j.receiver_host, j.nbytes) for j in jobs])
        # the order it returns achieves it
        assert max(e for _, e in list_schedule([(h, jobs[j].receiver_host, jobs[j].nbytes) for j, h in order])) == t
