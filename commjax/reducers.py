"""Reducers: how compressed payloads travel between the replicas of a mesh axis.

Per-device bytes below are those a bandwidth-optimal ring sends (the same convention as
:func:`commjax.accounting.ring_bytes`), for ``N`` replicas and a payload of ``P`` bytes
per replica:

============  =======================================  ==================================
reducer       collectives                              bytes sent per device
============  =======================================  ==================================
allreduce     one ``psum`` of the linear payload       ``2 (N-1)/N * P``
allgather     one all-gather of every payload          ``(N-1) * P``  (grows with N)
two_phase     all-to-all of chunks, then all-gather    ``2 (N-1)/N * P``  (flat in N)
============  =======================================  ==================================

``two_phase``: replica ``j`` receives chunk ``j`` of every replica's payload, decodes and
sums them in fp32 (in replica order, so the sum is deterministic), re-encodes the mean of
its chunk with a *server-side* error feedback, and all-gathers the re-encoded chunks.
Every replica then decodes the same words, so the result is bit-identical everywhere.

Quantized payloads are never summed as integers (``psum`` on small integer types wraps
around silently): only compressors with ``linear = True`` may use ``allreduce``.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional, Sequence

import jax
import jax.numpy as jnp

from commjax import _compat, bucket as flat_bucket
from commjax.accounting import ring_bytes
from commjax.compressors.base import Compressor, Segment

__all__ = [
    "REDUCERS",
    "ReduceResult",
    "valid_reducers",
    "choose_reducer",
    "reduced_length",
    "server_residual_size",
    "reducer_wire_bytes",
    "reduce_mean",
    "reduce_mean_parts",
]

REDUCERS = ("auto", "allreduce", "allgather", "two_phase")


class PartsResult(NamedTuple):
    means: list  # float32[size] per segment: the mean estimate, identical on every replica
    locals: list  # float32[size] per segment: decode(encode(x)) of this replica's payload
    server_residual: jax.Array  # as in ReduceResult


class ReduceResult(NamedTuple):
    mean: jax.Array  # float32[n]: the estimate of the mean, identical on every replica
    local: jax.Array  # float32[n]: decode(encode(x)) of this replica's own payload
    server_residual: jax.Array  # float32[n_chunk] (two_phase) or float32[0]


def valid_reducers(compressor: Compressor) -> tuple[str, ...]:
    """The reducers that can carry ``compressor``'s payload."""
    out = []
    if compressor.linear:
        out.append("allreduce")
    out.append("allgather")
    if compressor.chunkable:
        out.append("two_phase")
    return tuple(out)


def check_reducer(compressor: Compressor, reducer: str) -> str:
    if reducer not in REDUCERS:
        raise ValueError(
            f"compressed_mean: `reducer` must be one of {', '.join(map(repr, REDUCERS))}; "
            f"got {reducer!r}."
        )
    if reducer != "auto" and reducer not in valid_reducers(compressor):
        why = {
            "allreduce": "its payload is not linear (summing quantized codes is wrong, "
            "and psum on small integers wraps around)",
            "two_phase": "its payload is not made of independent blocks",
        }.get(reducer, "")
        raise ValueError(
            f"compressed_mean: reducer={reducer!r} cannot carry {compressor.name} payloads: "
            f"{why}. Valid reducers for {compressor.name}: "
            f"{', '.join(map(repr, valid_reducers(compressor) + ('auto',)))}."
        )
    return reducer


def reduced_length(compressor: Compressor, n: int, num_replicas: int, reducer: str) -> int:
    """Length the flat buffer is padded to before reduction."""
    a = compressor.alignment
    if reducer == "two_phase":
        a *= num_replicas
    return -(-n // a) * a if n else 0


def server_residual_size(compressor: Compressor, n: int, num_replicas: int, reducer: str) -> int:
    if reducer != "two_phase" or n == 0:
        return 0
    return reduced_length(compressor, n, num_replicas, reducer) // num_replicas


def reducer_wire_bytes(
    compressor: Compressor,
    n: int,
    num_replicas: int,
    reducer: str,
    segments: Optional[Sequence[Segment]] = None,
) -> float:
    """Analytic per-device ring bytes to reduce ``n`` elements (``n`` aligned)."""
    if num_replicas <= 1 or n == 0 or reducer == "none":
        return 0.0
    m = reduced_length(compressor, n, num_replicas, reducer)
    if reducer == "allreduce":
        return ring_bytes("all-reduce", compressor.linear_payload_bytes(m), num_replicas)
    payload = compressor.payload_bytes(m, segments)
    if reducer == "allgather":
        return ring_bytes("all-gather", payload, num_replicas)
    if reducer == "two_phase":
        return ring_bytes("all-to-all", payload, num_replicas) + ring_bytes(
            "all-gather", payload // num_replicas, num_replicas
        )
    raise ValueError(f"unknown reducer {reducer!r}")


def choose_reducer(
    compressor: Compressor,
    reducer: str,
    n: int,
    num_replicas: int,
    segments: Optional[Sequence[Segment]] = None,
) -> str:
    """Resolve ``"auto"`` to the valid reducer that sends the fewest bytes.

    Ties go to the more exact one: an fp32 ``allreduce`` first (no re-encoding), then
    ``allgather`` (one encoding), then ``two_phase`` (two encodings). A 16-bit linear
    payload (``cast``) prefers ``two_phase``, which sums in fp32 rather than in 16 bits.
    """
    reducer = check_reducer(compressor, reducer)
    if num_replicas <= 1:
        return "none"
    if reducer != "auto":
        return reducer
    options = []
    for rank, r in enumerate(("allreduce", "allgather", "two_phase")):
        if r not in valid_reducers(compressor):
            continue
        if r == "allreduce" and compressor.linear_payload_bytes(2) < 8:
            rank = 3  # 16-bit sums: only if strictly cheaper
        options.append((reducer_wire_bytes(compressor, n, num_replicas, r, segments), rank, r))
    return min(options)[2]


def _mean_of_decoded(compressor: Compressor, words: jax.Array, n: int, num_replicas: int,
                     segments: Optional[Sequence[Segment]] = None) -> jax.Array:
    """``(1/N) sum_r decode(words[r], n)`` over the leading replica axis of ``words``, in
    replica order from fp32 zeros: every replica that holds the same words computes the
    identical sum."""
    total = jnp.zeros((n,), jnp.float32)
    for r in range(num_replicas):
        total = total + compressor.decode(words[r], n, segments)
    return total / num_replicas


def _two_phase_exchange(
    compressor: Compressor,
    words: jax.Array,
    m: int,
    *,
    axis_name: Any,
    num_replicas: int,
    enc_key: Optional[jax.Array],
    server_residual: Optional[jax.Array],
    server_error_feedback: bool,
) -> tuple[jax.Array, jax.Array]:
    """The two collectives of the two-phase reducer on the payload ``words`` of ``m``
    elements (``m`` a multiple of ``N`` blocks): all-to-all of chunks, decode and sum the
    chunk this replica owns, re-encode it (with the server residual), all-gather.
    Returns the gathered words of the whole mean and the new server residual."""
    empty = jnp.zeros((0,), jnp.float32)
    block = compressor.alignment
    chunk = m // num_replicas
    row = words.shape[0] // (m // block)
    rows = words.reshape(num_replicas, (chunk // block) * row)
    received = _compat.all_to_all(rows, axis_name)  # [N, chunk words], from each replica
    mine = _mean_of_decoded(compressor, received, chunk, num_replicas)
    if server_residual is None or not server_error_feedback:
        server_in = mine
    else:
        server_in = mine + server_residual.astype(jnp.float32)
    server_key = None if enc_key is None else jax.random.fold_in(enc_key, 0x5E7)
    server_words, server_local = compressor.encode_and_decode(server_in, server_key, None)
    new_server = server_in - server_local
    if server_residual is None or not server_error_feedback:
        new_server = empty if server_residual is None else jnp.zeros_like(server_residual)
    else:
        new_server = new_server.astype(server_residual.dtype)
    return _compat.all_gather_invariant(server_words, axis_name, tiled=True), new_server


def reduce_mean(
    compressor: Compressor,
    x: jax.Array,
    *,
    axis_name: Any,
    num_replicas: int,
    reducer: str,
    key: Optional[jax.Array],
    shared_key: Optional[jax.Array],
    server_residual: Optional[jax.Array] = None,
    segments: Optional[Sequence[Segment]] = None,
    server_error_feedback: bool = True,
) -> ReduceResult:
    """Estimate the mean over ``axis_name`` of the flat float32 vector ``x``.

    ``key`` is this replica's own key (stochastic rounding), ``shared_key`` one that is
    identical on every replica (random masks). ``x``'s length must be a multiple of
    ``compressor.alignment``; it is padded here for the two-phase chunks.
    """
    n = x.shape[0]
    enc_key = shared_key if compressor.shared_randomness else key
    empty = jnp.zeros((0,), jnp.float32)
    if reducer == "none" or num_replicas <= 1 or axis_name is None:
        local = compressor.encode_and_decode(x, enc_key, segments)[1]
        return ReduceResult(local, local, empty if server_residual is None else server_residual)

    if reducer == "allreduce":
        payload = compressor.encode_linear(x, enc_key)
        local = compressor.decode_linear(payload, n)
        total = compressor.decode_linear(_compat.psum(payload, axis_name), n)
        return ReduceResult(total / num_replicas, local, empty if server_residual is None else server_residual)

    if reducer == "allgather":
        words, local = compressor.encode_and_decode(x, enc_key, segments)
        gathered = _compat.all_gather_invariant(words, axis_name, tiled=False)  # [N, P]
        mean = _mean_of_decoded(compressor, gathered, n, num_replicas, segments)
        return ReduceResult(mean, local, empty if server_residual is None else server_residual)

    if reducer == "two_phase":
        m = reduced_length(compressor, n, num_replicas, reducer)
        words, local = compressor.encode_and_decode(jnp.pad(x, (0, m - n)), enc_key, None)
        gathered, new_server = _two_phase_exchange(
            compressor, words, m, axis_name=axis_name, num_replicas=num_replicas,
            enc_key=enc_key, server_residual=server_residual,
            server_error_feedback=server_error_feedback,
        )
        return ReduceResult(compressor.decode(gathered, m, None)[:n], local[:n], new_server)

    raise ValueError(f"unknown reducer {reducer!r}")


def _segment_words(compressor: Compressor, words: jax.Array, seg: Segment) -> jax.Array:
    """The words of a block codec's payload that encode segment ``seg`` (whole blocks)."""
    block = compressor.alignment
    row = compressor.payload_words(block)
    lo = seg.offset // block * row
    return words[..., lo:lo + seg.padded_size // block * row]


def reduce_mean_parts(
    compressor: Compressor,
    parts: Sequence[jax.Array],
    segments: Sequence[Segment],
    *,
    axis_name: Any,
    num_replicas: int,
    reducer: str,
    key: Optional[jax.Array],
    shared_key: Optional[jax.Array],
    server_residual: Optional[jax.Array] = None,
    server_error_feedback: bool = True,
) -> PartsResult:
    """:func:`reduce_mean` of the bucket held as one array per segment (``parts[i]`` is
    ``segments[i].padded_size`` long; the segments lie back to back).

    Block codecs (``chunkable``) encode and decode each part on its own: no block spans
    two segments, so the payload is the concatenation of the parts' payloads: bit for bit
    the words that encoding the joined bucket gives (stochastic rounding noise is drawn
    by position in the bucket, ``start``). The full-size bucket is then never written, only
    its words, and each segment's mean is decoded straight from its own words. Other
    compressors see the joined bucket (:func:`reduce_mean`).

    Returns the mean and the local decode of each segment (``segments[i].size`` long,
    padding dropped) and the two-phase server residual.
    """
    if not compressor.chunkable or not segments or reducer == "allreduce":
        # Selections that span leaves, and linear payloads (summed, not decoded, by the
        # all-reduce), work on the joined bucket.
        res = reduce_mean(
            compressor, flat_bucket.concat(parts), axis_name=axis_name,
            num_replicas=num_replicas, reducer=reducer, key=key, shared_key=shared_key,
            server_residual=server_residual, segments=segments,
            server_error_feedback=server_error_feedback,
        )
        return PartsResult(flat_bucket.cut(res.mean, segments), flat_bucket.cut(res.local, segments),
                           res.server_residual)
    enc_key = shared_key if compressor.shared_randomness else key
    words, locals_ = [], []
    for p, s in zip(parts, segments):
        w, local = compressor.encode_and_decode(p, enc_key, start=s.offset)
        words.append(w)
        locals_.append(local[:s.size])
    server = jnp.zeros((0,), jnp.float32) if server_residual is None else server_residual
    if reducer == "none" or num_replicas <= 1 or axis_name is None:
        return PartsResult(list(locals_), locals_, server)
    words = jnp.concatenate(words)
    if reducer == "allgather":
        gathered = _compat.all_gather_invariant(words, axis_name, tiled=False)  # [N, P]
        means = [_mean_of_decoded(compressor, _segment_words(compressor, gathered, s),
                                  s.padded_size, num_replicas)[:s.size] for s in segments]
        return PartsResult(means, locals_, server)
    if reducer == "two_phase":
        n = sum(s.padded_size for s in segments)
        m = reduced_length(compressor, n, num_replicas, reducer)
        if m > n:
            # Whole zero blocks up to a multiple of N blocks: their encoding, once.
            zeros = jnp.zeros((m - n,), jnp.float32)
            words = jnp.concatenate([words, compressor.encode(zeros, enc_key, start=n)])
        gathered, new_server = _two_phase_exchange(
            compressor, words, m, axis_name=axis_name, num_replicas=num_replicas,
            enc_key=enc_key, server_residual=server_residual,
            server_error_feedback=server_error_feedback,
        )
        means = [compressor.decode(_segment_words(compressor, gathered, s), s.padded_size)[:s.size]
                 for s in segments]
        return PartsResult(means, locals_, new_server)
    raise ValueError(f"unknown reducer {reducer!r}")
