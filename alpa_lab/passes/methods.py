"""Planning methods: Alpa's, and the baselines it is compared against.

Every method is the same ILP over the same costs with restricted choices for how the
arguments (parameters, optimizer state, batch) are stored; the ILP fills in every op. So
predicted costs of different methods are comparable:

* ``alpa``: no restriction (the paper's method), then the post-ILP weight-update rewrite.
* ``data_parallel``: the batch split over every device, the train state replicated; every op
  making a tensor with a batch dimension keeps it split so (``batch_op_restrictions``).
* ``zero2``: data parallel with the optimizer state split over every device (ZeRO-2-like;
  gradients are reduce-scattered where the ILP finds that cheaper).
* ``zero3``: data parallel with parameters and optimizer state split (ZeRO-3-like).
* ``megatron``: the batch split over mesh axis 0 only, every weight matrix split over mesh
  axis 1 (column or row, whichever the ILP finds cheaper), as in Megatron-LM.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import numpy as np

from alpa_lab.graph.analysis import batch_dimension
from alpa_lab.passes.ilp import ILP_TIME_LIMIT
from alpa_lab.passes.intra_op import (
    IntraOpSolution, StrategyGraph, group_choices, group_index, output_layout_edges, resharding_weight,
    solve_strategy_graph, split_output_pins,
)
from alpa_lab.plan import OpPlan, Plan, ReshardingPlan, TensorPlan
from alpa_lab.sharding.resharding import resharding
from alpa_lab.sharding.spec import ShardingSpec

METHODS = ("alpa", "data_parallel", "zero2", "zero3", "megatron")

AXIS_SYMMETRIC_METHODS = ("alpa", "data_parallel", "zero2", "zero3")
"""methods whose restrictions treat both mesh axes alike (Megatron's do not: batch on axis 0, weights on 1),
so a 1-D mesh laid along either axis is the same problem"""

BATCH_SPLIT_ACTIVATIONS = ("data_parallel", "zero2")
"""methods whose stages receive their activations split over the batch (Alpa's force_data_parallel). The layouts the
stage DP also uses to save memory (``pipeline.MEMORY_SAVING_METHODS``: Megatron, ZeRO-3) keep their rule for
non-batch arguments: split so, ZeRO-3's stages made GPT-3 175B's plan 2.6% slower (step 285.4 -> 292.9 s)"""

REWRITE_TOLERANCE = 0.01
"""The weight-update rewrite is kept unless it makes the predicted step this much slower."""


class MethodError(ValueError):
    """A comparison method that cannot apply to this program or mesh."""


@dataclass(frozen=True)
class MethodSolution:
    solution: IntraOpSolution
    restrictions: Mapping[str, tuple[str, ...]]
    rewrites: tuple[str, ...] = ()


def solve_method(
    sg: StrategyGraph,
    method: str,
    pins: Mapping[str, str] | None = None,
    *,
    memory_budget: float | None = None,
    time_limit: float = ILP_TIME_LIMIT,
) -> MethodSolution:
    """Solve ``sg`` the way ``method`` plans, honouring ``pins``; each ILP solve stops at ``time_limit`` seconds
    with the best plan found by then."""
    restrictions = method_restrictions(method, sg, pins)
    solution = solve_strategy_graph(sg, pins, restrictions=restrictions, memory_budget=memory_budget, time_limit=time_limit)
    if method != "alpa":
        return MethodSolution(solution, restrictions)
    if not sg.weight_update_sharding:
        if sg.node_weights is None:
            return MethodSolution(solution, restrictions)
        # a pipeline stage's step (update_follows_parameters says why)
        return update_follows_parameters(sg, solution, pins or {}, memory_budget, restrictions, time_limit=time_limit)
    return shard_weight_update(sg, solution, pins or {}, memory_budget, restrictions, time_limit=time_limit)


def update_follows_parameters(
    sg: StrategyGraph, solution: IntraOpSolution, pins: Mapping[str, str], memory_budget: float | None,
    given: Mapping[str, tuple[str, ...]], *, time_limit: float = ILP_TIME_LIMIT,
) -> MethodSolution:
    """Without weight-update sharding (Alpa's ``prefer_reduce_scatter=False``) the update runs where the parameters
    are, as Alpa compiles it after the ILP: each optimizer-state leaf the ILP stored otherwise than the parameter
    its update reads (Adam's moments of a kernel) is held to that parameter's layout, and the ILP re-solved.

    Asked where the update weighs less than a micro-batch (a pipeline stage, ``StrategyGraph.node_weights``):
    reduce-scattered gradients and a split update gathered once a step are then cheaper than an all-reduce every
    micro-batch, and the ILP would choose the weight-update sharding the user turned off. (Unweighted the two move
    the same bytes, and the ILP's choice stands.) Pinned state keeps its pin.
    """
    held: dict[str, tuple[str, ...]] = {}
    partners = _state_parameters(sg)
    for state, param in partners.items():
        name = sg.nodes[state].name
        want = sg.nodes[param].strategies[solution.choice[param]].output_specs[0]
        chosen = sg.nodes[state].strategies[solution.choice[state]].output_specs[0]
        if name in pins or name in given or chosen == want:
            continue
        if any(s.output_specs[0] == want for s in sg.nodes[state].strategies):
            held[name] = (str(want),)
    if not held:
        return MethodSolution(solution, given)
    try:
        kept = {sg.nodes[p].name: sg.nodes[p].strategies[solution.choice[p]].name
                for p in set(partners.values()) if sg.nodes[p].name not in pins}
        resolved = solve_strategy_graph(sg, {**pins, **kept}, restrictions={**given, **held}, memory_budget=memory_budget,
                                        time_limit=time_limit)
    except ValueError:  # the parameters' layouts cannot hold the state (a memory budget): keep the ILP's
        return MethodSolution(solution, given)
    return MethodSolution(resolved, {**given, **held, **{k: (v,) for k, v in kept.items()}})


def _state_parameters(sg: StrategyGraph) -> dict[int, int]:
    """Optimizer-state argument node -> the parameter argument node of its shape whose new value it feeds: a
    parameter's new value read back through the update's ops (``node_weights`` below 1) that make it. A state that
    feeds several parameters' new values (a global norm of the updates) is held to none."""
    assert sg.node_weights is not None
    per_step = sg.node_weights < 1.0
    producers: dict[int, list[int]] = {}
    for e in sg.edges:
        if e.consumer >= 0 and per_step[e.consumer]:
            producers.setdefault(e.consumer, []).append(e.producer)
    found: dict[int, set[int]] = {}
    for pos, vid in sg.aliases.items():
        if sg.argument_kinds.get(vid) != "param" or vid not in sg.node_of_var or sg.outvars[pos] not in sg.node_of_var:
            continue
        param = sg.node_of_var[vid][0]
        shape = sg.var_info[vid][0]
        seen, todo = set(), [sg.node_of_var[sg.outvars[pos]][0]]
        while todo:
            n = todo.pop()
            if n in seen:
                continue
            seen.add(n)
            var = sg.nodes[n].var
            if var is not None:  # an argument: the update reads it
                if sg.argument_kinds.get(var) == "optimizer_state" and sg.var_info[var][0] == shape:
                    found.setdefault(n, set()).add(param)
                continue
            todo.extend(producers.get(n, ()))
    return {state: next(iter(params)) for state, params in found.items() if len(params) == 1}


TIE_PERIODS = (1, 2)
"""repetition periods ``solve_tied`` tries: every repeat alike, and alternate repeats alike (Megatron's pairs)"""

TIE_CHECK_MIN_SECONDS = 20.0
"""The least time a later period's solve is given, however quick the first was (``solve_tied``). The tiny
Wide-ResNet on 2x2 devices needs it: tied in 2.1 s it loses 7.7%, and its untied ILP takes 5.5 s here (a
5 s floor failed CI on a loaded machine), so the floor leaves about 4x for load."""


def solve_tied(
    build: Callable[[int], StrategyGraph],
    method: str,
    pins: Mapping[str, str] | None = None,
    *,
    memory_budget: float | None = None,
) -> tuple[StrategyGraph, MethodSolution]:
    """Repeated-block tying (TAP) at the repetition period that keeps the optimum: the cheapest of ``TIE_PERIODS``.

    ``build(period)`` makes the strategy graph tied at that period. Tying every repeat alike
    forbids plans that alternate between repeats (a stack of equal linear layers split by
    columns, then rows, then columns...); tying alternate repeats allows them, at twice the
    variables. When nothing repeats, one solve. A period whose problem cannot be solved
    (pins that only hold at another period) is skipped; the first period's error is raised
    if none can.

    A later period is a check on the first, kept only where it does better, so it is given as long as the
    first took (at least ``TIE_CHECK_MIN_SECONDS``), then its best plan so far is compared: on an ILP whose
    LP relaxation is loose (a Wide-ResNet stage of nine layers on 2x2 devices: 24 s tied, over the 60 s
    limit untied) the check costs at most the solve it checks.
    """
    best: tuple[StrategyGraph, MethodSolution] | None = None
    first_error: Exception | None = None
    limit = ILP_TIME_LIMIT
    for period in TIE_PERIODS:
        sg = build(period)
        t0 = time.perf_counter()
        try:
            solved = solve_method(sg, method, pins, memory_budget=memory_budget, time_limit=limit)
        except ValueError as exc:  # infeasible or conflicting pins at this period
            first_error = first_error or exc
            if sg.ties == 0:
                break
            continue
        if best is None or solved.solution.minimised < best[1].solution.minimised * (1 - 1e-9):
            best = (sg, solved)
        if sg.ties == 0:  # nothing is tied: another period gives the same problem
            break
        limit = min(ILP_TIME_LIMIT, max(TIE_CHECK_MIN_SECONDS, time.perf_counter() - t0))
    if best is None:
        assert first_error is not None
        raise first_error
    return best


def method_restrictions(method: str, sg: StrategyGraph, pins: Mapping[str, str] | None = None) -> dict[str, tuple[str, ...]]:
    """Allowed storage specs of each argument under ``method`` (node name -> spec names), and under a data-parallel
    method the strategies of each op making a batch-carrying tensor (``batch_op_restrictions``; an op the user
    ``pins`` keeps the pin: those restrictions are derived, the arguments' are the method)."""
    if method not in METHODS:
        raise MethodError(f"unknown planning method {method!r}; choose one of {', '.join(METHODS)}")
    if method == "alpa":
        return _forced_batch_axis(sg, pins or {}) if sg.batch_mesh_axis is not None else {}
    mesh_shape = sg.mesh.shape
    all_axes = tuple(a for a in (0, 1) if mesh_shape[a] > 1)
    out: dict[str, tuple[str, ...]] = {}
    batch = _batch_size(sg)
    split_batch: dict[int, int] = {}  # the arguments held split over the batch (dimension 0) on every device
    for vid, kind in sg.argument_kinds.items():
        if vid not in sg.node_of_var:
            continue
        node = sg.nodes[sg.node_of_var[vid][0]]
        specs = [s.output_specs[0] for s in node.strategies]
        shape = sg.var_info[vid][0]
        replicated = [ShardingSpec.replicated(len(shape))]
        if kind == "activation" and method in BATCH_SPLIT_ACTIVATIONS and shape and shape[0] == batch and all_axes:
            # what a pipeline stage receives from another (an activation, or its gradient), split over the batch as
            # the batch is, so the stage is data parallel end to end (Alpa's force_data_parallel); it was held whole,
            # as the train state is, which made the next stage split its layers over the model instead
            allowed = _batch_split(specs, all_axes)
            if allowed:
                out[node.name] = tuple(str(s) for s in allowed)
                split_batch[vid] = 0
                continue
        if kind == "data":
            if method == "megatron":  # data parallel only along mesh axis 0
                axes = (0,) if mesh_shape[0] > 1 else ()
            else:
                axes = all_axes
            if not shape or not axes or not _is_batch(sg, vid, batch):
                allowed = replicated
            else:
                allowed = _batch_split(specs, axes)
                if not allowed:
                    raise MethodError(
                        f"{method}: cannot split the batch argument {node.name} of shape {shape} over the "
                        f"{mesh_shape[0]}x{mesh_shape[1]} mesh; its leading dimension must divide by "
                        f"{ShardingSpec(((axes),)).num_shards(mesh_shape)}"
                    )
                if axes == all_axes:
                    split_batch[vid] = 0
        elif method == "megatron":
            if kind == "param" and len(shape) >= 2 and mesh_shape[1] > 1:
                allowed = [s for s in specs if 1 in s.mesh_axes_used and 0 not in s.mesh_axes_used]
            else:
                allowed = [s for s in specs if 0 not in s.mesh_axes_used]
            allowed = allowed or replicated
        else:
            split = (kind == "optimizer_state" and method in ("zero2", "zero3")) or (kind == "param" and method == "zero3")
            spec = _widen(ShardingSpec.replicated(len(shape)), all_axes, specs) if split else None
            allowed = [spec] if spec else replicated
        out[node.name] = tuple(str(s) for s in allowed)
    if method in BATCH_SPLIT_ACTIVATIONS and all_axes:
        out.update(batch_op_restrictions(sg, batch_dims(sg, split_batch, all_axes), all_axes, out, pins or {}))
    return out


def _batch_size(sg: StrategyGraph) -> int | None:
    """The batch size: data leaves leading with it (other data, a raw key or class weights, is not the batch); a
    pipeline stage that reads no data takes it from the activations it receives."""
    batch = batch_dimension([tuple(sg.var_info[v][0]) for v, k in sg.argument_kinds.items() if k == "data"])
    if batch is None:
        batch = batch_dimension([tuple(sg.var_info[v][0]) for v, k in sg.argument_kinds.items() if k == "activation"])
    return batch


def _is_batch(sg: StrategyGraph, vid: int, batch: int | None) -> bool:
    """Whether argument ``vid`` is the batch: one the user named (``batch_vars``), else one leading with its size.
    What a pipeline stage receives from another (an activation) is never named: it is judged by its size, named or not
    (a stage reading no data took its batch from none of them, and a forced axis held none of its ops)."""
    shape = sg.var_info[vid][0]
    if sg.batch_vars is not None and sg.argument_kinds.get(vid) != "activation":
        return vid in sg.batch_vars
    return bool(shape) and shape[0] == batch


def _forced_batch_axis(sg: StrategyGraph, pins: Mapping[str, str]) -> dict[str, tuple[str, ...]]:
    """Alpa's ``force_batch_dim_to_mesh_dim`` (``StrategyGraph.batch_mesh_axis``) on the ILP's own method: the batch
    arguments and every op making a tensor with a batch dimension keep it split over that mesh axis alone, or whole
    where the axis has one device (Alpa: the dimension is split into as many parts as the axis has devices). The
    rest is the ILP's: a (1, n) mesh forced to axis 0 may split the weights over axis 1 (Megatron), not the batch."""
    axis = sg.batch_mesh_axis
    target = (axis,) if sg.mesh.shape[axis] > 1 else ()
    probe = target or tuple(a for a in (0, 1) if sg.mesh.shape[a] > 1)[:1]  # an axis to find the batch's dimensions by
    if not probe:
        return {}
    batch = _batch_size(sg)
    out: dict[str, tuple[str, ...]] = {}
    known: dict[int, int] = {}
    for vid, kind in sg.argument_kinds.items():
        shape = sg.var_info[vid][0]
        if kind not in ("data", "activation") or vid not in sg.node_of_var or not shape or not _is_batch(sg, vid, batch):
            continue
        node = sg.nodes[sg.node_of_var[vid][0]]
        allowed = [s.name for s in node.strategies if s.output_specs[0].dims[0] == target]
        if not allowed:
            raise MethodError(
                f"force_batch_dim_to_mesh_dim={axis}: cannot split the batch argument {node.name} of shape {shape} over "
                f"mesh axis {axis} ({sg.mesh.shape[axis]} devices); its leading dimension must divide by it")
        if node.name not in pins:
            out[node.name] = tuple(allowed)
        known[vid] = 0
    out.update(batch_op_restrictions(sg, batch_dims(sg, known, probe), target, out, pins))
    return out


def batch_dims(sg: StrategyGraph, known: Mapping[int, int], axes: tuple[int, ...]) -> dict[int, int]:
    """Every tensor's batch dimension (var -> dim), carried from ``known`` (arguments) through the program.

    An op carries the batch where one of its strategies takes each operand known to have a batch dimension split
    along that dimension over ``axes`` (and along nothing else) and issues no collective: the dimension of each
    output split over ``axes`` is then that output's batch dimension. The sharding rules say, per primitive, how
    dimensions correspond, so this is Alpa's batch-dimension analysis without a table of its own. An op that sums
    over the batch (a weight's gradient, the mean loss) has no such strategy: its outputs carry no batch.
    """
    dims = dict(known)
    operands: dict[int, dict[int, int]] = {}
    for e in sg.edges:
        if e.consumer >= 0:
            operands.setdefault(e.consumer, {})[e.operand] = e.var
    outputs: dict[int, dict[int, int]] = {}
    for vid, (n, pos) in sg.node_of_var.items():
        outputs.setdefault(n, {})[pos] = vid
    for n, node in enumerate(sg.nodes):  # in program order: an op's operands come first
        if node.op_index is None:
            continue
        batched = {pos: dims[v] for pos, v in operands.get(n, {}).items() if v in dims}
        if not batched:
            continue
        for s in node.strategies:
            if s.collectives or any(not _split_along(s.input_specs[pos], d, axes) for pos, d in batched.items()):
                continue
            for pos, vid in outputs.get(n, {}).items():
                split = [d for d, used in enumerate(s.output_specs[pos].dims) if used == axes]
                if len(split) == 1:
                    dims[vid] = split[0]
            break
    return dims


def _split_along(spec: ShardingSpec, dim: int, axes: tuple[int, ...]) -> bool:
    """Whether ``spec`` splits dimension ``dim`` over exactly ``axes`` and no other dimension."""
    return dim < spec.rank and all(used == (axes if d == dim else ()) for d, used in enumerate(spec.dims))


def batch_op_restrictions(
    sg: StrategyGraph, dims: Mapping[int, int], axes: tuple[int, ...], given: Mapping[str, tuple[str, ...]],
    pins: Mapping[str, str],
) -> dict[str, tuple[str, ...]]:
    """Each op making a tensor with a batch dimension (``batch_dims``) limited to the strategies that keep that
    dimension split over ``axes`` (Alpa's force_data_parallel: its ``force_batch_dim_to_mesh_dim``), so a data-parallel
    step stays data parallel inside, not only at its arguments; the ILP would otherwise split an attention over its
    heads wherever that priced cheaper. An op with no such strategy, a pinned op, or one merged into an op (it follows
    that op's layout, ``intra_op``) whose choices cannot give it one together with the other restrictions and the
    ``pins``, is left free."""
    gindex = group_index(sg.group_of_node)
    reps: dict[int, set[int]] = {}

    def admit(n: int, strategies: set[int]) -> bool:
        """Narrow n's group to the choices giving n one of ``strategies``, unless that leaves none."""
        gi, mine = group_choices(sg, gindex, n, strategies)
        narrowed = reps.get(gi, mine) & mine
        if not narrowed:
            return False
        reps[gi] = narrowed
        return True

    for name, names in given.items():
        n = sg.node_index(name)
        admit(n, {j for j, s in enumerate(sg.nodes[n].strategies) if s.name in names})
    for name, strategy in split_output_pins(sg, pins)[0].items():  # a result's layout fixes no op (a new state's: its argument)
        n = sg.node_index(name)
        admit(n, {sg.nodes[n].strategy_index(strategy)})
    batched: dict[int, dict[int, int]] = {}  # op node -> its outputs' batch dimensions
    for vid, d in dims.items():
        n, pos = sg.node_of_var[vid]
        if sg.nodes[n].op_index is not None:
            batched.setdefault(n, {})[pos] = d
    out: dict[str, tuple[str, ...]] = {}
    for n, outs in sorted(batched.items()):
        node = sg.nodes[n]
        if node.name in pins:
            continue
        keep = {j for j, s in enumerate(node.strategies) if all(s.output_specs[pos].dims[d] == axes for pos, d in outs.items())}
        if keep and len(keep) < len(node.strategies) and admit(n, keep):
            out[node.name] = tuple(node.strategies[j].name for j in sorted(keep))
    return out


def _batch_split(specs: list[ShardingSpec], axes: tuple[int, ...]) -> list[ShardingSpec]:
    """The specs that split the leading (batch) dimension over exactly ``axes``, and nothing else."""
    return [s for s in specs if s.dims[0] == axes and not any(s.dims[1:])]


def _widen(spec: ShardingSpec, axes: tuple[int, ...], specs: list[ShardingSpec]) -> ShardingSpec | None:
    """``spec`` also split over ``axes`` on its first dimension that allows it (ZeRO's flat split)."""
    free = tuple(a for a in axes if a not in spec.mesh_axes_used)
    if not free:
        return None
    for d in range(spec.rank):
        dims = tuple(axes_d + free if i == d else axes_d for i, axes_d in enumerate(spec.dims))
        wider = ShardingSpec(dims)
        if wider in specs:
            return wider
    return None


def _bandwidth_bound(sg: StrategyGraph, vid: int, spec: ShardingSpec, wider: ShardingSpec) -> bool:
    """Whether gathering the tensor back costs more in bandwidth than in latency.

    Only then is reduce-scatter + all-gather no slower than one all-reduce; for small
    tensors the extra collective's latency would dominate, so they are left alone.
    """
    shape, itemsize = sg.var_info[vid]
    nbytes = math.prod(shape) * itemsize / spec.num_shards(sg.mesh.shape)
    new_axes = tuple(a for a in wider.mesh_axes_used if a not in spec.mesh_axes_used)
    n, alpha, beta = sg.mesh.group(new_axes)
    return beta * (n - 1) / n * nbytes >= alpha


def shard_weight_update(
    sg: StrategyGraph, solution: IntraOpSolution, pins: Mapping[str, str], memory_budget: float | None,
    given: Mapping[str, tuple[str, ...]] | None = None, *, time_limit: float = ILP_TIME_LIMIT,
) -> MethodSolution:
    """Post-ILP rewrite (Alpa sec. 4.2): split the weight update over replicated mesh axes.

    Where the optimizer state is replicated over a mesh axis, data-parallel devices all
    compute the same update. Splitting that state over the axis turns the gradient's
    all-reduce into a reduce-scatter, the update into 1/n of the work and memory, and adds
    an all-gather of the new weights: ZeRO-like. The re-solve keeps parameters where they
    were; the rewrite is kept unless the predicted step grows by more than REWRITE_TOLERANCE or
    its collectives move more bytes: an all-reduce replaced moves the same bytes (the paper's
    "whenever applicable"), a split update whose gradient was never all-reduced moves more. ``given``: the
    restrictions the solution was made under (a forced batch axis), kept in the re-solve.
    """
    given = dict(given or {})
    restrictions: dict[str, tuple[str, ...]] = {}
    rewrites = []
    axes = tuple(a for a in (0, 1) if sg.mesh.shape[a] > 1)
    keep = {}
    for vid, kind in sg.argument_kinds.items():
        if vid not in sg.node_of_var:
            continue
        n = sg.node_of_var[vid][0]
        node = sg.nodes[n]
        chosen = node.strategies[solution.choice[n]]
        if kind == "param" and node.name not in pins:
            keep[node.name] = chosen.name
        if kind != "optimizer_state" or node.name in pins:
            continue
        wider = _widen(chosen.output_specs[0], axes, [s.output_specs[0] for s in node.strategies])
        if wider is not None and _bandwidth_bound(sg, vid, chosen.output_specs[0], wider):
            restrictions[node.name] = (str(wider),)
            rewrites.append(f"{node.name}: {chosen.name} -> {wider}")
    if not restrictions:
        return MethodSolution(solution, given)
    try:
        rewritten = solve_strategy_graph(sg, {**pins, **keep}, restrictions={**given, **restrictions}, memory_budget=memory_budget,
                                         time_limit=time_limit)
    except ValueError:
        return MethodSolution(solution, given)
    if rewritten.minimised > solution.minimised * (1 + REWRITE_TOLERANCE) or (
        _bandwidth_seconds(sg, rewritten) > _bandwidth_seconds(sg, solution) * (1 + 1e-9)
    ):  # slower, or more bytes moved: the split update's gathers replaced no all-reduce
        return MethodSolution(solution, given)
    return MethodSolution(rewritten, {**given, **restrictions, **{k: (v,) for k, v in keep.items()}}, tuple(rewrites))


def _reshardings(
    sg: StrategyGraph, choice: tuple[int, ...], layouts: Mapping[int, ShardingSpec] | None = None,
) -> list[tuple[Any, ShardingSpec, ShardingSpec, tuple]]:
    """(edge, source spec, target spec, collectives) of each resharding a choice makes that communicates (and into
    the ``layouts`` of pinned results, ``split_output_pins``). XLA reshards a tensor once per target spec, however
    many consumers want it."""
    out, seen = [], set()
    layouts = layouts or {}
    for e in (*sg.edges, *output_layout_edges(sg, layouts)):
        if e.consumer < 0 and e.producer >= 0 and e.operand >= 0 and -1 - e.consumer in layouts:
            continue  # a pinned new state's alias edge: it goes back through its pinned layout (the edges below)
        src = layouts[-1 - e.consumer] if e.producer < 0 else sg.nodes[e.producer].strategies[choice[e.producer]].output_specs[e.output]
        if e.consumer >= 0:
            dst = sg.nodes[e.consumer].strategies[choice[e.consumer]].input_specs[e.operand]
        elif e.operand < 0:  # a pinned result
            dst = layouts[-1 - e.consumer]
        else:
            dst = sg.nodes[e.operand].strategies[choice[e.operand]].output_specs[0]
        if src == dst or (e.var, dst) in seen:
            continue
        seen.add((e.var, dst))
        shape, itemsize = sg.var_info[e.var]
        collectives = resharding(src, dst, shape, itemsize, sg.mesh).collectives
        if collectives:
            out.append((e, src, dst, collectives))
    return out


def _bandwidth_seconds(sg: StrategyGraph, solution: IntraOpSolution) -> float:
    """Seconds a solution's collectives (its ops' and its reshardings') spend moving bytes, latency left out,
    weighted as the ILP weighs their costs (``StrategyGraph.node_weights``: a stage's update once per step)."""
    w = sg.node_weights if sg.node_weights is not None else np.ones(len(sg.nodes))
    collectives = [(c, w[n]) for n, node in enumerate(sg.nodes) for c in node.strategies[solution.choice[n]].collectives]
    for e, _, _, cs in _reshardings(sg, solution.choice):
        collectives += [(c, resharding_weight(sg.node_weights, e)) for c in cs]
    return sum((c.cost - sg.mesh.group(c.axes)[1]) * weight for c, weight in collectives)


def make_plan(
    sg: StrategyGraph,
    solved: MethodSolution,
    *,
    method: str,
    cluster: Mapping[str, Any],
    pins: Mapping[str, str],
    memory_budget: float | None,
    mesh_candidates: tuple = (),
) -> Plan:
    """Turn a solved strategy graph into a Plan: pure data, with ``sg`` as its problem (what ``pin`` re-solves)."""
    solution = solved.solution
    choice = solution.choice
    in_paths, out_paths = sg.in_paths, sg.out_paths
    ops = []
    for i, node in enumerate(sg.nodes):
        s = node.strategies[choice[i]]
        ops.append(
            OpPlan(
                name=node.name,
                kind=node.kind,
                primitive=node.primitive,
                label=node.label,
                strategy=s.name,
                input_specs=tuple(map(str, s.input_specs)),
                output_specs=tuple(map(str, s.output_specs)),
                compute_cost=s.compute_cost,
                communication_cost=s.communication_cost,
                memory_cost=s.memory_cost,
                collectives=s.collectives,
                merged_into=sg.nodes[int(sg.group_of_node[i])].name,
                num_strategies=len(node.strategies),
            )
        )
    reshardings = []
    layouts = split_output_pins(sg, pins)[1]  # results pinned to a layout (Alpa's out_axis_resources)
    for e, src, dst, collectives in _reshardings(sg, choice, layouts):
        consumer = sg.nodes[e.consumer].name if e.consumer >= 0 else f"output {out_paths[-1 - e.consumer]}"
        if e.producer < 0:  # a pinned new state into its argument's layout, read so by the next step
            reshardings.append(ReshardingPlan(consumer, sg.nodes[e.operand].name, sg.var_info[e.var][0], sg.var_dtype[e.var],
                                              str(src), str(dst), collectives))
            continue
        shape = sg.var_info[e.var][0]
        reshardings.append(ReshardingPlan(sg.nodes[e.producer].name, consumer, shape, sg.var_dtype[e.var], str(src), str(dst), collectives))
    spec_of_var = {}
    for vid, (n, out) in sg.node_of_var.items():
        spec_of_var[vid] = str(sg.nodes[n].strategies[choice[n]].output_specs[out])
    inputs = tuple(
        TensorPlan(path, sg.var_info[v][0], sg.var_dtype[v], spec_of_var.get(v, "R" * len(sg.var_info[v][0]) or "-"))
        for path, v in zip(in_paths, sg.invars)
    )
    outputs = []
    for pos, (path, v) in enumerate(zip(out_paths, sg.outvars)):
        shape = sg.var_info[v][0]
        if pos in layouts:
            spec = str(layouts[pos])
        elif pos in sg.aliases and sg.aliases[pos] in spec_of_var:
            spec = spec_of_var[sg.aliases[pos]]
        else:
            spec = spec_of_var.get(v, "R" * len(shape) or "-")
        outputs.append(TensorPlan(path, shape, sg.var_dtype[v], spec))
    ilp = solution.ilp
    return Plan(
        fingerprint=sg.fingerprint,
        method=method,
        cluster=dict(cluster),
        mesh_shape=tuple(sg.mesh.shape),
        device_ids=tuple(sg.mesh.device_ids),
        ops=tuple(ops),
        inputs=inputs,
        outputs=tuple(outputs),
        reshardings=tuple(reshardings),
        pins=tuple(pins.items()),
        objective=solution.objective,
        memory_budget=memory_budget,
        solver={
            "variables": ilp.num_variables,
            "constraints": ilp.num_constraints,
            "build_seconds": ilp.build_seconds + sg.build_seconds,
            "solve_seconds": ilp.solve_seconds,
            "reduced_nodes": ilp.reduced_nodes,
            "ilp_nodes": len(sg.cost_graph.node_costs),
            "ops": sum(1 for n in sg.nodes if n.kind == "op"),
            "status": ilp.status,
            "tie_period": sg.tie_period,
        },
        mesh_candidates=tuple(mesh_candidates),
        batch_inputs=None if sg.batch_vars is None else tuple(p for p, v in zip(in_paths, sg.invars) if v in sg.batch_vars),
        batch_mesh_axis=sg.batch_mesh_axis,
        weight_update_sharding=sg.weight_update_sharding,
        forbidden_collectives=sg.mesh.forbidden,
        unplanned_primitives=sg.unplanned_primitives,
        rewrites=solved.rewrites,
        problem=sg,
    )

