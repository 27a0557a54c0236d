"""Sharding specs (Alpa paper, sec. 4.1, Table 1).

Two references: the tile maps of Table 1 written out by hand, and JAX itself (``device_put``
with the ``NamedSharding`` the spec converts to), which says which slice each device holds.
"""

import itertools

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from alpa_lab.sharding.spec import ShardingSpec, ShardingSpecError, enumerate_specs

S = ShardingSpec.parse

# --------------------------------------------------------------------------------------
# Table 1, by hand.  For each spec: (number of row blocks, number of column blocks) and, for
# each device (i, j) of a 2x2 mesh, the (row block, column block) it holds.
# --------------------------------------------------------------------------------------
TABLE1_2x2 = {
    "RR": ((1, 1), {(0, 0): (0, 0), (0, 1): (0, 0), (1, 0): (0, 0), (1, 1): (0, 0)}),
    # rows split over mesh axis 0: row i of the mesh holds row block i
    "S0R": ((2, 1), {(0, 0): (0, 0), (0, 1): (0, 0), (1, 0): (1, 0), (1, 1): (1, 0)}),
    # rows split over mesh axis 1: column j of the mesh holds row block j
    "S1R": ((2, 1), {(0, 0): (0, 0), (0, 1): (1, 0), (1, 0): (0, 0), (1, 1): (1, 0)}),
    "RS0": ((1, 2), {(0, 0): (0, 0), (0, 1): (0, 0), (1, 0): (0, 1), (1, 1): (0, 1)}),
    "RS1": ((1, 2), {(0, 0): (0, 0), (0, 1): (0, 1), (1, 0): (0, 0), (1, 1): (0, 1)}),
    # device (i, j) holds block (i, j)
    "S0S1": ((2, 2), {(0, 0): (0, 0), (0, 1): (0, 1), (1, 0): (1, 0), (1, 1): (1, 1)}),
    # device (i, j) holds block (j, i)
    "S1S0": ((2, 2), {(0, 0): (0, 0), (0, 1): (1, 0), (1, 0): (0, 1), (1, 1): (1, 1)}),
    # rows in 4 blocks, mesh axis 0 major: device (i, j) holds row block 2i + j
    "S01R": ((4, 1), {(0, 0): (0, 0), (0, 1): (1, 0), (1, 0): (2, 0), (1, 1): (3, 0)}),
    # columns in 4 blocks: device (i, j) holds column block 2i + j
    "RS01": ((1, 4), {(0, 0): (0, 0), (0, 1): (0, 1), (1, 0): (0, 2), (1, 1): (0, 3)}),
    # mesh axis 1 major: device (i, j) holds row block 2j + i
    "S10R": ((4, 1), {(0, 0): (0, 0), (0, 1): (2, 0), (1, 0): (1, 0), (1, 1): (3, 0)}),
}

TABLE1_1D = {
    # 1x4 mesh: only mesh axis 1 splits
    ((1, 4), "RR"): ((1, 1), {(0, 0): (0, 0), (0, 1): (0, 0), (0, 2): (0, 0), (0, 3): (0, 0)}),
    ((1, 4), "S1R"): ((4, 1), {(0, 0): (0, 0), (0, 1): (1, 0), (0, 2): (2, 0), (0, 3): (3, 0)}),
    ((1, 4), "RS1"): ((1, 4), {(0, 0): (0, 0), (0, 1): (0, 1), (0, 2): (0, 2), (0, 3): (0, 3)}),
    # 4x1 mesh: only mesh axis 0 splits
    ((4, 1), "S0R"): ((4, 1), {(0, 0): (0, 0), (1, 0): (1, 0), (2, 0): (2, 0), (3, 0): (3, 0)}),
    ((4, 1), "RS0"): ((1, 4), {(0, 0): (0, 0), (1, 0): (0, 1), (2, 0): (0, 2), (3, 0): (0, 3)}),
    ((4, 1), "RR"): ((1, 1), {(0, 0): (0, 0), (1, 0): (0, 0), (2, 0): (0, 0), (3, 0): (0, 0)}),
}

SHAPE = (8, 16)


def expected_slices(shape, grid, block):
    rows, cols = shape[0] // grid[0], shape[1] // grid[1]
    return (slice(block[0] * rows, (block[0] + 1) * rows), slice(block[1] * cols, (block[1] + 1) * cols))


def check_table(spec_text, mesh_shape, grid, blocks):
    spec = S(spec_text)
    assert spec.is_valid_for(SHAPE, mesh_shape)
    tiles = spec.tile_map(SHAPE, mesh_shape)
    assert set(tiles) == set(blocks) == set(itertools.product(*(range(n) for n in mesh_shape)))
    for device, block in blocks.items():
        assert spec.tile_index(device, mesh_shape) == block, (spec_text, device)
        assert tiles[device] == expected_slices(SHAPE, grid, block), (spec_text, device)
    assert spec.tile_shape(SHAPE, mesh_shape) == (SHAPE[0] // grid[0], SHAPE[1] // grid[1])
    assert spec.num_shards(mesh_shape) == grid[0] * grid[1]
    assert spec.replication(mesh_shape) == 4 // (grid[0] * grid[1])
    # every distinct tile is held by the same number of devices, and the tiles cover the tensor
    assert len(set(blocks.values())) == grid[0] * grid[1]


@pytest.mark.parametrize("spec_text", list(TABLE1_2x2))
def test_table1_tiles_2x2(spec_text):
    grid, blocks = TABLE1_2x2[spec_text]
    check_table(spec_text, (2, 2), grid, blocks)


@pytest.mark.parametrize("key", list(TABLE1_1D), ids=lambda k: f"{k[0][0]}x{k[0][1]}-{k[1]}")
def test_table1_tiles_1d(key):
    mesh_shape, spec_text = key
    grid, blocks = TABLE1_1D[key]
    check_table(spec_text, mesh_shape, grid, blocks)


# --------------------------------------------------------------------------------------
# Independent oracle: JAX's placement of the NamedSharding the spec converts to.
# --------------------------------------------------------------------------------------
def _norm(index, shape):
    return tuple(range(*s.indices(n)) for s, n in zip(index, shape))


@pytest.mark.parametrize(
    "mesh_shape,shape",
    [((2, 2), (8, 16)), ((2, 4), (8, 16)), ((1, 4), (8, 16)), ((4, 1), (8, 16)), ((2, 4), (4, 8, 16))],
    ids=str,
)
def test_tiles_match_jax_placement(mesh_shape, shape):
    n = int(np.prod(mesh_shape))
    mesh = Mesh(np.array(jax.devices()[:n]).reshape(mesh_shape), ("x", "y"))
    coord_of = {d: tuple(int(c) for c in np.argwhere(mesh.devices == d)[0]) for d in mesh.devices.flat}
    x = np.arange(int(np.prod(shape)), dtype=np.float32).reshape(shape)
    specs = enumerate_specs(shape, mesh_shape, allow_major_minor_swap=True)
    assert specs
    for spec in specs:
        arr = jax.device_put(x, NamedSharding(mesh, spec.to_partition_spec()))
        tiles = spec.tile_map(shape, mesh_shape)
        shards = arr.addressable_shards
        assert len(shards) == n
        for shard in shards:
            coord = coord_of[shard.device]
            assert _norm(shard.index, shape) == _norm(tiles[coord], shape), (str(spec), coord)
            np.testing.assert_array_equal(np.asarray(shard.data), x[tiles[coord]])


# --------------------------------------------------------------------------------------
# Parsing, printing, conversion, errors
# --------------------------------------------------------------------------------------
@pytest.mark.parametrize("text", ["RR", "S0R", "RS1", "S0S1", "S1S0", "S01R", "RS10", "S0RS1", "R", "S01", "RRR", "-"])
def test_parse_str_round_trip(text):
    spec = S(text)
    assert str(spec) == text
    assert S(str(spec)) == spec


def test_parse_structure():
    assert S("S0R").dims == ((0,), ())
    assert S("RS01").dims == ((), (0, 1))
    assert S("S10R").dims == ((1, 0), ())
    assert S("S0RS1").dims == ((0,), (), (1,))
    assert S(" S0S1 ").dims == ((0,), (1,))
    assert S("-").rank == 0 and S("").rank == 0
    assert ShardingSpec.replicated(3) == S("RRR")
    assert S("S1S0").mesh_axes_used == (1, 0)
    assert repr(S("S0R")) == "ShardingSpec(S0R)"


def test_partition_spec_conversion():
    assert S("S0R").to_partition_spec() == PartitionSpec("x", None)
    assert S("RS1").to_partition_spec() == PartitionSpec(None, "y")
    assert S("S01R").to_partition_spec() == PartitionSpec(("x", "y"), None)
    assert S("RS10").to_partition_spec() == PartitionSpec(None, ("y", "x"))
    assert S("S1S0").to_partition_spec(("a", "b")) == PartitionSpec("b", "a")
    # trailing entries may be left out of a PartitionSpec
    assert ShardingSpec.from_partition_spec(PartitionSpec("x"), 2) == S("S0R")
    assert ShardingSpec.from_partition_spec(PartitionSpec(), 2) == S("RR")
    assert ShardingSpec.from_partition_spec(PartitionSpec(("y",), None), 2) == S("S1R")


@pytest.mark.parametrize("rank", [1, 2, 3])
def test_partition_spec_round_trip(rank):
    shape = (8,) * rank
    for mesh_shape in [(2, 2), (2, 4), (1, 4)]:
        for spec in enumerate_specs(shape, mesh_shape, allow_major_minor_swap=True):
            for names in [("x", "y"), ("data", "model")]:
                pspec = spec.to_partition_spec(names)
                assert ShardingSpec.from_partition_spec(pspec, rank, names) == spec


@pytest.mark.parametrize(
    "text,needle",
    [
        ("S2R", "cannot parse"),
        ("S00", "repeats a mesh axis"),
        ("S0S0", "same mesh axis"),
        ("S01S1", "same mesh axis"),
        ("hello", "cannot parse"),
        ("s0r", "cannot parse"),
        ("S", "cannot parse"),
        ("S012", "cannot parse"),
        ("R,S0", "cannot parse"),
    ],
)
def test_parse_errors(text, needle):
    with pytest.raises(ShardingSpecError) as info:
        S(text)
    msg = str(info.value)
    assert needle in msg
    assert repr(text) in msg or repr(text.strip()) in msg
    assert isinstance(info.value, ValueError)


def test_parse_error_explains_syntax():
    with pytest.raises(ShardingSpecError, match=r"R, S0, S1, S01 or S10"):
        S("S2R")


def test_from_partition_spec_errors():
    with pytest.raises(ShardingSpecError, match="entries for a rank-1"):
        ShardingSpec.from_partition_spec(PartitionSpec("x", "y"), 1)
    with pytest.raises(ShardingSpecError, match="not in"):
        ShardingSpec.from_partition_spec(PartitionSpec("z", None), 2)
    with pytest.raises(ShardingSpecError, match="same mesh axis"):
        ShardingSpec.from_partition_spec(PartitionSpec("x", "x"), 2)


# --------------------------------------------------------------------------------------
# Validity and enumeration
# --------------------------------------------------------------------------------------
def test_is_valid_for_divisibility():
    assert S("S0R").is_valid_for((4, 3), (2, 2))
    assert not S("RS0").is_valid_for((4, 3), (2, 2))  # 3 columns over 2 devices
    assert S("S01R").is_valid_for((8, 3), (2, 4))
    assert not S("S01R").is_valid_for((4, 3), (2, 4))  # 4 rows over 8 devices
    assert S("S0S1").is_valid_for((2, 4), (2, 4))
    assert not S("S0S1").is_valid_for((4, 2), (2, 4))
    assert S("S1R").is_valid_for((3, 3), (3, 1))  # a size-1 axis divides anything
    assert S("S0R").is_valid_for((3, 3), (3, 1))
    # wrong rank; a mesh axis the mesh does not have
    assert not S("S0R").is_valid_for((4,), (2, 2))
    assert not S("S0R").is_valid_for((4, 4, 4), (2, 2))
    assert not S("S1R").is_valid_for((4, 4), (4,))
    # a spec built by hand that uses an axis twice is never valid
    assert not ShardingSpec(((0,), (0,))).is_valid_for((4, 4), (2, 2))


def _all_specs_by_brute_force(rank, mesh_shape):
    """Every assignment of each non-trivial mesh axis to a tensor axis or to nothing, in every order."""
    axes = [a for a, n in enumerate(mesh_shape) if n > 1]
    out = set()
    for assignment in itertools.product([None, *range(rank)], repeat=len(axes)):
        dims = [[] for _ in range(rank)]
        for a, t in zip(axes, assignment):
            if t is not None:
                dims[t].append(a)
        # every major/minor order of the mesh axes on each tensor axis (S01 and S10)
        for orders in itertools.product(*(itertools.permutations(d) for d in dims)):
            out.add(ShardingSpec(tuple(orders)))
    return out


def test_enumerate_specs_counts():
    specs = enumerate_specs((8, 8), (2, 2))
    assert len(specs) == 9
    assert {str(s) for s in specs} == {"RR", "S0R", "S1R", "RS0", "RS1", "S0S1", "S1S0", "S01R", "RS01"}
    assert str(specs[0]) == "RR"  # replicated first
    assert [len(s.mesh_axes_used) for s in specs] == sorted(len(s.mesh_axes_used) for s in specs)
    assert len(enumerate_specs((8, 8), (2, 2), allow_major_minor_swap=True)) == 11  # + S10R, RS10
    assert {str(s) for s in enumerate_specs((8, 8), (1, 4))} == {"RR", "S1R", "RS1"}
    assert {str(s) for s in enumerate_specs((8, 8), (4, 1))} == {"RR", "S0R", "RS0"}
    assert len(enumerate_specs((8, 8), (1, 4), allow_major_minor_swap=True)) == 3
    assert [str(s) for s in enumerate_specs((8, 8), (1, 1))] == ["RR"]
    assert len(enumerate_specs((8,), (2, 2))) == 4  # R, S0, S1, S01
    assert len(enumerate_specs((8, 8, 8), (2, 2))) == 16  # (1 + 3)^2
    assert len(enumerate_specs((), (2, 2))) == 1


@pytest.mark.parametrize("mesh_shape", [(1, 4), (4, 1), (2, 2), (2, 4), (1, 8), (8, 1)], ids=str)
@pytest.mark.parametrize("shape", [(8, 16), (8,), (4, 8, 16), (2, 6), (3, 5)], ids=str)
def test_enumerate_specs_is_complete_and_valid(mesh_shape, shape):
    specs = enumerate_specs(shape, mesh_shape)
    assert len(specs) == len(set(specs))
    size1 = {a for a, n in enumerate(mesh_shape) if n == 1}
    for spec in specs:
        assert spec.is_valid_for(shape, mesh_shape)
        assert not size1 & set(spec.mesh_axes_used), f"{spec} uses a size-1 mesh axis of {mesh_shape}"
        assert all(list(axes) == sorted(axes) for axes in spec.dims), f"{spec}: S10 without asking"
    # nothing valid is missing (up to the S01/S10 order)
    expected = {
        s
        for s in _all_specs_by_brute_force(len(shape), mesh_shape)
        if s.is_valid_for(shape, mesh_shape) and all(list(a) == sorted(a) for a in s.dims)
    }
    assert set(specs) == expected
    with_swap = enumerate_specs(shape, mesh_shape, allow_major_minor_swap=True)
    assert set(specs) <= set(with_swap)
    assert set(with_swap) == {s for s in _all_specs_by_brute_force(len(shape), mesh_shape) if s.is_valid_for(shape, mesh_shape)}


def test_enumerate_respects_divisibility():
    # 3 is split by nothing; 2 only by the size-2 axis
    assert {str(s) for s in enumerate_specs((3, 3), (2, 2))} == {"RR"}
    assert {str(s) for s in enumerate_specs((2, 3), (2, 4))} == {"RR", "S0R"}
