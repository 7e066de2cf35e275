"""commjax: communication-efficient optimizers for JAX.

Compressed gradient exchange as optax transforms, inside ``jax.shard_map``/``jax.pmap``::

    import commjax as cj
    tx = optax.chain(cj.compressed_mean(cj.quantize(bits=4), axis_name="data"),
                     optax.adam(1e-3))
"""

from commjax import collectives
from commjax._compat import vary
from commjax.accounting import CollectiveReport, collective_bytes, exact_mean_bytes, ring_bytes
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
from commjax.fsdp import (
    fsdp_gather, fsdp_like, fsdp_shard, fsdp_specs, fsdp_unshard, fsdp_wire_bytes,
)
from commjax.optimizers import choco, dgc, diloco, onebit_adam, onebit_lamb, zero
from commjax.optimizers.decoupled_momentum import (
    DecoupledMomentumState, decoupled_momentum, decoupled_momentum_wire_bytes,
)
from commjax.optimizers.streaming_diloco import streaming_diloco, streaming_diloco_bytes
from commjax.optimizers.zero import ZeroState, zero_wire_bytes
from commjax.plan import CommunicationPlan, communication_plan
from commjax.collectives import REDUCERS
from commjax.transform import AxisNotBoundError, CompressedMeanState, compressed_mean
from commjax.step import DataParallel, TrainState, data_parallel

__version__ = "0.1.0"

__all__ = [
    "Compressor", "identity", "cast", "quantize", "qsgd", "terngrad", "sign",
    "top_k", "random_k", "threshold", "powersgd", "hadamard",
    "fp8", "lossless",
    "dgc", "onebit_adam", "onebit_lamb", "diloco", "zero", "choco",
    "decoupled_momentum", "DecoupledMomentumState", "decoupled_momentum_wire_bytes",
    "streaming_diloco", "streaming_diloco_bytes",
    "fsdp_gather", "fsdp_shard", "fsdp_unshard", "fsdp_like", "fsdp_specs", "fsdp_wire_bytes",
    "ZeroState", "zero_wire_bytes",
    "compressed_mean", "CompressedMeanState", "AxisNotBoundError", "REDUCERS",
    "communication_plan", "CommunicationPlan",
    "collective_bytes", "CollectiveReport", "ring_bytes", "exact_mean_bytes",
    "state_specs", "shard_state", "unshard_state", "pmap_state", "per_replica_mask", "vary",
    "init_sharded", "infer_per_replica", "collectives",
    "data_parallel", "DataParallel", "TrainState", "accumulate",
]
