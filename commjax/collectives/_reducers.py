"""How ``all_reduce`` and ``compressed_mean`` move a bucket of payloads: the
``Reducer`` strategies (all-reduce, all-gather, two-phase, shared mask) and the
rule that picks one."""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar, NamedTuple, Optional, Sequence

import jax
import jax.numpy as jnp
from jax import lax

from commjax import _compat, bucket as flat_bucket
from commjax.accounting import ring_bytes
from commjax.compressors.base import BlockCompressor, Compressor, Segment
from commjax.compressors.sparse import TopK
from commjax.collectives._exact import prescale, unscale_mean
from commjax.collectives._common import (
    _encode_rows_feedback, _fallback_cond, _flag_bytes, _overflow_anywhere, _round_up,
    decode_rows, decode_sum, encode_rows, gather_rows, gather_words, gathered_bytes,
)


# ----------------------------------------------------------------- all_reduce reducers

#: Density multiplier of a top-k two-phase owner's re-selection (see ``TwoPhase``).
SERVER_DENSITY = 4.0

#: ``"auto"`` picks the two-phase reducer for a codec that selects its entries (top-k,
#: threshold) only when it sends at most ``1 / RESELECT_MARGIN`` of the all-gather's
#: bytes: the owner's second selection costs quality (``choose_reducer``).
RESELECT_MARGIN = 2.0


class PartsResult(NamedTuple):
    """What a reducer returns for a bucket held as one flat array per segment."""

    means: list  # float32[size] per segment: the estimate, identical on every replica
    residuals: list  # float32[size] per segment: y - C(y) of this replica (or C(y) w/o EF)
    server_residual: jax.Array  # float32[chunk] (two_phase) or float32[0]
    #: Per segment, replicated: whether every payload that made its mean was finite (read
    #: from the payloads' scale words, for codecs that have them); ``None``: not known.
    finite: Optional[list] = None
    #: Whether ``residuals`` already hold the old residual on every segment flagged in
    #: ``reduce_parts``'s ``keep`` (else the caller selects them).
    kept: bool = False
    #: This replica's own payloads as ``(words, n, segments)`` (``Compressor.payload_metrics``);
    #: ``None`` where a reducer does not report them (block codecs, which have no metrics).
    sent: Optional[list] = None


@dataclasses.dataclass(frozen=True)
class Reducer:
    """How an ``all_reduce`` moves payloads: a small strategy object.

    ``bytes(codec, n, N)`` is the per-device ring cost for a bucket of ``n`` (aligned)
    elements; ``reduce(...)`` runs it on the bucket held as one padded part per segment.
    """

    name: ClassVar[str] = "reducer"

    def why_not(self, codec: Compressor) -> Optional[str]:
        """``None`` if this reducer can carry ``codec``'s payload, else the reason."""
        return None

    def padded_length(self, codec: Compressor, n: int, num_replicas: int) -> int:
        return _round_up(n, codec.alignment) if n else 0

    def server_residual_size(self, codec: Compressor, n: int, num_replicas: int) -> int:
        return 0

    def bytes(self, codec: Compressor, n: int, num_replicas: int,
              segments: Optional[Sequence[Segment]] = None) -> float:
        raise NotImplementedError

    def reduce(self, codec, parts, segments, **kwargs) -> PartsResult:
        raise NotImplementedError

    def reports_finite(self, codec: Compressor) -> bool:
        """Whether ``reduce`` returns ``PartsResult.finite`` for ``codec``: then a
        non-finite input on any replica is already flagged on every replica by what they
        all receive, and the transform sends no flags of its own."""
        return False

    def keeps_leaves_apart(self, codec: Compressor) -> bool:
        """Whether a non-finite leaf leaves what the other leaves send untouched: a
        ``leaf_local`` codec's payloads, each leaf encoded on its own. Otherwise the
        transform zeroes a flagged leaf before encoding."""
        return codec.leaf_local


def _local_parts(codec, parts, segments, residuals, key):
    """Encode every part (with feedback when ``residuals``): ``(words, locals_or_res)``."""
    words, outs = [], []
    for k, (p, s) in enumerate(zip(parts, segments)):
        if residuals is None:
            w, local = codec.encode_and_decode(p, key, start=s.offset)
            outs.append(local[:s.size])
        else:
            res = jnp.pad(residuals[k].astype(jnp.float32), (0, s.padded_size - s.size))
            w, e = codec.encode_feedback(p, res, key, start=s.offset)
            outs.append(e[:s.size])
        words.append(w)
    return words, outs


def _segment_words(codec: Compressor, words: jax.Array, seg: Segment) -> jax.Array:
    """The words of a block codec's payload that encode ``seg`` (whole blocks)."""
    row = codec.payload_words(codec.alignment)
    lo = seg.offset // codec.alignment * row
    return words[..., lo:lo + seg.padded_size // codec.alignment * row]


@dataclasses.dataclass(frozen=True)
class AllReduce(Reducer):
    """``psum`` of a linear payload (the identity, ``cast``): ``2 (N-1)/N * P``."""

    name: ClassVar[str] = "allreduce"

    def why_not(self, codec):
        if codec.shared_randomness:
            return "its positions come from a shared key (reducer 'auto')"
        if not codec.linear:
            return ("its payload is not linear (summing quantized codes is wrong, and psum on "
                    "small integers wraps around)")
        if codec.linear_payload_bytes(2) < 8:
            return ("a 16-bit sum loses precision at every addition (and XLA on CPU sends it "
                    "widened to fp32); 'two_phase' sends the same 16-bit words and sums in fp32")
        return None

    def bytes(self, codec, n, num_replicas, segments=None):
        return ring_bytes("all-reduce", codec.linear_payload_bytes(self.padded_length(codec, n, num_replicas)),
                          num_replicas)

    def reduce(self, codec, parts, segments, *, axis_name, num_replicas, key, residuals=None,
               server_residual=None, server_error_feedback=True, keep=None):
        y = _joined(parts, segments, residuals)
        n = y.shape[0]
        payload = codec.encode_linear(y, key)
        local = codec.decode_linear(payload, n)
        # Summed pre-scaled (prescale): a mean fp32 can hold survives an overflowing sum.
        total = unscale_mean(codec.decode_linear(
            _compat.psum(prescale(payload, num_replicas), axis_name), n), num_replicas)
        outs = flat_bucket.cut(local if residuals is None else y - local, segments)
        return PartsResult(flat_bucket.cut(total, segments), outs, _empty(server_residual))


def tells_finite(codec: Compressor) -> bool:
    """Whether ``codec``'s [`payload_finite`][commjax.compressors.base.Compressor.payload_finite]
    can tell (is not ``None``):
    asked of the method itself, on the abstract words of one block, so that the answer
    cannot disagree with what the reducers read."""
    if not isinstance(codec, BlockCompressor):
        return False
    words = jax.ShapeDtypeStruct((codec.payload_words(codec.alignment),), jnp.uint32)
    return jax.eval_shape(codec.payload_finite, words) is not None


def _payload_finite(codec: Compressor, words: list) -> Optional[list]:
    """Per segment: all its payload scales finite (every replica holds the same words);
    ``None`` for a codec that cannot tell from its words."""
    flags = [codec.payload_finite(w) for w in words]
    return None if any(f is None for f in flags) else flags


def _empty(server_residual):
    return jnp.zeros((0,), jnp.float32) if server_residual is None else server_residual


@dataclasses.dataclass(frozen=True)
class AllGather(Reducer):
    """All-gather of every payload, each replica decodes and sums all: ``(N-1) P``."""

    name: ClassVar[str] = "allgather"

    def why_not(self, codec):
        return "its positions come from a shared key (reducer 'auto')" if codec.shared_randomness else None

    def bytes(self, codec, n, num_replicas, segments=None):
        m = self.padded_length(codec, n, num_replicas)
        # Other codecs go through ``_gather_whole``, which keeps the rows padded.
        return gathered_bytes(codec.payload_bytes(m, segments), num_replicas,
                              rows=not isinstance(codec, BlockCompressor))

    def reports_finite(self, codec):
        return tells_finite(codec)

    def reduce(self, codec, parts, segments, *, axis_name, num_replicas, key, residuals=None,
               server_residual=None, server_error_feedback=True, keep=None):
        if not isinstance(codec, BlockCompressor):
            return _gather_whole(codec, parts, segments, axis_name, num_replicas, key, residuals,
                                 server_residual, keep)
        if codec.fallback is not None:
            return _gather_with_fallback(codec, parts, segments, axis_name, num_replicas, key,
                                         residuals, server_residual)
        words, outs = _local_parts(codec, parts, segments, residuals, key)
        got = gather_words(jnp.concatenate(words), axis_name, num_replicas, tiled=False)
        means = [decode_sum(codec, _segment_words(codec, got, s), s.padded_size, num_replicas)[:s.size]
                 for s in segments]
        finite = _payload_finite(codec, [_segment_words(codec, got, s) for s in segments])
        return PartsResult(means, outs, _empty(server_residual), finite)


def _with_residuals(parts, segments, residuals):
    """Error feedback's ``y = part + residual`` per segment (fp32), or the parts."""
    if residuals is None:
        return list(parts)
    return [p + jnp.pad(r.astype(jnp.float32), (0, s.padded_size - s.size))
            for p, r, s in zip(parts, residuals, segments)]


def _encode_ys(codec, ys, segments, residuals, key):
    """``(words, outs)`` of ``_local_parts`` from the ``y`` already formed: the same
    arithmetic (encode ``y``, ``y - C(y)``), with ``y`` kept for a fallback."""
    words, local = _local_parts(codec, ys, segments, None, key)
    if residuals is None:
        return words, local
    return words, [y[:s.size] - c for y, c, s in zip(ys, local, segments)]


def _gather_with_fallback(codec, parts, segments, axis_name, num_replicas, key, residuals,
                          server_residual):
    """All-gather reducer of a codec with a [`fallback`][commjax.Compressor.fallback]: the coded
    payloads; and, if some gathered payload overflowed (read from the gathered words, the
    same on every replica), the fallback's payloads of the same ``y``, whose mean is used."""
    ys = _with_residuals(parts, segments, residuals)
    words, outs = _encode_ys(codec, ys, segments, residuals, key)
    got = gather_words(jnp.concatenate(words), axis_name, num_replicas, tiled=False)

    def means_of(c, g):
        return [decode_sum(c, _segment_words(c, g, s), s.padded_size, num_replicas)[:s.size]
                for s in segments]

    def raw():
        fb = codec.fallback
        fb_words = jnp.concatenate([fb.encode(y, None, start=s.offset) for y, s in zip(ys, segments)])
        return means_of(fb, gather_words(fb_words, axis_name, num_replicas, tiled=False))

    means = lax.cond(codec.payload_overflow(got), raw, lambda: means_of(codec, got))
    finite = _payload_finite(codec, [_segment_words(codec, got, s) for s in segments])
    return PartsResult(means, outs, _empty(server_residual), finite)


def _gather_whole(codec, parts, segments, axis_name, num_replicas, key, residuals, server_residual,
                  keep=None):
    """All-gather reducer of a codec that is not a block codec: each replica's payload of
    the whole bucket, decoded and summed into one bucket-size vector (top-k per leaf: a
    vector per leaf, ``TopK.decode_sum_leaves``).

    With ``keep`` (and residuals) the new residuals are final before the exchange: the
    old one on a flagged segment. An optimization barrier then puts them ahead of the
    all-gather, so that what they are made from (``y = part + residual``, a top-k
    selection's scratch) is freed before the bucket-size sum is allocated."""
    per_leaf = isinstance(codec, TopK) and codec.leaf_local
    if per_leaf:
        words, outs = _encode_segmentwise(codec, parts, segments, residuals, key, keep)
    else:
        # The selection spans leaves: encode the joined bucket.
        x = _joined(parts, segments, residuals)
        if residuals is None:
            words, out = codec.encode_and_decode(x, key, segments)
        else:
            words, out = codec.encode_residual(x, key, segments)
        outs = flat_bucket.cut(out, segments)
        if keep is not None and residuals is not None:
            outs = [jnp.where(b, r.astype(jnp.float32), e) for b, r, e in zip(keep, residuals, outs)]
    kept = keep is not None and residuals is not None
    if kept:
        words, outs = lax.optimization_barrier((words, outs))
    got = gather_rows(words, axis_name, num_replicas)
    n = sum(s.padded_size for s in segments)
    if per_leaf:  # no bucket-size sum to cut
        means = codec.decode_sum_leaves(got, segments, divide=num_replicas)
    else:
        means = flat_bucket.cut(codec.decode_sum(got, n, segments, divide=num_replicas), segments)
    return PartsResult(means, outs, _empty(server_residual), kept=kept, sent=[(words, n, segments)])


def _encode_segmentwise(codec, parts, segments, residuals, key, keep=None):
    """The joined bucket's payload and outputs, a segment at a time: for a codec whose
    selection domains are the segments (top-k per leaf) the payload is the segments'
    payloads back to back, the same words, and no copy of the whole bucket is joined.

    With residuals, each new residual is ``y`` with the sent entries subtracted in place
    (``TopK.residual_from``); with ``keep`` the old residual where its segment is flagged,
    selected before the selection (which then picks from the old residual, and nothing is
    subtracted): one leaf-size buffer is read by the selection and becomes the residual.
    A flagged segment's mean is discarded (``_finish_leaves`` makes it NaN), so what it
    sends does not matter; a select after the selection kept ``y`` and the selected copy
    as two buffers (on a v5e the copy went out to HBM and back: 134 MB of the MLP's step)."""
    words, outs = [], []
    ys = _with_residuals(parts, segments, residuals)
    for k, (y, s) in enumerate(zip(ys, segments)):
        one = [Segment(0, s.size, s.padded_size, s.shape)]
        flag = None if keep is None or residuals is None else keep[k]
        if flag is not None:
            y = jnp.where(flag, jnp.pad(residuals[k].astype(jnp.float32), (0, s.padded_size - s.size)), y)
        w = codec.encode(y, key, one)
        if residuals is None:
            out = codec.decode(w, y.shape[0], one)
        else:
            out = codec.residual_from(y, w, one, kept=flag)
        words.append(w)
        outs.append(out[:s.size])
    return jnp.concatenate(words), outs


@dataclasses.dataclass(frozen=True)
class TwoPhase(Reducer):
    """All-to-all of chunks, decode + sum + re-encode one chunk, all-gather: ``2 (N-1)/N P``.

    Replica ``j`` receives chunk ``j`` of every payload, sums the decoded chunks in replica
    order in fp32, re-encodes the chunk's mean with a server-side residual (its own error
    feedback) and all-gathers the re-encoded chunks: per-device bytes independent of
    ``N``. Block codecs send whole blocks per chunk; other codecs (top-k) select within
    each destination chunk, and the owner re-selects from the chunk's mean.
    """

    name: ClassVar[str] = "two_phase"
    #: Codec of the owner's re-encoding of its chunk. ``None``: the same codec, except
    #: top-k, whose owner keeps ``SERVER_DENSITY`` times its density: the chunk's sum
    #: holds up to ``N`` times more entries than each replica sent, and re-selecting only
    #: ``k`` of them cost the non-i.i.d. benchmark task twice the loss gap of the all-gather
    #: (benchmarks/results/sparse_convergence.json).
    server_codec: Optional[Compressor] = None

    def _server(self, codec: Compressor) -> Compressor:
        if self.server_codec is not None:
            return self.server_codec
        if isinstance(codec, TopK):
            return dataclasses.replace(codec, ratio=min(1.0, SERVER_DENSITY * codec.ratio))
        return codec

    def why_not(self, codec):
        server = self._server(codec)
        if isinstance(codec, BlockCompressor) and (
                not isinstance(server, BlockCompressor) or server.alignment != codec.alignment):
            return "its server codec must be a block codec with the same block size"
        if codec.shared_randomness or (codec.linear and not isinstance(codec, BlockCompressor)):
            return "its payload is summed by an all-reduce (a linear exchange)"
        return None

    def padded_length(self, codec, n, num_replicas):
        return _round_up(n, codec.alignment * num_replicas) if n else 0

    def server_residual_size(self, codec, n, num_replicas):
        return self.padded_length(codec, n, num_replicas) // num_replicas if n else 0

    def bytes(self, codec, n, num_replicas, segments=None):
        m = self.padded_length(codec, n, num_replicas)
        chunk = codec.payload_bytes(m // num_replicas)
        server = self._server(codec).payload_bytes(m // num_replicas)
        return (ring_bytes("all-to-all", num_replicas * chunk, num_replicas)
                + gathered_bytes(server, num_replicas) + _flag_bytes(codec, num_replicas))

    def reports_finite(self, codec):
        # A non-finite block decodes to non-finite values on its owner, whose sum then
        # encodes to a non-finite scale in the all-gathered words.
        return isinstance(codec, BlockCompressor) and tells_finite(self._server(codec))

    def keeps_leaves_apart(self, codec):
        # A sparse codec selects within destination chunks of the joined bucket, which
        # span leaves (``_sparse_rows``); block codecs send whole blocks of one leaf.
        return codec.leaf_local and isinstance(codec, BlockCompressor)

    def reduce(self, codec, parts, segments, *, axis_name, num_replicas, key, residuals=None,
               server_residual=None, server_error_feedback=True, keep=None):
        n = sum(s.padded_size for s in segments)
        m = self.padded_length(codec, n, num_replicas)
        if isinstance(codec, BlockCompressor) and codec.fallback is not None:
            return _two_phase_with_fallback(
                codec, self._server(codec), parts, segments, m, axis_name, num_replicas, key,
                residuals, server_residual, server_error_feedback)
        if isinstance(codec, BlockCompressor):
            words, outs = _local_parts(codec, parts, segments, residuals, key)
            if m > n:  # whole zero blocks up to N chunks: their encoding, once
                words.append(codec.encode(jnp.zeros((m - n,), jnp.float32), key, start=n))
            rows = jnp.concatenate(words).reshape(num_replicas, -1)
            sent = None
        else:
            rows, outs = _sparse_rows(codec, parts, segments, residuals, key, m, num_replicas)
            sent = [(rows[r], m // num_replicas, None) for r in range(num_replicas)]
        server = self._server(codec)
        gathered, new_server = _two_phase_exchange(
            codec, server, rows, m // num_replicas, axis_name, num_replicas, key, server_residual,
            server_error_feedback)
        finite = None
        if isinstance(server, BlockCompressor):
            words = [_segment_words(server, gathered, s) for s in segments]
            means = [_fusable(server).decode(w, s.padded_size)[:s.size] for w, s in zip(words, segments)]
            finite = _payload_finite(server, words)
        else:
            full = decode_rows(server, gathered.reshape(num_replicas, -1), m // num_replicas)
            means = flat_bucket.cut(full.reshape(-1), segments)
        return PartsResult(means, outs, new_server, finite, sent=sent)


def _fusable(codec: Compressor) -> Compressor:
    """``codec`` with its decode in XLA's reference: the mean it decodes meets the
    optimizer's update next, into which XLA fuses the reference, where a kernel writes
    the values out to be read back (v5e, 21M-parameter MLP, int8 with
    ``kernels="pallas"``: 1,048 MB a step with the kernel, 910 MB without, at commit
    98453c1). The same bits. ZeRO's weights, which are written out in any case, keep the
    kernel (there the reference moved 921 MB against 822)."""
    if dataclasses.is_dataclass(codec) and "kernels" in {f.name for f in dataclasses.fields(codec)}:
        return dataclasses.replace(codec, kernels="reference")
    return codec


def _sparse_rows(codec, parts, segments, residuals, key, m, num_replicas):
    """A non-block codec's two-phase payload: the joined bucket cut into ``N`` destination
    chunks, each encoded (selected) on its own."""
    x = _joined(parts, segments, residuals)
    rows = jnp.pad(x, (0, m - x.shape[0])).reshape(num_replicas, -1)
    if residuals is None:
        words = encode_rows(codec, rows, key)
        local = decode_rows(codec, words, m // num_replicas)
        return words, flat_bucket.cut(local.reshape(-1), segments)
    words, e = _encode_rows_feedback(codec, rows, key)
    return words, flat_bucket.cut(e.reshape(-1), segments)


def _two_phase_exchange(codec, server, rows, chunk, axis_name, num_replicas, key, server_residual,
                        server_error_feedback):
    """All-to-all of the ``[N, w]`` destination rows, decode + sum + re-encode the chunk
    this replica owns, all-gather. Returns the gathered words (``[N * w]``) of the mean of
    the whole bucket and the new server residual."""
    received = _compat.all_to_all(rows, axis_name)
    mine = decode_sum(codec, received, chunk, num_replicas)
    words, new_server, _ = _server_encode(server, mine, key, server_residual, server_error_feedback)
    return gather_words(words, axis_name, num_replicas, tiled=True), new_server


def _server_encode(server, mine, key, server_residual, server_error_feedback):
    """The owner's re-encoding of its chunk's mean (with the server residual):
    ``(words, new_server_residual, server_in)``."""
    keep = server_residual is not None and server_error_feedback
    server_in = mine + server_residual.astype(jnp.float32) if keep else mine
    server_key = None if key is None else jax.random.fold_in(key, 0x5E7)
    if keep and isinstance(server, BlockCompressor) and server.reencode_by_feedback:
        # One pass of the codec's fused feedback (``y - decode(encode(y))``, the same bits).
        words, res = server.encode_feedback(mine, server_residual, server_key)
        return words, res.astype(server_residual.dtype), server_in
    words, local = server.encode_and_decode(server_in, server_key)
    if keep:
        new_server = (server_in - local).astype(server_residual.dtype)
    else:
        new_server = _empty(None) if server_residual is None else jnp.zeros_like(server_residual)
    return words, new_server, server_in


def _two_phase_with_fallback(codec, server, parts, segments, m, axis_name, num_replicas, key,
                             residuals, server_residual, server_error_feedback):
    """The two-phase reducer of a block codec with a [`fallback`][commjax.Compressor.fallback]
    ([`commjax.lossless`][]): at each phase the coded payloads travel, and if one
    overflowed on some replica (an fp32 flag summed over the axis after the all-to-all;
    read from the gathered words after the all-gather) the fallback's payloads of the
    same values travel too, on every replica, and are the ones decoded."""
    n, chunk = sum(s.padded_size for s in segments), m // num_replicas
    ys = _with_residuals(parts, segments, residuals)
    words, outs = _encode_ys(codec, ys, segments, residuals, key)
    y = jnp.pad(flat_bucket.concat(ys), (0, m - n))
    if m > n:  # whole zero blocks up to N chunks
        words.append(codec.encode(jnp.zeros((m - n,), jnp.float32), key, start=n))
    rows = jnp.concatenate(words).reshape(num_replicas, -1)
    received = _compat.all_to_all(rows, axis_name)

    def raw_sum():
        fb_rows = codec.fallback.encode(y, None).reshape(num_replicas, -1)
        return decode_sum(codec.fallback, _compat.all_to_all(fb_rows, axis_name), chunk, num_replicas)

    mine = lax.cond(_overflow_anywhere(codec, rows, axis_name), raw_sum,
                    lambda: decode_sum(codec, received, chunk, num_replicas))
    words, new_server, server_in = _server_encode(server, mine, key, server_residual,
                                                  server_error_feedback)
    gathered = gather_words(words, axis_name, num_replicas, tiled=True)

    def means_of(c, g):
        return [c.decode(_segment_words(c, g, s), s.padded_size)[:s.size] for s in segments]

    def raw_means():
        fb = server.fallback
        return means_of(fb, gather_words(fb.encode(server_in, None), axis_name, num_replicas, tiled=True))

    means = _fallback_cond(server, lambda: server.payload_overflow(gathered),
                           lambda: means_of(server, gathered), raw_means)
    finite = _payload_finite(server, [_segment_words(server, gathered, s) for s in segments])
    return PartsResult(means, outs, new_server, finite)


@dataclasses.dataclass(frozen=True)
class SharedMask(Reducer):
    """Codecs that keep the same ``K`` positions on every replica (random-k: positions
    from a key shared by all replicas). Only the values travel, reduced as a dense vector
    by the codec's ``value_codec``: fp32 in one all-reduce (``2 (N-1)/N * 4 K``), bf16 as
    packed words through the two-phase reducer (``2 (N-1)/N * 2 K``), summed in fp32."""

    name: ClassVar[str] = "shared_mask"

    def why_not(self, codec):
        return None if codec.shared_randomness else "its positions are not drawn from a shared key"

    def _values(self, codec, k: int, num_replicas: int):
        vcodec = codec.value_codec
        kp = _round_up(max(k, 1), vcodec.alignment)
        red = AllReduce() if AllReduce().why_not(vcodec) is None and vcodec.lossless else TwoPhase()
        return vcodec, kp, red

    def bytes(self, codec, n, num_replicas, segments=None):
        vcodec, kp, red = self._values(codec, codec.num_kept(n, segments), num_replicas)
        return red.bytes(vcodec, kp, num_replicas)

    def reduce(self, codec, parts, segments, *, axis_name, num_replicas, key, residuals=None,
               server_residual=None, server_error_feedback=True, keep=None):
        x = _joined(parts, segments, residuals)
        n = x.shape[0]
        vals = codec.encode_linear(x, key, segments).astype(jnp.float32)
        k = vals.shape[0]
        vcodec, kp, red = self._values(codec, k, num_replicas)
        seg = (Segment(0, k, kp, (k,)),)
        res = red.reduce(vcodec, [jnp.pad(vals, (0, kp - k))], seg, axis_name=axis_name,
                         num_replicas=num_replicas, key=None)
        mean = codec.decode_linear(res.means[0], n, key, segments)
        local = codec.decode_linear(vals, n, key, segments)
        outs = flat_bucket.cut(local if residuals is None else x - local, segments)
        return PartsResult(flat_bucket.cut(mean, segments), outs, _empty(server_residual))


def _joined(parts, segments, residuals):
    """The bucket as one flat vector (``part + residual`` with error feedback), added
    before joining: joining the parts and the residuals apart wrote two bucket-size
    vectors, and every reader of ``x`` then read both."""
    return flat_bucket.concat(_with_residuals(parts, segments, residuals))


REDUCERS = ("auto", "allreduce", "allgather", "two_phase")
_REDUCER_OBJECTS = {r.name: r for r in (AllReduce(), AllGather(), TwoPhase(), SharedMask())}


def get_reducer(reducer: Any) -> Reducer:
    """A ``Reducer`` from itself or its name (``"allreduce"``, ``"allgather"``,
    ``"two_phase"``)."""
    if isinstance(reducer, Reducer):
        return reducer
    if reducer not in _REDUCER_OBJECTS:
        raise ValueError(
            f"`reducer` must be one of {', '.join(map(repr, REDUCERS))} or a "
            f"commjax.collectives._reducers.Reducer; got {reducer!r}.")
    return _REDUCER_OBJECTS[reducer]


def valid_reducers(codec: Compressor) -> tuple[str, ...]:
    """Names of the reducers that can carry ``codec``'s payload."""
    return tuple(name for name, r in _REDUCER_OBJECTS.items() if r.why_not(codec) is None)


def check_reducer(codec: Compressor, reducer: Any, where: str = "compressed_mean") -> Any:
    """``reducer`` (``"auto"``, a name or a ``Reducer``) if it can carry ``codec``."""
    if reducer == "auto":
        return reducer
    try:
        obj = get_reducer(reducer)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None
    why = obj.why_not(codec)
    if why is not None:
        raise ValueError(
            f"{where}: reducer={obj.name!r} cannot carry {codec.name} payloads: {why}. Valid "
            f"reducers for {codec.name}: {', '.join(map(repr, valid_reducers(codec) + ('auto',)))}.")
    return reducer


def choose_reducer(codec: Compressor, reducer: Any, n: int, num_replicas: int,
                   segments: Optional[Sequence[Segment]] = None) -> Optional[Reducer]:
    """Resolve ``"auto"`` to the valid reducer that sends the fewest bytes at
    ``num_replicas`` (``None`` for one replica). Ties go to the more exact: an fp32
    all-reduce (no re-encoding), then the all-gather (one encoding), then two-phase (two).
    A 16-bit linear payload is never summed by ``psum`` (``AllReduce`` refuses it;
    two-phase sums it in fp32).

    Codecs that select entries (top-k, threshold: not block codecs) weigh the two-phase
    reducer's bytes ``RESELECT_MARGIN`` (2) times: its owner selects again from the sum of
    ``N`` sparse chunks, which costs quality (``benchmarks/sparse_convergence.py``, 8
    replicas: top-k 1% with error feedback ends 6.9% above the exact mean through the
    all-gather, 8.7% through two-phase). With a payload of ``P`` bytes a replica, the
    all-gather sends ``(N - 1) P`` and two-phase ``(1 + SERVER_DENSITY) (N - 1) / N P``
    (the owner keeps 4 times the density), so two-phase is picked from ``N = 11`` on (at
    10 they tie and the all-gather is kept). Top-k 1% on a 4.2M-parameter MLP: at 8
    replicas the all-gather (12.4x fewer bytes than the exact mean, two-phase 19.6x), at
    64 two-phase (19.6x, where the all-gather sends 1.6x fewer)."""
    check_reducer(codec, reducer)
    if num_replicas <= 1:
        return None
    if reducer != "auto":
        return get_reducer(reducer)
    if codec.shared_randomness:
        return _REDUCER_OBJECTS["shared_mask"]
    options = []
    for rank, name in enumerate(("allreduce", "allgather", "two_phase")):
        obj = _REDUCER_OBJECTS[name]
        if obj.why_not(codec) is not None:
            continue
        cost = obj.bytes(codec, n, num_replicas, segments)
        if name == "two_phase" and not isinstance(codec, BlockCompressor):
            cost *= RESELECT_MARGIN  # a second selection on the owner
        options.append((cost, rank, name))
    return _REDUCER_OBJECTS[min(options)[2]]


def reduce_parts(codec: Compressor, reducer: Optional[Reducer], parts: Sequence[jax.Array],
                 segments: Sequence[Segment], *, axis_name: Any, num_replicas: int,
                 key: Optional[jax.Array], residuals: Optional[Sequence[jax.Array]] = None,
                 server_residual: Optional[jax.Array] = None,
                 server_error_feedback: bool = True,
                 shared_key: Optional[jax.Array] = None,
                 keep: Optional[Sequence[jax.Array]] = None) -> PartsResult:
    """The mean over ``axis_name`` of a bucket held as one padded flat part per segment
    (``parts[i]`` is ``segments[i].padded_size`` long, segments back to back).

    ``key`` is this replica's encoding key. With ``residuals`` (one per segment, its
    ``size`` long) each part is encoded as ``part + residual`` and
    ``PartsResult.residuals`` holds the new residuals; without, the local decodes.
    ``reducer=None``: one replica, encode and decode only. ``shared_key`` (the same on
    every replica) is what codecs with ``shared_randomness`` (random-k) encode with.
    ``keep`` (one replicated bool per segment, with ``residuals``): segments whose old
    residual the caller keeps; a reducer that selects it itself says so
    (``PartsResult.kept``), others leave the selection to the caller.
    """
    if codec.shared_randomness:
        key = shared_key
    if reducer is None or axis_name is None or num_replicas <= 1:
        res = _one_replica(codec, parts, segments, key, residuals, server_residual)
        if axis_name is None:
            return res
        return res._replace(means=_compat.replicated_over_one(res.means, axis_name))
    return reducer.reduce(codec, parts, segments, axis_name=axis_name, num_replicas=num_replicas,
                          key=key, residuals=residuals, server_residual=server_residual,
                          server_error_feedback=server_error_feedback, keep=keep)


def _one_replica(codec, parts, segments, key, residuals, server_residual):
    """One replica: ``C(y)`` is the mean, ``y - C(y)`` the new residual."""
    if residuals is not None:
        parts = [p + jnp.pad(r.astype(jnp.float32), (0, s.padded_size - s.size))
                 for p, r, s in zip(parts, residuals, segments)]
    sent = None
    if isinstance(codec, BlockCompressor):
        local = [codec.encode_and_decode(p, key, start=s.offset)[1][:s.size]
                 for p, s in zip(parts, segments)]
    else:
        x = flat_bucket.concat(parts)
        words, decoded = codec.encode_and_decode(x, key, segments)
        local, sent = flat_bucket.cut(decoded, segments), [(words, x.shape[0], segments)]
    outs = local if residuals is None else [p[:s.size] - c for p, c, s in zip(parts, local, segments)]
    return PartsResult(local, outs, _empty(server_residual), sent=sent)
