"""What a compressor is: an immutable codec between float vectors and wire words.

A compressor never communicates. It turns a flat float32 vector into a *payload* of
unsigned 32-bit words and back; the collectives in [`commjax.collectives`][] move payloads
between replicas, and [`commjax.compressed_mean`][] adds error feedback around both.

Two families share this interface:

* **Block codecs** ([`BlockCompressor`][commjax.compressors.base.BlockCompressor]: cast, quantize,
  QSGD, TernGrad, sign)
  cut the vector into blocks of ``block_size`` elements and encode each block into a
  fixed row of ``row_words`` uint32 words. Rows are independent, so a payload can be cut
  into per-replica chunks of whole blocks: this is what the two-phase reducer needs.
* **Whole-vector codecs** (sparsifiers, for example) implement
  [`Compressor.encode`][commjax.compressors.base.Compressor.encode]
  and [`Compressor.decode`][commjax.compressors.base.Compressor.decode] on the flat vector and
  travel through the all-gather
  reducer.

A compressor whose payload may be summed across replicas before decoding
(``decode(sum_i encode(x_i)) == sum_i decode(encode(x_i))``: the identity, random-k
values, PowerSGD factors) sets ``linear = True`` and implements
``Compressor.encode_linear`` / ``Compressor.decode_linear``; only those may be
reduced with ``psum`` (quantized integer payloads would wrap around).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import ClassVar, Optional, Sequence

import jax
import jax.numpy as jnp
from jax import lax

from commjax import _compat
from commjax.validation import check_choice, check_positive_int

__all__ = [
    "Compressor",
    "BlockCompressor",
    "Segment",
    "check_positive_int",
    "check_choice",
]


@dataclasses.dataclass(frozen=True)
class Segment:
    """Where one gradient leaf lives inside the flat buffer: ``[offset, offset + size)``.

    ``padded_size`` is the size rounded up to the compressor's alignment; the padding is
    zero on input and ignored on output. ``shape`` is the leaf's original shape.
    """

    offset: int
    size: int
    padded_size: int
    shape: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class Compressor:
    """Base class of every compressor. Instances are immutable and hashable.

    Class attributes describe how a payload may travel:

    * ``linear``: payloads may be summed with ``psum`` (see module docstring);
    * ``stochastic``: ``encode`` consumes randomness that must differ per replica;
    * ``shared_randomness``: ``encode`` consumes randomness that must be *identical* on
      every replica (random-k masks).
    """

    name: ClassVar[str] = "compressor"
    linear: ClassVar[bool] = False
    # decode(encode(x)) == x bit for bit: error feedback would only ever hold zeros.
    lossless: ClassVar[bool] = False
    # Each segment's payload and decode depend on that segment's values only (no block,
    # selection or factor spans two leaves): a NaN in one leaf cannot reach another.
    leaf_local: ClassVar[bool] = False
    stochastic: ClassVar[bool] = False
    shared_randomness: ClassVar[bool] = False

    # Run by a stateful exchange (commjax.exchanges: PowerSGD), not by a reducer.
    has_exchange: ClassVar[bool] = False
    # Names of the per-replica scalar metrics that local_metrics() returns.
    metric_names: ClassVar[tuple[str, ...]] = ()
    # Whether payload_metrics() gives them from what was sent (compressed_mean then reads
    # them there, not from the joined input).
    metrics_from_payload: ClassVar[bool] = False
    # In a bucket of a bucketed step (bucket_bytes) on TPU, the residual-norm metric from
    # three plain sums (guards._banded_norm) instead of guards.l2_norm: which of the two
    # XLA computes in the pass that writes the residual depends on the codec's encode, so
    # it is measured per codec (benchmarks/aot.py, 4 MB buckets). One bucket and
    # exchanges (PowerSGD) always take the sums.
    tpu_norm_sums_in_buckets: ClassVar[bool] = False
    # A two-phase owner re-encodes its chunk's mean with the server residual by
    # ``encode_feedback`` (one pass, the same bits as encode, decode, subtract) where this
    # is set; else by encoding and decoding. Measured per codec (benchmarks/aot.py, one
    # bucket and 4 MB buckets on a v5e).
    reencode_by_feedback: ClassVar[bool] = True
    # In buckets on TPU, with the default check_finite (a flagged leaf keeps its residual),
    # the pieces of a leaf cut across buckets are each taken out of the leaf by a barrier
    # before encoding (commjax.bucketing, ``pieces_apart``). Measured per codec
    # (benchmarks/aot.py, v5e, 4 MB buckets).
    tpu_pieces_apart_in_buckets: ClassVar[bool] = False

    def accepts(self, shape: tuple[int, ...]) -> bool:
        """Whether a leaf of this shape is worth compressing (else: the exact bucket)."""
        return True

    def local_metrics(self, x: jax.Array, segments: Sequence[Segment]) -> dict[str, jax.Array]:
        """Scalars about this replica's input ``x`` (no communication), by metric_names."""
        return {}

    def payload_metrics(self, sent: Sequence[tuple], segments: Sequence[Segment]) -> dict[str, jax.Array]:
        """``local_metrics`` read from what this replica sent, for codecs with
        ``metrics_from_payload``.

        ``sent``: this replica's payloads as ``(words, n, segments)``, each what
        ``encode(x, key, segments)`` returned for an ``x`` of ``n`` elements (one for the
        bucket, or one per destination chunk); ``segments``: the bucket's. Reading the
        payload spares the step a pass over the joined bucket, which the compiler forms
        for the metrics alone (a v5e top-k step of a 21M MLP: 1.5 GB of HBM traffic with
        the pass, 0.9 GB without)."""
        raise NotImplementedError(f"{type(self).__name__} reads its metrics from its input (local_metrics)")

    def encode_and_decode(
        self, x: jax.Array, key: Optional[jax.Array], segments: Optional[Sequence[Segment]] = None
    ) -> tuple[jax.Array, jax.Array]:
        """``(encode(x), decode(encode(x)))``: the payload and what it decodes to, which error
        feedback subtracts. Kernels may compute both in one pass."""
        words = self.encode(x, key, segments)
        return words, self.decode(words, x.shape[0], segments)

    def encode_residual(
        self, y: jax.Array, key: Optional[jax.Array], segments: Optional[Sequence[Segment]] = None
    ) -> tuple[jax.Array, jax.Array]:
        """``(encode(y), y - decode(encode(y)))``: the payload and the error that feedback
        keeps. This default subtracts the local decode; sparse codecs instead subtract what
        they sent in place, without a dense decoded copy of ``y``."""
        words, local = self.encode_and_decode(y, key, segments)
        return words, y - local

    # Flat buffers handed to encode() have a length that is a multiple of this.
    @property
    def alignment(self) -> int:
        return 1

    def payload_words(self, n: int, segments: Optional[Sequence[Segment]] = None) -> int:
        """uint32 words that ``encode`` produces for a flat vector of ``n`` elements."""
        raise NotImplementedError

    def payload_bytes(self, n: int, segments: Optional[Sequence[Segment]] = None) -> int:
        """Bytes of one replica's payload for ``n`` elements (``4 * payload_words``)."""
        return 4 * self.payload_words(n, segments)

    def bits_per_element(self, n: int = 1 << 20) -> float:
        n = -(-n // self.alignment) * self.alignment
        return 32.0 * self.payload_words(n) / n

    def encode(
        self, x: jax.Array, key: Optional[jax.Array], segments: Optional[Sequence[Segment]] = None
    ) -> jax.Array:
        """``float32[n] -> uint32[payload_words(n)]``."""
        raise NotImplementedError

    def decode(
        self, payload: jax.Array, n: int, segments: Optional[Sequence[Segment]] = None
    ) -> jax.Array:
        """``uint32[payload_words(n)] -> float32[n]``."""
        raise NotImplementedError

    def decode_sum(
        self, payloads: jax.Array, n: int, segments: Optional[Sequence[Segment]] = None,
        *, divide: int = 1,
    ) -> jax.Array:
        """``sum_r decode(payloads[r], n) / divide`` over the leading (replica) axis of
        ``uint32[N, payload_words(n)]`` (or over ``N`` rows of at least that many words,
        as ``gather_rows`` gives them), in replica order from fp32 zeros: every replica
        that holds the same payloads computes the same bits. Each decoded value is divided
        *before* it is added, so a mean (``divide = N``) that fp32 can hold is returned even
        where the sum could not be. Codecs with a fused unpack + dequantize + sum kernel
        override it (and fold ``divide`` into each block's step)."""
        total = jnp.zeros((n,), jnp.float32)
        for payload in payloads:
            value = self.decode(payload, n, segments)
            total = total + (value if divide == 1 else value / divide)
        return total

    @property
    def fallback(self) -> Optional["Compressor"]:
        """A codec whose fixed-size payload cannot carry every input ([`commjax.lossless`][]:
        more escapes than a block has slots) names one that can; the reducers send it, on
        every replica, when ``payload_overflow`` is true for some replica's payload.
        ``None``: every input fits."""
        return None

    def payload_overflow(self, words: jax.Array) -> jax.Array:
        """Whether ``words`` (any leading shape) hold a block that did not fit (codecs with
        a ``fallback`` only)."""
        raise TypeError(f"{self.name} payloads always fit: it has no fallback")

    def payload_finite(self, words: jax.Array) -> Optional[jax.Array]:
        """Whether the values ``words`` decode to are all finite, read from far fewer words
        than the decode (a scale per block), or ``None`` if the codec cannot tell. Every
        replica that holds the same words decides the same."""
        return None

    # Linear compressors only.
    def encode_linear(self, x: jax.Array, key: Optional[jax.Array]) -> jax.Array:
        raise TypeError(f"{self.name} payloads cannot be summed: it is not a linear compressor")

    def decode_linear(self, summed: jax.Array, n: int) -> jax.Array:
        raise TypeError(f"{self.name} payloads cannot be summed: it is not a linear compressor")

    def linear_payload_bytes(self, n: int) -> int:
        raise TypeError(f"{self.name} is not a linear compressor")

    def roundtrip(self, x: jax.Array, key: Optional[jax.Array] = None) -> jax.Array:
        """``decode(encode(x))`` for any shape and float dtype: the compressor's numerical
        effect on one replica, with the input's shape and dtype."""
        x = jnp.asarray(x)
        flat = jnp.ravel(x).astype(jnp.float32)
        n = flat.shape[0]
        padded = -(-max(n, 1) // self.alignment) * self.alignment
        size = padded
        if isinstance(self, BlockCompressor):
            # Blocks are independent: compile once per size class, not once per shape.
            size = 1 << (padded - 1).bit_length()
            size = -(-size // self.alignment) * self.alignment
        segments = None if isinstance(self, BlockCompressor) else (Segment(0, n, padded, tuple(x.shape)),)
        out = _jit_roundtrip(self, jnp.pad(flat, (0, size - n)), key, segments)
        return out[:n].reshape(x.shape).astype(x.dtype)


@dataclasses.dataclass(frozen=True)
class BlockCompressor(Compressor):
    """A codec that maps each block of ``block_size`` floats to ``row_words`` uint32 words.

    Subclasses implement ``encode_blocks`` and ``decode_blocks`` on
    ``[num_blocks, block_size]`` arrays; the flat interface and chunking come from here.
    """

    leaf_local: ClassVar[bool] = True  # segments are padded to whole blocks

    @property
    def block(self) -> int:
        raise NotImplementedError

    @property
    def alignment(self) -> int:
        return self.block

    @property
    def row_words(self) -> int:
        raise NotImplementedError

    def payload_words(self, n: int, segments: Optional[Sequence[Segment]] = None) -> int:
        if n % self.block:
            raise ValueError(f"{self.name}: length {n} is not a multiple of the block {self.block}")
        return (n // self.block) * self.row_words

    def encode_blocks(self, blocks: jax.Array, key: Optional[jax.Array], start: int = 0) -> jax.Array:
        """``float32[nb, block] -> uint32[nb, row_words]``. ``start`` is the position of
        ``blocks[0, 0]`` in the vector being encoded: stochastic codecs draw their noise
        by position ([`commjax.noise.uniform`][]), so that encoding a vector piece by
        piece gives the same words as encoding it whole."""
        raise NotImplementedError

    def decode_blocks(self, rows: jax.Array) -> jax.Array:
        """``uint32[nb, row_words] -> float32[nb, block]``."""
        raise NotImplementedError

    def scale_words(self, words: jax.Array, *, strided: bool = False) -> jax.Array:
        """The last word of every row of the payload ``words`` (last axis): the fp32 scale
        of the codecs whose rows end in one. ``strided``: read by a strided slice of the
        flat payload instead of its ``[blocks, row_words]`` view (the same words)."""
        rw = self.row_words
        if strided:
            return words[..., rw - 1::rw]
        return words.reshape(words.shape[:-1] + (-1, rw))[..., -1]

    def scales_finite(self, words: jax.Array) -> jax.Array:
        """Whether every row's scale word (``scale_words``) of the payload is finite. On
        TPU read by a strided slice: in the ``[blocks, row_words]`` view there, the odd row
        width is padded to 128 lanes and the payload copied into it (v5e, 21M-parameter
        int8 step: 147 MB of 1232); elsewhere the view, which fuses (the strided read cost
        an H100 21 MB)."""
        def finite(strided):
            def f(w):
                scales = lax.bitcast_convert_type(self.scale_words(w, strided=strided), jnp.float32)
                return jnp.all(jnp.isfinite(scales))
            return f

        return _compat.platform_dependent(words, tpu=finite(True), default=finite(False))

    def encode(self, x, key, segments=None, *, start: int = 0):
        """``float32[n] -> uint32[payload_words(n)]``; ``start``: see ``encode_blocks``."""
        rows = self.encode_blocks(x.reshape(-1, self.block), key, start)
        return rows.reshape(-1)

    def encode_and_decode(self, x, key, segments=None, *, start: int = 0):
        words = self.encode(x, key, segments, start=start)
        return words, self.decode(words, x.shape[0], segments)

    def decode(self, payload, n, segments=None):
        rows = payload.reshape(n // self.block, self.row_words)
        return self.decode_blocks(rows).reshape(n)

    def encode_feedback(
        self, x: jax.Array, residual: jax.Array, key: Optional[jax.Array], *, start: int = 0
    ) -> tuple[jax.Array, jax.Array]:
        """Error feedback with encoding: ``y = x + residual``; returns ``(encode(y),
        y - decode(encode(y)))`` (fp32). Codecs with a fused kernel compute both in one
        pass over memory; this default encodes, then decodes."""
        y = x + residual.astype(jnp.float32)
        words, local = self.encode_and_decode(y, key, start=start)
        return words, y - local


@functools.partial(jax.jit, static_argnums=(0, 3))
def _jit_roundtrip(
    compressor: Compressor, flat: jax.Array, key: Optional[jax.Array], segments: tuple
) -> jax.Array:
    size = flat.shape[0]
    return compressor.decode(compressor.encode(flat, key, segments), size, segments)
