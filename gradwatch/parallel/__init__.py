"""Ranks and shards, below the watch (it imports :mod:`gradwatch.check` and :mod:`gradwatch.plan`, never
:mod:`gradwatch.watch`; an import-linter contract keeps it):

- :mod:`~gradwatch.parallel.coordinator`: the ranks agree on a check's plan, gather and merge their results;
- :mod:`~gradwatch.parallel.lockstep`: agreement points around the user's collectives during a check, over
  :mod:`~gradwatch.parallel.host_points` (shared-memory points) and :mod:`~gradwatch.parallel.host_collectives`;
- :mod:`~gradwatch.parallel.sharded`: FSDP2 and DTensor layouts, the gathered replica;
- :mod:`~gradwatch.parallel.shard_check`: checking shard by shard, on the ranks that hold the rows;
- :mod:`~gradwatch.parallel.zero`: DeepSpeed ZeRO; :mod:`~gradwatch.parallel.wrappers`: the wrappers looked through;
- :mod:`~gradwatch.parallel.step_objective`: the whole step's objective under accumulation and ranks;
- :mod:`~gradwatch.parallel.update_shards`, :mod:`~gradwatch.parallel.update_zero`: the optimizer's step on shards.
"""

from gradwatch.parallel.coordinator import DistributedCoordinator
from gradwatch.parallel.lockstep import Lockstep

__all__ = ["DistributedCoordinator", "Lockstep"]
