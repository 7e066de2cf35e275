"""commjax: communication-efficient optimizers for JAX.

Compressed gradient exchange as optax transforms, inside ``jax.shard_map``/``jax.pmap``
(or ``jax.vmap`` with a named axis)::

    import commjax as cj
    tx = optax.chain(cj.compressed_mean(cj.quantize(bits=4), axis_name="data"),
                     optax.adam(1e-3))
"""

from commjax import collectives
from commjax._compat import vary
from commjax.accounting import CollectiveReport, CommunicationPlan, Transfer, collective_bytes, ring_bytes
from commjax.compressors import (
    Compressor,
    cast,
    fp8,
    hadamard,
    identity,
    lossless,
    powersgd,
    qsgd,
    quantize,
    random_k,
    sign,
    terngrad,
    threshold,
    top_k,
)
from commjax.accumulate import accumulate
from commjax.layout import (
    infer_per_replica,
    init_sharded,
    per_replica_mask,
    pmap_state,
    shard_state,
    state_specs,
    unshard_state,
)
from commjax.fsdp import fsdp_gather, fsdp_like, fsdp_shard, fsdp_specs, fsdp_unshard
from commjax.optimizers import choco, dgc, diloco, onebit_adam, onebit_lamb, zero
from commjax.optimizers.decoupled_momentum import DecoupledMomentumState, decoupled_momentum
from commjax.optimizers.streaming_diloco import streaming_diloco
from commjax.optimizers.zero import ZeroState
from commjax.plan import communication_plan
from commjax.collectives import REDUCERS
from commjax.transform import AxisNotBoundError, CompressedMeanState, compressed_mean
from commjax.step import DataParallel, TrainState, data_parallel
from commjax.sync import InBackwardSync, sync_in_backward

__version__ = "0.1.0"

__all__ = [
    "Compressor", "identity", "cast", "quantize", "qsgd", "terngrad", "sign",
    "top_k", "random_k", "threshold", "powersgd", "hadamard",
    "fp8", "lossless",
    "dgc", "onebit_adam", "onebit_lamb", "diloco", "zero", "choco",
    "decoupled_momentum", "DecoupledMomentumState", "streaming_diloco",
    "fsdp_gather", "fsdp_shard", "fsdp_unshard", "fsdp_like", "fsdp_specs", "ZeroState",
    "compressed_mean", "CompressedMeanState", "AxisNotBoundError", "REDUCERS",
    "communication_plan", "CommunicationPlan", "Transfer",
    "collective_bytes", "CollectiveReport", "ring_bytes",
    "state_specs", "shard_state", "unshard_state", "pmap_state", "per_replica_mask", "vary",
    "init_sharded", "infer_per_replica", "collectives",
    "data_parallel", "DataParallel", "TrainState", "accumulate", "sync_in_backward", "InBackwardSync",
]
