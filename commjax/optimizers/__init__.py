"""Complete communication-efficient optimizers (optax ``GradientTransformation`` factories).

Each optimizer here runs its own compressed exchange inside ``jax.shard_map``/``jax.pmap``
and returns updates identical on every replica.
"""

# Other optimizers add their imports and names below.
from commjax.optimizers.choco import ChocoState, choco, consensus_distance
from commjax.optimizers.decoupled_momentum import DecoupledMomentumState, decoupled_momentum
from commjax.optimizers.dgc import DGCState, dgc, dgc_ratios
from commjax.optimizers.diloco import DiLoCoState, diloco, landing_update
from commjax.optimizers.onebit import onebit_adam, onebit_lamb
from commjax.optimizers.streaming_diloco import (
    Piece, StreamingDiLoCoState, fragment_leaves, streaming_diloco,
)
from commjax.optimizers.zero import ZeroState, zero

__all__ = [
    "ChocoState", "choco", "consensus_distance",
    "DecoupledMomentumState", "decoupled_momentum",
    "DGCState", "dgc", "dgc_ratios",
    "DiLoCoState", "diloco", "landing_update",
    "onebit_adam", "onebit_lamb",
    "StreamingDiLoCoState", "streaming_diloco", "fragment_leaves", "Piece",
    "ZeroState", "zero",
]
