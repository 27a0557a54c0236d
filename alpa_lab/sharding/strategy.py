"""A parallel algorithm for one op: the specs it needs, the spec it makes, what it costs.

The intra-op ILP (``passes/intra_op.py``) chooses one ``Strategy`` per op; the cost of an
edge between two ops is the resharding from the producer's output spec to the spec the
consumer's strategy wants for that operand (``resharding.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

from alpa_lab.cost.cluster import Collective
from alpa_lab.sharding.spec import ShardingSpec


@dataclass(frozen=True)
class Strategy:
    """One way to run an op on a logical mesh.

    ``input_specs[i]`` is the spec operand ``i`` must arrive in (the ILP adds resharding
    when the producer makes another); ``collectives`` are what the op issues itself, e.g.
    the all-reduce of partial sums when a contracting axis is split. Costs are per device:
    seconds of compute, seconds of communication, bytes of output held.
    """

    name: str
    output_specs: tuple[ShardingSpec, ...]
    input_specs: tuple[ShardingSpec, ...]
    compute_cost: float
    communication_cost: float
    memory_cost: float
    collectives: tuple[Collective, ...] = ()

    @property
    def cost(self) -> float:
        return self.compute_cost + self.communication_cost
