"""The interface of an exchange (see [`commjax.exchanges`][])."""

from __future__ import annotations

from typing import Any, Optional, Sequence

import jax

from commjax.compressors.base import Compressor, Segment

__all__ = ["Exchange"]


class Exchange:
    """How a stateful compressor averages a bucket over a mesh axis.

    The bucket is held as one padded flat part per [`Segment`][commjax.exchanges.base.Segment]; the
    state is
    replicated (identical on every replica) and lives in
    ``CompressedMeanState.compressor_state``.
    """

    def init_state(self, codec: Compressor, segments: Sequence[Segment], num_replicas: int,
                   key: jax.Array) -> Any:
        """The replicated state before the first step (``key`` is shared by all replicas)."""
        return ()

    def run(self, codec: Compressor, parts: Sequence[jax.Array], segments: Sequence[Segment],
            state: Any, *, axis_name: Any, num_replicas: int, shared_key: jax.Array,
            init_key: jax.Array, count: jax.Array,
            residuals: Optional[Sequence[jax.Array]] = None) -> tuple[list, list, Any, list]:
        """One step: ``(means, locals, new_state, finite)``, per segment arrays in the
        shapes of ``parts`` (each its leaf's shape, unpadded) and a boolean scalar;
        ``means`` identical on every replica, ``locals`` what error feedback subtracts from
        this replica's input, ``finite`` whether the segment's mean is finite (identical on every replica; the transform flags the leaf
        and keeps its residual where it is not). ``axis_name=None``: one replica, no collective.
        ``shared_key``: this step's key, ``init_key``: the key ``init_state`` was given,
        both replica 0's (the same on every replica even if processes were seeded apart).
        ``residuals`` (per segment, in the parts' shapes): error feedback's, to be added to
        ``parts``: the input is then ``parts + residuals``, which the exchange may form
        where it reads it instead of as one array."""
        raise NotImplementedError

    def bytes(self, codec: Compressor, segments: Sequence[Segment], num_replicas: int) -> float:
        """Analytic per-device ring bytes of one (steady-state) step."""
        raise NotImplementedError
