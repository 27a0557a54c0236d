"""Sub-mesh shapes (Alpa, OSDI'22, sec. 5.2) and their placement on a cluster (Appendix A).

A cluster is ``num_hosts`` (N) hosts with ``devices_per_host`` (M) devices each; device id
``host * M + local``. Alpa restricts the stage sub-meshes to the shapes
``(1, 1), (1, 2), (1, 4), ..., (1, M)`` and ``(2, M), ..., (N, M)``: the 1-D ones keep a
stage inside one host (fast intra-host links), the 2-D ones use whole hosts. With these
shapes, any multiset whose sizes sum to N*M can tile the cluster exactly (Appendix A), so
the inter-op DP only has to check the total size; ``place_submeshes`` builds that tiling.

On large clusters the whole-host shapes are many (n = 2..N), and the DP prices every layer
range on each. Alpa's implementation searches ``power_of_two`` host counts by default
(its ``AutoStageOption.submesh_physical_shape_space``); the spaces here are Alpa's. Any
multiset of these shapes summing to N*M still tiles the cluster (whole hosts first, then
the one-host shapes buddy-allocated), so every space plans any N.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = [
    "SUBMESH_SPACES", "Placement", "PlacementError", "check_submesh_space", "even_submesh", "manual_space", "place_submeshes",
    "submesh_shapes",
]

SUBMESH_SPACES = ("all", "power_of_two", "small_power_of_two")
"""Whole-host shapes (n, M) searched: every n = 2..N (the paper's space), powers of two
(Alpa's default), or powers of two up to 4 hosts. Besides these, ``"manual:1x2,2x4"`` searches only the
shapes it lists (Alpa's ``submesh_physical_shape_space="manual"`` with ``manually_specified_submeshes``)."""

MANUAL = "manual:"


def manual_space(shapes: Sequence[Sequence[int]]) -> str:
    """The space of exactly ``shapes`` (Alpa's ``manually_specified_submeshes``), as the text a plan saves."""
    try:
        pairs = [_normalize_shape(tuple(s)) for s in shapes]
    except (TypeError, PlacementError) as err:
        raise ValueError(f"manually specified sub-meshes must be (hosts, devices) pairs, got {shapes!r}") from err
    if not pairs:
        raise ValueError("manually specified sub-meshes: give at least one (hosts, devices) shape")
    return MANUAL + ",".join(f"{a}x{b}" for a, b in pairs)


def _manual_shapes(space: str) -> list[tuple[int, int]]:
    try:
        return [tuple(int(v) for v in part.split("x")) for part in space[len(MANUAL):].split(",")]  # type: ignore[misc]
    except ValueError:
        raise ValueError(f"sub-mesh space {space!r}: write the shapes as 'manual:1x2,2x4'") from None


class PlacementError(ValueError):
    """The sub-mesh shapes cannot tile the cluster."""


@dataclass(frozen=True)
class Placement:
    """Where one sub-mesh lands: its shape, hosts, and device ids (row-major, host-major)."""

    shape: tuple[int, int]
    hosts: tuple[int, ...]
    device_ids: tuple[int, ...]


def _check_cluster(num_hosts: int, devices_per_host: int) -> None:
    for name, value in (("num_hosts", num_hosts), ("devices_per_host", devices_per_host)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{name} must be an int, got {value!r}")
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")


def even_submesh(num_hosts: int, devices_per_host: int, parts: int) -> tuple[int, int]:
    """The sub-mesh of each of ``parts`` equal shares of an N x M cluster (``parts`` dividing N * M): a piece of
    one host, (1, N*M/parts), or whole hosts, (N*M/parts/M, M)."""
    size = num_hosts * devices_per_host // parts
    return (1, size) if size <= devices_per_host else (size // devices_per_host, devices_per_host)


def submesh_shapes(num_hosts: int, devices_per_host: int, space: str = "all") -> list[tuple[int, int]]:
    """Alpa's candidate sub-mesh shapes for an N x M cluster, smallest first (sec. 5.2).

    1-D shapes ``(1, 2^m)`` up to M (plus ``(1, M)`` when M is not a power of two), then
    2-D shapes ``(n, M)`` for n = 2..N (``space="all"``), or n = 2, 4, 8, ... <= N
    (``"power_of_two"``), or n in (2, 4) (``"small_power_of_two"``).
    """
    _check_cluster(num_hosts, devices_per_host)
    check_submesh_space(space)
    if space.startswith(MANUAL):
        allowed = submesh_shapes(num_hosts, devices_per_host, "all")
        listed = _manual_shapes(space)
        bad = [s for s in listed if s not in allowed]
        if bad:
            raise ValueError(f"sub-mesh shapes {bad} are not ones Alpa places on {num_hosts}x{devices_per_host}: choose from {allowed}")
        return sorted(set(listed), key=allowed.index)
    shapes: list[tuple[int, int]] = []
    k = 1
    while k <= devices_per_host:
        shapes.append((1, k))
        k *= 2
    if shapes[-1] != (1, devices_per_host):
        shapes.append((1, devices_per_host))
    if space == "all":
        hosts = list(range(2, num_hosts + 1))
    else:
        top = num_hosts if space == "power_of_two" else min(num_hosts, 4)
        hosts = [2**i for i in range(1, top.bit_length()) if 2**i <= top]
    shapes.extend((n, devices_per_host) for n in hosts)
    return shapes


def check_submesh_space(space: object) -> None:
    """A ValueError naming the choices unless ``space`` is one of ``SUBMESH_SPACES`` (the API checks early with it)."""
    if isinstance(space, str) and space.startswith(MANUAL):
        shapes = _manual_shapes(space)
        if not shapes or any(len(s) != 2 or min(s) < 1 for s in shapes):
            raise ValueError(f"sub-mesh space {space!r}: write the shapes as 'manual:1x2,2x4'")
        return
    if space not in SUBMESH_SPACES:
        raise ValueError(f"unknown sub-mesh space {space!r}; choose one of {', '.join(SUBMESH_SPACES)}, or "
                         "'manual:1x2,...' for given shapes")


def _normalize_shape(shape: object) -> tuple[int, int]:
    try:
        rows, cols = shape  # type: ignore[misc]
    except (TypeError, ValueError):
        raise PlacementError(f"sub-mesh shape must be a pair (hosts, devices), got {shape!r}") from None
    for v in (rows, cols):
        if isinstance(v, bool) or not isinstance(v, int):
            raise PlacementError(f"sub-mesh shape must hold ints, got {shape!r}")
    return rows, cols


def place_submeshes(
    shapes: Sequence[tuple[int, int]], num_hosts: int, devices_per_host: int
) -> tuple[Placement, ...]:
    """Tile the N x M cluster with ``shapes`` (Appendix A); one Placement per shape, in order.

    Whole-host shapes ``(n, M)`` take consecutive hosts first; the remaining ``(1, k)``
    shapes go, largest first, to the first free slot aligned to k within a host
    (buddy-allocation style). For power-of-two sizes this never fails, since every
    remaining gap is a multiple of the next size.
    """
    _check_cluster(num_hosts, devices_per_host)
    n_hosts, m = num_hosts, devices_per_host
    valid = set(submesh_shapes(n_hosts, m))
    norm = [_normalize_shape(s) for s in shapes]
    for i, s in enumerate(norm):
        if s not in valid:
            raise PlacementError(
                f"shape #{i} {s} is not a valid sub-mesh shape for a {n_hosts}x{m} cluster; "
                f"valid shapes: {sorted(valid)}"
            )
    total = sum(r * c for r, c in norm)
    if total != n_hosts * m:
        raise PlacementError(
            f"sub-mesh sizes sum to {total}, but the {n_hosts}x{m} cluster has "
            f"{n_hosts * m} devices; they must be equal to tile it exactly (to use fewer devices, plan for them: "
            "parallelize(..., cluster=ClusterSpec.local(hosts, devices_per_host)), or a method's "
            "devices=jax.local_devices()[:n] / a Ray cluster's virtual mesh)"
        )

    result: list[Placement | None] = [None] * len(norm)
    next_host = 0
    for i, (rows, cols) in enumerate(norm):
        if cols == m:  # whole hosts, including (1, M)
            hosts = tuple(range(next_host, next_host + rows))
            next_host += rows
            ids = tuple(h * m + d for h in hosts for d in range(m))
            result[i] = Placement((rows, cols), hosts, ids)

    free = {h: [True] * m for h in range(next_host, n_hosts)}
    one_d = sorted((i for i, (_, c) in enumerate(norm) if c != m), key=lambda i: -norm[i][1])
    for i in one_d:
        k = norm[i][1]
        slot = next(
            (
                (h, off)
                for h in range(next_host, n_hosts)
                for off in range(0, m - k + 1, k)
                if all(free[h][off : off + k])
            ),
            None,
        )
        if slot is None:
            raise PlacementError(
                f"cannot pack shape #{i} (1, {k}) into the remaining hosts of the "
                f"{n_hosts}x{m} cluster (fragmentation; M={m} is not a power of two?)"
            )
        h, off = slot
        free[h][off : off + k] = [False] * k
        result[i] = Placement((1, k), (h,), tuple(h * m + off + d for d in range(k)))
    return tuple(p for p in result if p is not None)
