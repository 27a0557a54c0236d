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
from alpa_lab.sharding.cross_mesh import cross_mesh_resharding, tile_regions
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
            for s, rcv in t.assignment:
                assert (src_tiles[s] | ~m).all(), f"{what}: sender {s} lacks {t.region}"
                if rcv in t.senders:  # it holds the region already: a local copy, never traffic
                    assert s == rcv, what
                    saw_local_copy = True
                elif any(x // DEVICES_PER_HOST == rcv // DEVICES_PER_HOST for x in t.senders):
                    assert s // DEVICES_PER_HOST == rcv // DEVICES_PER_HOST, f"{what}: a same-host sender was passed over"
                received[rcv] += m
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


def test_the_greedy_prefers_a_sender_on_the_receivers_host_and_balances_load():
    # replicas on both hosts: each receiver is fed from its own host
    r = cross_mesh_resharding((4,), "float32", "R", (1, 2), (0, 4), "R", (1, 2), (1, 5), devices_per_host=4)
    assert r.bytes_by_pair() == {(0, 1): 16, (4, 5): 16} and r.inter_host_bytes(4) == 0
    # four equal unit tasks, two replicas: two each
    r = cross_mesh_resharding((8,), "float32", "R", (1, 2), (0, 1), "S1", (1, 4), (2, 3, 4, 5))
    assert r.sent_bytes() == {0: 16, 1: 16}


def test_cost_is_the_busiest_device_over_its_link():
    cluster = al.ClusterSpec.local(hosts=2, devices_per_host=4)
    # device 0 sends 1 KB to 1 and 2 (same host) and to 4 (the other host)
    r = cross_mesh_resharding((256,), "float32", "R", (1, 1), (0,), "R", (1, 3), (1, 2, 4), devices_per_host=4)
    expect = 2 * 1024 / cluster.intra_host_bandwidth + 1024 / cluster.inter_host_bandwidth + cluster.inter_host_latency
    assert r.cost(cluster) == pytest.approx(expect)
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
    for t in transfers:
        a, b = plan.stages[t.src_stage], plan.stages[t.dst_stage]
        producer = graph.ops[graph.vars[t.var].producer]
        assert t.name == cross_path(graph, t.var)
        src_spec = a.plan.op(producer.name).output_specs[producer.outputs.index(t.var)]
        dst_spec = {x.path: x.spec for x in b.plan.inputs}[t.name]
        r = t.resharding
        assert (str(r.src_spec), str(r.dst_spec)) == (src_spec, dst_spec)
        assert (r.src_mesh_shape, r.src_devices) == (a.logical_shape, a.device_ids)
        assert (r.dst_mesh_shape, r.dst_devices) == (b.logical_shape, b.device_ids)


def test_transfers_are_what_the_runtime_moves(pipeline):
    """The compiled pipeline's unit tasks read each crossing tensor with the transfer's target sharding."""
    plan, compiled, transfers = pipeline
    graph = plan.problem.graph
    by_key = {(t.var, t.dst_stage, not t.per_microbatch): t for t in transfers}
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
            assert t.resharding.inter_host_bytes(4) == t.nbytes
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
