"""What every compressed collective shares: codec checks, per-replica keys, rows of a
payload encoded and decoded, the flat items of a pytree, and the fallback taken when a
payload overflows."""

from __future__ import annotations

import math
from typing import Any, Callable, NamedTuple, Optional, Sequence

import jax
import jax.numpy as jnp
from jax import lax

from commjax import _compat, bucket
from commjax.accounting import ring_bytes
from commjax.compressors.base import BlockCompressor, Compressor


# ----------------------------------------------------------------------------- helpers


def _names(axis_name: Any) -> tuple:
    return tuple(axis_name) if isinstance(axis_name, (tuple, list)) else (axis_name,)


def _round_up(n: int, a: int) -> int:
    return -(-int(n) // a) * a


#: A gathered row of payload words is padded to a multiple of this many words: a TPU lays
#: a u32 row out in 128-lane tiles and runs the all-gather of a row of another length as a
#: zero-padded all-reduce, which sends twice the bytes (v5e, GPT-2-small int8 in 4 MB
#: buckets, one-off compiles: 331 MB on the wire instead of 221 MB, 1.4x the HBM
#: traffic). Only rows of at least 16 tiles (8 KB) are padded, so that the padding costs under 1/16 of a row where
#: it is wasted (CPU, GPU), and only while the gathered rows take at most
#: ``GATHER_PAD_MAX_BYTES``: the padded rows are cut back to the payload after the gather,
#: a relayout that is free in a TPU's on-chip memory but a copy through HBM beyond it (GPT-2
#: int8 in one bucket: 12.8 GB of traffic padded, 10.7 GB not).
GATHER_WORDS = 128
GATHER_PAD_MAX_BYTES = 8 << 20


def gathered_width(words: int, num_replicas: int) -> int:
    """Words a row of ``words`` payload words takes on the wire in ``gather_words``."""
    padded = _round_up(words, GATHER_WORDS)
    if words < 16 * GATHER_WORDS or 4 * padded * num_replicas > GATHER_PAD_MAX_BYTES:
        return int(words)
    return padded


def gather_words(words: jax.Array, axis_name: Any, num_replicas: int, *, tiled: bool) -> jax.Array:
    """All-gather of a 1-D row of payload words over ``num_replicas`` replicas, the result
    typed replicated: ``[N * w]`` (``tiled``) or ``[N, w]``. The row travels padded to
    ``gathered_width`` words."""
    w = words.shape[-1]
    wp = gathered_width(w, num_replicas)
    if words.ndim != 1 or wp == w:
        return _compat.all_gather_invariant(words, axis_name, tiled=tiled)
    got = _compat.all_gather_invariant(jnp.pad(words, (0, wp - w)), axis_name, tiled=False)
    return flat_columns(got, 0, w) if tiled else got[:, :w]


def row_width(words: int) -> int:
    """Words a row of ``words`` payload words takes on the wire in ``gather_rows``: whole
    runs of 1024 words (a TPU's tile of a flat vector, so that every replica's row starts
    on one) from 128 such runs on, else whole ``GATHER_WORDS`` lane tiles from 16 of those
    on, else unpadded. The padding is under 1/128 of a row, or 1/16 of a short one (rows of
    4 MB buckets' top-k payloads padded to runs of 1024 took 2.4% more bytes)."""
    for tile, least in ((8 * GATHER_WORDS, 128), (GATHER_WORDS, 16)):
        if words >= least * tile:
            return _round_up(words, tile)
    return int(words)


def gather_rows(words: jax.Array, axis_name: Any, num_replicas: int) -> tuple[jax.Array, ...]:
    """All-gather of a 1-D row of payload words: every replica's row (``row_width(w)``
    words, its ``w`` words first, then zeros), in replica order, typed replicated.

    For consumers that read each row's words at their offsets (a sparse payload's values
    and positions) and so need no cut-back copy of the rows: the row is padded whatever
    its size (``gather_words`` pads only rows that a TPU cuts back on chip). A TPU runs the
    all-gather of a row that is not whole 128-lane tiles as an all-reduce of a zero-filled
    buffer of all the rows, twice the bytes on the wire (v5e, GPT-2-small top-k 1% in one
    bucket: 140 MB against the plan's 70 MB). Each row is a slice of the gathered vector,
    not a row of an ``[N, W]`` view, which a TPU copies into (8, 128) tiles."""
    w = words.shape[0]
    if w == 0:  # nothing to send (an empty leaf's payload); XLA refuses an empty gather
        return tuple(jnp.zeros((0,), words.dtype) for _ in range(num_replicas))
    wp = row_width(w)
    row = jnp.pad(words, (0, wp - w)) if wp > w else words
    flat = _compat.all_gather_invariant(row, axis_name, tiled=True)
    return tuple(flat[r * wp:(r + 1) * wp] for r in range(num_replicas))


def flat_columns(rows: jax.Array, start: int, stop: int) -> jax.Array:
    """``rows[:, start:stop].reshape(-1)``: columns of gathered ``[N, W]`` rows, one row
    after the other. The same values on every backend. On a CPU every fused consumer of
    that flat view divides each position by ``stop - start`` (a div/mod per element), so
    there the rows are joined instead, a comparison per element (sign's two-phase mean of
    a 13.7M MLP, 4 CPU devices, one-off timing, median of 30 steps: 255 ms flat, 215 ms
    joined, 210 ms unpadded)."""
    cut = rows[:, start:stop]
    return _compat.platform_dependent(cut, cpu=lambda c: jnp.concatenate(list(c)),
                                  default=lambda c: c.reshape(-1))


def gathered_bytes(payload_bytes: float, num_replicas: int, *, rows: bool = False) -> float:
    """Ring bytes per device of ``gather_words`` (``gather_rows`` with ``rows``) on a row
    of ``payload_bytes``."""
    words = -(-int(payload_bytes) // 4)
    width = row_width(words) if rows else gathered_width(words, num_replicas)
    return ring_bytes("all-gather", 4 * width, num_replicas)


#: Each replica's chunk of a sharded collective along the major axis (reduce-scatter,
#: tiled all-gather, all-to-all) is padded to a multiple of this many elements. A TPU runs
#: such a collective natively only on chunks of whole (8, 128) tiles: an unaligned 1-D
#: all-gather, and every 1-D reduce-scatter, is compiled as an all-reduce with twice the
#: wire bytes and a zero-filled buffer (v5e, a 4096 x 4096 fp32 leaf, one-off compiles: 151
#: MB of HBM traffic and 117 MB on the wire as a 1-D reduce-scatter, 75 MB and 59 MB on
#: ``[8 N, s / 8]`` rows).
#: Chunks under ``SHARD_PAD_MIN`` elements stay as they are (the padding would cost over
#: 1/16 of them, and such collectives are small).
SHARD_TILE = 1024
SHARD_PAD_MIN = 16 * SHARD_TILE


def shard_width(elements: int) -> int:
    """Elements a replica's chunk of ``elements`` takes on the wire in a sharded collective."""
    return _round_up(elements, SHARD_TILE) if elements >= SHARD_PAD_MIN else int(elements)


def scatter_width(elements: int) -> int:
    """Elements a replica's chunk of ``elements`` takes on the wire in an exact 1-D
    reduce-scatter: ``shard_width``, and then ``t`` tiles of 1,024 with ``t = 2^k q``,
    ``k >= 1``, ``q <= 127`` (at most 1/8 more, under 1/60 from 128 tiles on). XLA's TPU
    compiler keeps a reduce-scatter on ``[8 N, 128 t]`` rows only for such ``t`` (v5e-8:
    t = 10, 1016, 4064, 8064 stay reduce-scatters, t = 9, 1001, 2008, 2568, 8032 become
    all-reduces; v6e-8 only needs ``t`` even; v4 and v5p compile every one as an
    all-reduce)."""
    w = shard_width(elements)
    if w % SHARD_TILE:
        return w
    tiles = w // SHARD_TILE
    step = 2 ** max(1, math.ceil(math.log2(tiles / 127)))
    return _round_up(tiles, step) * SHARD_TILE


def scatter_flat(v: jax.Array, axis_name: Any, num_replicas: int) -> jax.Array:
    """``lax.psum_scatter`` of a 1-D ``[N s]`` (chunk ``r`` to replica ``r``) -> ``[s]``, on
    ``[8 N, w / 8]`` rows of chunks padded to ``w = scatter_width(s)`` when ``w`` is whole
    tiles.

    On TPU the rows are the vector in the order of their ``(8, 128)`` tiles
    (``bucket.unravel_leaf``: chunk ``r`` is tile row ``r``, the same elements), which is
    how a flat vector lies in memory there, and the chunk received is read back the same
    way (``bucket.ravel_leaf``): a row-major reshape was a relayout of the whole vector
    and one of the chunk (v5e, exact ZeRO of the 21M MLP: 134 MB of its 1,059 MB step).
    The same sums of the same elements on every backend."""
    s = v.shape[0] // num_replicas
    w = scatter_width(s)
    if w % SHARD_TILE:
        return lax.psum_scatter(v, axis_name, tiled=True)
    flat = v if w == s else _compat.platform_dependent(
        v, tpu=lambda u: _pad_chunks(u, num_replicas, w), default=lambda u: join_rows(
            [u.reshape(num_replicas, s)], scatter_width).reshape(-1))
    out = lax.psum_scatter(bucket.unravel_leaf(flat, (8 * num_replicas, w // 8)), axis_name, tiled=True)
    return bucket.ravel_leaf(out)[:s]


def _pad_chunks(v: jax.Array, num: int, width: int) -> jax.Array:
    """``v``'s ``num`` chunks each padded with zeros to ``width``, joined flat: on TPU one
    pass in the vector's own layout, where ``[num, s]`` rows are a relayout of it (v5e,
    GPT-2's embedding in exact ZeRO: three more passes over it)."""
    s = v.shape[0] // num
    zeros = jnp.zeros((width - s,), v.dtype)
    return jnp.concatenate([piece for r in range(num) for piece in (v[r * s:(r + 1) * s], zeros)])


def gather_flat(v: jax.Array, gather: Any, num_replicas: int) -> jax.Array:
    """``gather`` (a tiled all-gather) of a 1-D chunk ``[s]`` -> ``[N s]``, sent padded to
    ``shard_width(s)``."""
    s = v.shape[0]
    w = shard_width(s)
    if w == s:
        return gather(v)
    return flat_columns(gather(join_rows([v])).reshape(num_replicas, w), 0, s)


def join_rows(parts: Sequence[jax.Array], width: Callable[[int], int] = shard_width) -> jax.Array:
    """Arrays ``[..., W_i]`` joined along the last axis and padded with zeros to
    ``width(sum W_i)``, in one concatenation (a pad after it is a copy on a TPU)."""
    w = sum(p.shape[-1] for p in parts)
    pad = width(w) - w
    if pad:
        parts = list(parts) + [jnp.zeros(parts[0].shape[:-1] + (pad,), parts[0].dtype)]
    return jnp.concatenate(parts, axis=-1)


def _is_exact(codec: Optional[Compressor]) -> bool:
    return codec is None or (codec.lossless and codec.linear)


def _compressible(leaf: Any) -> bool:
    """Real floating leaves go through a codec; others take the exact collective."""
    dtype = jnp.result_type(leaf)
    return jnp.issubdtype(dtype, jnp.floating)


def check_codec(codec: Any, where: str, argument: str = "codec") -> Optional[Compressor]:
    """``codec`` if it can travel through a collective, else a clear error."""
    if codec is None:
        return None
    if not isinstance(codec, Compressor):
        raise TypeError(
            f"{where}: `{argument}` must be a commjax codec such as cj.quantize(bits=8), or "
            f"None for the exact collective; got {codec!r}."
        )
    if codec.has_exchange or codec.shared_randomness:
        raise ValueError(
            f"{where}: {codec.name} runs its own exchange (state or a key shared by every "
            f"replica) and cannot be the codec of a single collective; use it through "
            f"cj.compressed_mean. Codecs for `{argument}`: cj.quantize, cj.sign, cj.cast, "
            "cj.qsgd, cj.terngrad, cj.top_k, cj.threshold, cj.identity."
        )
    return codec


def replica_key(codec: Optional[Compressor], key: Optional[jax.Array], axis_name: Any,
                where: str) -> Optional[jax.Array]:
    """The key a stochastic codec encodes with on this replica: ``key`` (the same on every
    replica) with the replica index folded in; ``None`` for deterministic codecs."""
    if codec is None or not codec.stochastic:
        return None
    if key is None:
        raise ValueError(
            f"{where}: {codec.name} rounds stochastically and needs `key=`: pass a PRNG key "
            "that is the same on every replica (the collective folds in the replica index), "
            "e.g. jax.random.fold_in(jax.random.key(0), step)."
        )
    if jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        key = jax.random.key_data(key)
    return jax.random.fold_in(key, lax.axis_index(axis_name))


def _vary_out(x: Any, axis_name: Any) -> Any:
    return _compat.vary(x, axis_name)


# ------------------------------------------------------------- encoding rows of a payload


def encode_rows(codec: Compressor, rows: jax.Array, key: Optional[jax.Array], *,
                residual: Optional[jax.Array] = None, start: int = 0):
    """Encode each row of ``float32[R, c]`` on its own (``c`` a multiple of the codec's
    alignment): ``uint32[R, w]``, with ``w = codec.payload_words(c)``.

    With ``residual`` (``[R, c]``, error feedback) it encodes ``y = rows + residual`` and
    also returns the new residual ``y - C(y)`` (fp32): ``(words, new_residual)``.
    Block codecs encode the rows as one vector (noise drawn by position from ``start``);
    other codecs encode row ``j`` with ``fold_in(key, j)``.
    """
    n_rows, c = rows.shape
    if isinstance(codec, BlockCompressor):
        flat = rows.reshape(-1)
        if residual is None:
            return codec.encode(flat, key, start=start).reshape(n_rows, -1)
        words, new = codec.encode_feedback(flat, residual.reshape(-1), key, start=start)
        return words.reshape(n_rows, -1), new.reshape(n_rows, c)
    if residual is None:
        return jax.vmap(lambda v, k: codec.encode(v, k))(rows, _row_keys(key, n_rows))
    return _encode_rows_feedback(codec, rows + residual.astype(jnp.float32), key)


def _row_keys(key: Optional[jax.Array], n_rows: int) -> Optional[jax.Array]:
    return None if key is None else jax.vmap(lambda j: jax.random.fold_in(key, j))(jnp.arange(n_rows))


def _encode_rows_feedback(codec: Compressor, y: jax.Array, key: Optional[jax.Array]):
    """A non-block codec's rows ``y = rows + residual``, already formed: ``(words, y - C(y))``."""
    return jax.vmap(lambda v, k: codec.encode_residual(v, k))(y, _row_keys(key, y.shape[0]))


def decode_rows(codec: Compressor, words: jax.Array, c: int) -> jax.Array:
    """``uint32[R, w] -> float32[R, c]``: each row decoded on its own."""
    n_rows = words.shape[0]
    if isinstance(codec, BlockCompressor):
        return codec.decode(words.reshape(-1), n_rows * c).reshape(n_rows, c)
    return jax.vmap(lambda w: codec.decode(w, c))(words)


def decode_sum(codec: Compressor, words: jax.Array, c: int, divide: int = 1) -> jax.Array:
    """``sum_r decode(words[r], c) / divide`` over the leading axis, in replica order from
    fp32 zeros, each value divided before it is added (a representable mean never
    overflows): every replica that holds the same words computes the same bits (the
    codecs' fused unpack + dequantize + sum kernel where there is one)."""
    return codec.decode_sum(words, c, divide=divide)


# ------------------------------------------------------------------ tree <-> flat items


class _Item(NamedTuple):
    index: int  # position among the tree's leaves
    shape: tuple
    dtype: Any
    size: int  # elements (of the chunk, for reduce_scatter)
    padded: int  # size rounded up to the codec's alignment
    words: int  # payload words of `padded` elements


def _items(leaves: Sequence[Any], codec: Compressor, divisor: int) -> list[_Item]:
    out = []
    for i, leaf in enumerate(leaves):
        if not _compressible(leaf):
            continue
        shape = tuple(jnp.shape(leaf))
        size = math.prod(shape) // divisor
        padded = _round_up(max(size, 1), codec.alignment)
        out.append(_Item(i, shape, jnp.result_type(leaf), size, padded, codec.payload_words(padded)))
    return out


def _check_tiled(leaves: Sequence[Any], n: int, where: str) -> None:
    for leaf in leaves:
        shape = jnp.shape(leaf)
        if not shape or shape[0] % n:
            raise ValueError(
                f"{where}: every leaf's leading dimension must be a multiple of the number of "
                f"replicas ({n}); got a leaf of shape {tuple(shape)}. Pad or reshape it first "
                "(cj.zero and cj.fsdp_gather do this for you)."
            )



def _fallback_cond(codec, overflow, coded, raw):
    """``coded()``, or ``raw()`` (which sends [`Compressor.fallback`][commjax.Compressor.fallback]'s
    payload) when
    ``overflow()`` is true: a replicated flag, so every replica takes the same branch and
    joins the same collectives. Codecs without a fallback: ``coded()`` alone."""
    if codec.fallback is None:
        return coded()
    return lax.cond(overflow(), raw, coded)


def _overflow_anywhere(codec, words, axis_name):
    """Replicated: some replica's ``words`` overflowed (one fp32 all-reduce of a flag; an
    all-to-all leaves each replica only its own chunks to read)."""
    return _compat.psum(codec.payload_overflow(words).astype(jnp.float32), axis_name) > 0



def _replicated_cotangent(tree, axis_name) -> bool:
    """Under check_vma=True, whether the cotangent is typed replicated over the axis."""
    tracked = _compat.varying_axes(lax.axis_index(axis_name))
    if not tracked:
        return False
    leaves = jax.tree_util.tree_leaves(tree)
    return bool(leaves) and all(
        not (set(_names(axis_name)) & set(_compat.varying_axes(l) or ())) for l in leaves)

def _flag_bytes(codec, n) -> float:
    """The fp32 overflow flag a codec with a fallback sums after an all-to-all (the
    fallback's own collectives run only on overflow: not counted)."""
    return ring_bytes("all-reduce", 4, n) if codec.fallback is not None else 0.0
