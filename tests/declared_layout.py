"""A state's per-replica mask as commjax's state classes declare it, for tests that check
values, not layouts: ``cj.init_sharded(..., mask=declared_mask(...))`` skips the traces of
``tx.update`` that ``init_sharded`` otherwise makes to find the mask (half of a small
bucketed build). The traced layout of every codec and reducer is tests/test_contract.py's.
"""

from __future__ import annotations

from typing import Any

import jax
from jax.sharding import PartitionSpec as P

import commjax as cj
from commjax import _compat


def declared_mask(tx: Any, params: Any, mesh: Any) -> Any:
    """The mask of ``tx.init(params)`` traced once under ``shard_map`` over ``mesh``; empty
    leaves replicated, as ``cj.trace_update`` has them."""
    abstract = jax.eval_shape(_compat.shard_map(tx.init, mesh=mesh, in_specs=(P(),), out_specs=P(),
                                                check_vma=False), params)
    return jax.tree_util.tree_map(lambda m, a: bool(m) and a.size > 0, cj.per_replica_mask(abstract), abstract)
