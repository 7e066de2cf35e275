"""Sparsifiers: ``top_k``, ``random_k`` and ``threshold``.

A sparsifier keeps a few entries of the flat float32 bucket ``x`` and drops the rest;
with error feedback (the default in [`commjax.compressed_mean`][]) the dropped part is
carried to the next step, so nothing is lost, only delayed.

Wire formats (everything travels as uint32 words, see [`commjax.compressors.base`][]):

* ``top_k`` and ``threshold`` send *values and indices*. Values are float32 words, or
  bfloat16 packed two per word (``values_dtype=jnp.bfloat16``); indices are uint32
  positions, or (``top_k`` with ``chunk_size``) uint16 offsets inside fixed chunks, two
  per word. Payloads differ between replicas, so they are all-gathered and every replica
  scatters each replica's entries into zeros and adds them in replica order: the sum is
  bit-identical everywhere. Per device (ring convention, ``N`` replicas, ``K`` entries
  per replica)::

      bytes = (N - 1) * (value_bytes + index_bytes) * K
            = (N - 1) * 8 K   (fp32 values, uint32 indices)

* ``random_k`` sends *values only*: the positions come from a PRNG key that is identical
  on every replica and advanced each step, so all replicas pick the same positions and
  their values can be summed with one all-reduce::

      bytes = 2 (N - 1) / N * 4 K        (fp32 values)

  With bfloat16 values the ``K`` values travel as packed 16-bit words through an
  all-to-all and an all-gather (``2 (N - 1) / N * 2 K``) and are summed in fp32.

References:
  Aji & Heafield, "Sparse communication for distributed gradient descent", EMNLP 2017.
  Stich, Cordonnier & Jaggi, "Sparsified SGD with memory", NeurIPS 2018.
  Strom, "Scalable distributed DNN training using commodity GPU cloud computing",
  Interspeech 2015 (threshold sparsification).
  Lin et al., "Deep gradient compression", ICLR 2018 (see [`commjax.optimizers.dgc`][]).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, ClassVar, NamedTuple, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from commjax import _compat
from commjax.compressors.base import Compressor, Segment, check_choice
from commjax.compressors.cast16 import Cast
from commjax.compressors.exact import identity
from commjax.validation import check_bool, check_dtype

__all__ = [
    "TopK",
    "RandomK",
    "Threshold",
    "top_k",
    "random_k",
    "threshold",
    "MAX_CHUNK",
]

# Largest chunk whose offsets fit in a uint16.
MAX_CHUNK = 65536

_VALUE_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


# ----------------------------------------------------------------------------- helpers


def _check_ratio(ratio: Any, *, factory: str, name: str = "ratio") -> float:
    if isinstance(ratio, bool) or not isinstance(ratio, (int, float, np.floating, np.integer)):
        raise ValueError(f"{factory}: `{name}` must be a number in (0, 1], got {ratio!r}.")
    r = float(ratio)
    if not (0.0 < r <= 1.0):
        raise ValueError(f"{factory}: `{name}` must be in (0, 1] (the fraction of entries sent), got {ratio!r}.")
    return r


def _value_dtype_name(dtype: Any, *, factory: str) -> str:
    return check_dtype("values_dtype", dtype, tuple(_VALUE_DTYPES), factory=factory).name


def keep_count(ratio: float, size: int) -> int:
    """Entries kept out of ``size``: ``clip(ceil(ratio * size), 1, size)`` (0 if empty).

    At least one entry is kept even when ``size < 1 / ratio``.
    """
    if size <= 0:
        return 0
    # Round first so that e.g. 0.01 * 300 = 3.0000000000000004 keeps 3, not 4.
    return int(min(size, max(1, math.ceil(round(ratio * size, 9)))))


def _value_words(count: int, dtype_name: str) -> int:
    return count if dtype_name == "float32" else -(-count // 2)


def _u16_words(count: int) -> int:
    return -(-count // 2)


def _saturate(v: jax.Array, finite: jax.Array, dtype: Any) -> jax.Array:
    """``v`` clipped to the largest finite value of ``dtype`` where ``finite`` (the value
    it came from was finite): a float32 value above bfloat16's largest (3.3895e38) would
    round to infinity, and a rescaled random-k value can exceed float32's. Elsewhere
    (infinities, NaN) it is left as it is, to be flagged."""
    top = float(jnp.finfo(dtype).max)
    return jnp.where(finite, jnp.clip(v, -top, top), v)


def _pack_values(v: jax.Array, dtype_name: str) -> jax.Array:
    """float32[c] -> uint32[_value_words(c)]: fp32 bit patterns, or bf16 pairs per word
    (saturating at bfloat16's largest)."""
    if dtype_name == "float32":
        return lax.bitcast_convert_type(v.astype(jnp.float32), jnp.uint32)
    v = _saturate(v, jnp.isfinite(v), jnp.bfloat16)
    return _pack_u16(lax.bitcast_convert_type(v.astype(jnp.bfloat16), jnp.uint16))


def _unpack_values(words: jax.Array, count: int, dtype_name: str) -> jax.Array:
    if dtype_name == "float32":
        return lax.bitcast_convert_type(words, jnp.float32)
    half = _unpack_u16(words, count)
    return lax.bitcast_convert_type(half, jnp.bfloat16).astype(jnp.float32)


def _pack_u16(h: jax.Array) -> jax.Array:
    """uint16[c] -> uint32[ceil(c / 2)] (two halves per word, zero-padded)."""
    h = h.astype(jnp.uint16)
    if h.shape[0] % 2:
        h = jnp.pad(h, (0, 1))
    return lax.bitcast_convert_type(h.reshape(-1, 2), jnp.uint32)


def _unpack_u16(words: jax.Array, count: int) -> jax.Array:
    return lax.bitcast_convert_type(words, jnp.uint16).reshape(-1)[:count]


class _Group(NamedTuple):
    """One selection domain: ``[offset, offset + size)`` of the bucket, cut in ``chunks``
    chunks of ``chunk`` elements (the last one zero-padded), ``k`` kept per chunk."""

    offset: int
    size: int
    chunk: int
    chunks: int
    k: int


def _domains(n: int, segments: Optional[Sequence[Segment]], per_leaf: bool) -> list[tuple[int, int]]:
    if per_leaf and segments:
        return [(int(s.offset), int(s.size)) for s in segments if s.size > 0]
    return [(0, int(n))] if n > 0 else []


def _entries(positions: list[jax.Array], values: list[jax.Array]) -> tuple[jax.Array, jax.Array]:
    if not positions:
        return jnp.zeros((0,), jnp.int32), jnp.zeros((0,), jnp.float32)
    return jnp.concatenate(positions), jnp.concatenate(values)


def _add_entries(out: jax.Array, pos: jax.Array, val: jax.Array) -> jax.Array:
    # Positions are distinct, except padding slots (value 0) that may repeat a position:
    # adding zeros there is harmless, so this is a scatter-add (positions past the end of
    # ``out`` are dropped).
    return out.at[pos].add(val, mode="drop")


def _replica_sums(payloads: Any, sizes: list, entries: Any, divide: int) -> list:
    """Buffers of ``sizes`` holding ``sum_r`` of replica ``r``'s entries, ``entries(payloads[r])``
    a list of ``(buffer, positions, values)`` (``payloads`` an ``[N, W]`` array or ``N``
    rows; words past a payload are not read), scatter-added in replica order (values
    divided by ``divide``). The buffers are filled only once the payloads are here (a zero
    fill depends on nothing, and XLA may otherwise schedule it before the selection, whose
    scratch then adds to it)."""
    zero, payloads = lax.optimization_barrier((jnp.zeros((), jnp.float32), payloads))
    totals = [jnp.full((size,), zero) for size in sizes]
    for payload in payloads:
        for i, pos, val in entries(payload):
            totals[i] = _add_entries(totals[i], pos, val if divide == 1 else val / divide)
    return totals


class _SparseDecode:
    """Decoding of a payload of ``(position, value)`` entries (``entries``)."""

    def entries(self, payload: jax.Array, n: int, segments=None) -> tuple[jax.Array, jax.Array]:
        raise NotImplementedError

    def decode(self, payload, n, segments=None):
        return _add_entries(jnp.zeros((n,), jnp.float32), *self.entries(payload, n, segments))

    def encode_residual(self, y, key, segments=None):
        """``(encode(y), y - decode(encode(y)))`` bit for bit, with the sent values
        subtracted at their positions in ``y`` (a scatter that XLA performs in place):
        ``k`` entries written instead of a dense decode of ``n`` values and a subtraction.
        Padding slots carry zeros, and ``v + (-0) == v`` for every ``v``."""
        words = self.encode(y, key, segments)
        return words, self.residual_from(y, words, segments)

    def residual_from(self, y, words, segments=None, *, kept=None):
        """``y - decode(words)`` for the payload ``words`` of ``y``, the sent values
        subtracted at their positions (see ``encode_residual``). ``kept`` (a scalar bool):
        where true, ``y`` is a residual to keep as it is, and the scatter adds ``-0``
        (no change to any value), so the result is formed in ``y``'s buffer either way."""
        pos, val = self.entries(words, y.shape[0], segments)
        if kept is not None:
            val = jnp.where(kept, 0.0, val)
        return _add_entries(y, pos, -val)

    def decode_sum(self, payloads, n, segments=None, *, divide=1):
        """``sum_r decode(payloads[r], n) / divide`` in replica order, as the dense sum of
        [`Compressor.decode_sum`][commjax.compressors.base.Compressor.decode_sum] computes it, bit
        for bit (the sum never holds ``-0``,
        so adding zero where a replica sent nothing changes no bit), but with each
        replica's entries scatter-added into one buffer: ``n + N k`` values written
        instead of ``N n`` (``_replica_sums``)."""
        return _replica_sums(payloads, [n], lambda w: [(0, *self.entries(w, n, segments))], divide)[0]

#: Row width of the two-stage exact top-k.
_ROW = 1024
#: The two-stage selection pays off only for long rows with many entries kept, from
#: ``m * k`` of about this much (a row of ``m`` elements, ``k`` kept); below it one
#: ``lax.top_k`` over the row is faster on CPU (``benchmarks/top_k_select.py``).
TWO_STAGE_MIN_WORK = 1 << 39


#: Lanes of a TPU vector register: ``grouped_top_k`` groups elements 128 apart there.
_TPU_LANES = 128


def exact_top_k(mag: jax.Array, k: int, *, of_abs: bool = False) -> jax.Array:
    """``lax.top_k(mag, k)[1]`` as int32 (positions of the ``k`` largest of each row of
    ``[R, m]``, largest first, the lower position first among equals); of ``|mag|`` with
    ``of_abs`` (taken inside the selection, so that no ``|x|`` copy of a long row is made).

    On CPU one ``lax.top_k``, or ``two_stage_top_k`` (the same positions) where that is
    faster: ``m * k`` at least ``TWO_STAGE_MIN_WORK`` and ``k`` at most ``m / 8``
    (``uses_two_stage``). On accelerators ``grouped_top_k`` where ``group_size`` is over
    1 (``k`` at most a quarter of the row): it sorts about ``2 sqrt(m k)`` entries, not the
    whole row that XLA sorts for ``lax.top_k`` on GPU (a copy of the row's values and
    positions each); shorter rows are sorted whole."""
    m = mag.shape[1]
    absolute = jnp.abs if of_abs else (lambda v: v)  # noqa: E731
    if not uses_two_stage(m, k):
        cpu = lambda v: lax.top_k(absolute(v), k)[1].astype(jnp.int32)  # noqa: E731
    else:
        cpu = lambda v: two_stage_top_k(absolute(v), k)  # noqa: E731
    # On TPU sorts, not lax.top_k: XLA's TPU compiler aborts the process on lax.top_k of
    # some shapes (f32[1, 262144] with k in (2048, 4096], the 1% of a 512 x 512 leaf).
    if group_size(m, k, _TPU_LANES) > 1:
        tpu = lambda v: grouped_top_k(v, k, of_abs=of_abs, lanes=_TPU_LANES)  # noqa: E731
    else:
        tpu = lambda v: sorted_top_k(absolute(v), k)  # noqa: E731
    gpu = (lambda v: grouped_top_k(v, k, of_abs=of_abs)) if group_size(m, k) > 1 else cpu  # noqa: E731
    return _compat.platform_dependent(mag, cpu=cpu, tpu=tpu, default=gpu)


def _order_keys(v: jax.Array) -> jax.Array:
    """int32 keys whose ascending order is ``v``'s descending total order (``-NaN < -inf
    < ... < -0.0 < 0.0 < ... < inf < NaN``, the order ``lax.top_k`` uses)."""
    bits = lax.bitcast_convert_type(v.astype(jnp.float32), jnp.int32)
    return ~jnp.where(bits < 0, bits ^ 0x7FFFFFFF, bits)


def group_size(m: int, k: int, lanes: int = 1) -> int:
    """Group length of ``grouped_top_k`` for ``k`` of ``m``: the power of two nearest
    below ``sqrt(m / k)``, which about minimises the ``m / L + k L`` entries it sorts;
    1 where grouping does not pay or leaves fewer than ``k`` groups in whole blocks of
    ``L * lanes`` (then ``exact_top_k`` sorts the row)."""
    if k <= 0 or m < 4 * k:
        return 1
    group = 1 << max(0, int(math.floor(math.log2(math.sqrt(m / k)))))
    return group if group > 1 and m // (group * lanes) * lanes >= k else 1


def _first_min(keys: jax.Array, axis: int) -> tuple[jax.Array, jax.Array]:
    """The least of ``keys`` along ``axis`` and the first index holding it."""
    idx = lax.broadcasted_iota(jnp.int32, keys.shape, axis)

    def least(a, b):
        first = (a[0] < b[0]) | ((a[0] == b[0]) & (a[1] < b[1]))
        return jnp.where(first, a[0], b[0]), jnp.where(first, a[1], b[1])

    top = jnp.iinfo(jnp.int32).max
    return lax.reduce((keys, idx), (jnp.int32(top), jnp.int32(top)), least, (axis,))


def grouped_top_k(v: jax.Array, k: int, group: Optional[int] = None, *, of_abs: bool = False,
                  lanes: int = 1) -> jax.Array:
    """``lax.top_k(v, k)[1]`` as int32 (of ``|v|`` with ``of_abs``) for rows ``[R, m]``,
    sorting about ``m / L + k L`` entries instead of ``m``, and no array the size of the
    row (``L = group``, ``group_size(m, k, lanes)`` by default).

    The row is cut into blocks of ``L * lanes`` elements, viewed ``[L, lanes]``: each
    column is a group of ``L`` elements (consecutive with one lane, a TPU vector
    register's 128 lanes apart with 128, so that nothing is padded to 128 lanes). Each
    group is represented by its best key and the first position holding it, and the ``k``
    best groups are taken in that order. They hold every chosen element: with ``t`` the
    ``k``-th best key, the chosen are the elements better than ``t`` and the ties at ``t``
    of lowest positions. At most ``k`` groups hold a chosen element, and each ranks before
    every group that holds none: its best is better than ``t``, or equal to ``t`` with a
    chosen tie at or after its first position, which is lower than any tie that was not
    chosen. The elements of those groups and of the row's tail after the last whole block
    are then sorted by (key, position), the ``k`` first taken: ``lax.top_k``'s positions
    in its order.
    """
    rows, m = v.shape
    group = group_size(m, k, lanes) if group is None else int(group)
    block = group * lanes
    whole = m // block
    if not (1 <= k <= whole * lanes):
        raise ValueError(f"grouped_top_k: k={k} of a row of {m} in groups of {group} x {lanes} lanes.")

    def keys(a):
        return _order_keys(jnp.abs(a) if of_abs else a)

    def one(x):
        best, j = _first_min(keys(x[:whole * block].reshape(whole, group, lanes)), 1)  # [whole, lanes]
        base = lax.broadcasted_iota(jnp.int32, best.shape, 0) * block + lax.broadcasted_iota(
            jnp.int32, best.shape, 1)
        first = (base + j * lanes).reshape(-1)
        chosen = lax.sort((best.reshape(-1), first), num_keys=2)[1][:k]
        start = chosen // block * block + chosen % lanes  # each chosen group's first element
        if lanes == 1:  # consecutive: whole rows of the [whole, L] view
            cand = x[:whole * block].reshape(whole, group)[start // group].reshape(-1)
            cpos = (start[:, None] + lax.iota(jnp.int32, group)[None, :]).reshape(-1)
        else:  # [L, k]: k on the lanes
            cpos = (start[None, :] + lanes * lax.iota(jnp.int32, group)[:, None]).reshape(-1)
            cand = x[cpos]
        ckey = keys(cand)
        if m > whole * block:  # the tail, every element a candidate
            ckey = jnp.concatenate([ckey, keys(x[whole * block:])])
            cpos = jnp.concatenate([cpos, lax.iota(jnp.int32, m - whole * block) + whole * block])
        return lax.sort((ckey, cpos), num_keys=2)[1][:k]

    return jax.vmap(one)(v)


def sorted_top_k(mag: jax.Array, k: int) -> jax.Array:
    """``lax.top_k(mag, k)[1]`` as int32 by a stable sort of integer keys with the
    positions: the same positions in the same order (largest first, the lower position
    first among equals, in the total order ``lax.top_k`` uses: ``-NaN < -inf < ... <
    -0.0 < 0.0 < ... < inf < NaN``)."""
    pos = lax.broadcasted_iota(jnp.int32, mag.shape, 1)
    return lax.sort((_order_keys(mag), pos), dimension=1, num_keys=1, is_stable=True)[1][:, :k]


def uses_two_stage(m: int, k: int) -> bool:
    """Whether ``exact_top_k`` selects ``k`` of a row of ``m`` in two stages."""
    return m * k >= TWO_STAGE_MIN_WORK and k * 8 <= m


def two_stage_top_k(mag: jax.Array, k: int) -> jax.Array:
    """``lax.top_k(mag, k)[1]`` as int32, without sorting long rows.

    A long row is cut into sub-rows of ``_ROW`` elements; each offers its ``c`` largest
    as candidates (``lax.top_k`` on short rows), and the ``k`` largest candidates are
    chosen among them. That is exact unless some sub-row's last (``c``-th) candidate is
    itself chosen (the sub-row might hold more of the top ``k``): then the whole row goes
    through ``lax.top_k`` instead, under ``lax.cond``. Candidates keep row-major order, so
    ties break toward the lower position exactly as ``lax.top_k`` does.
    """
    rows, m = mag.shape
    sub = -(-m // _ROW)
    c = min(_ROW, max(16, 4 * -(-k // sub)))
    padded = jnp.pad(mag, ((0, 0), (0, sub * _ROW - m)), constant_values=-1.0)
    cand_val, cand_idx = lax.top_k(padded.reshape(rows, sub, _ROW), c)  # [R, sub, c]
    _, pick = lax.top_k(cand_val.reshape(rows, sub * c), k)  # [R, k] into candidates
    pos = (jnp.arange(sub, dtype=jnp.int32)[:, None] * _ROW + cand_idx.astype(jnp.int32)).reshape(rows, -1)
    idx = jnp.take_along_axis(pos, pick, axis=1)
    exact = jnp.all(pick % c != c - 1)
    return lax.cond(exact, lambda: idx, lambda: lax.top_k(mag, k)[1].astype(jnp.int32))


# ------------------------------------------------------------------------------- top-k


@dataclasses.dataclass(frozen=True)
class TopK(_SparseDecode, Compressor):
    """Keep the ``k`` entries of largest magnitude of each selection domain (see
    [`top_k`][commjax.compressors.sparse.top_k])."""

    ratio: float = 0.01
    approximate: bool = False
    scope: str = "leaf"
    values_dtype_name: str = "float32"
    chunk_size: Optional[int] = None
    recall_target: float = 0.95
    name: ClassVar[str] = "top_k"
    metric_names: ClassVar[tuple[str, ...]] = ("density",)
    metrics_from_payload: ClassVar[bool] = True

    @property
    def leaf_local(self) -> bool:
        """Each leaf its own selection domains with ``scope="leaf"`` (``groups``)."""
        return self.scope == "leaf"

    @property
    def values_dtype(self) -> Any:
        return _VALUE_DTYPES[self.values_dtype_name]

    def groups(self, n: int, segments: Optional[Sequence[Segment]] = None) -> list[_Group]:
        """The static selection layout of a bucket of ``n`` elements."""
        out = []
        for off, size in _domains(n, segments, self.scope == "leaf"):
            chunk = size if self.chunk_size is None else min(self.chunk_size, size)
            chunks = -(-size // chunk)
            out.append(_Group(off, size, chunk, chunks, keep_count(self.ratio, chunk)))
        return out

    def num_kept(self, n: int, segments: Optional[Sequence[Segment]] = None) -> int:
        """Entries each replica sends for a bucket of ``n`` elements."""
        return sum(g.chunks * g.k for g in self.groups(n, segments))

    def _group_words(self, g: _Group) -> tuple[int, int]:
        c = g.chunks * g.k
        idx = c if self.chunk_size is None else _u16_words(c)
        return _value_words(c, self.values_dtype_name), idx

    def payload_words(self, n: int, segments: Optional[Sequence[Segment]] = None) -> int:
        return sum(sum(self._group_words(g)) for g in self.groups(n, segments))

    def _chunked(self, x: jax.Array, g: _Group) -> jax.Array:
        xs = x[g.offset:g.offset + g.size]
        pad = g.chunks * g.chunk - g.size
        if pad:
            xs = jnp.pad(xs, (0, pad))
        return xs.reshape(g.chunks, g.chunk)

    def select(
        self, x: jax.Array, segments: Optional[Sequence[Segment]] = None
    ) -> list[tuple[jax.Array, jax.Array]]:
        """Per group, ``(values[chunks, k], offsets[chunks, k])`` of the kept entries.

        ``offsets`` are int32 positions inside each chunk. Exact selection uses
        ``lax.top_k`` on ``|x|``: among equal magnitudes the lower index wins.
        """
        out = []
        for g in self.groups(x.shape[0], segments):
            xs = self._chunked(x, g)
            if self.approximate:
                _, idx = lax.approx_max_k(jnp.abs(xs), g.k, recall_target=self.recall_target)
            else:
                idx = exact_top_k(xs, g.k, of_abs=True)
            idx = idx.astype(jnp.int32)
            out.append((jnp.take_along_axis(xs, idx, axis=1), idx))
        return out

    def encode(self, x, key=None, segments=None):
        parts = []
        for g, (vals, idx) in zip(self.groups(x.shape[0], segments), self.select(x, segments)):
            parts.append(_pack_values(vals.reshape(-1), self.values_dtype_name))
            flat = idx.reshape(-1)
            if self.chunk_size is None:
                parts.append(flat.astype(jnp.uint32))
            else:
                parts.append(_pack_u16(flat.astype(jnp.uint16)))
        if not parts:
            return jnp.zeros((0,), jnp.uint32)
        return jnp.concatenate(parts)

    def entries(self, payload, n, segments=None):
        got = [(jnp.where(p < g.size, p + g.offset, n), v) for g, p, v in self._group_entries(payload, n, segments)]
        return _entries([p for p, _ in got], [v for _, v in got])

    def _group_entries(self, payload, n, segments):
        """Per selection domain ``g``: ``(g, positions, values)`` of its entries, the
        positions inside the domain (a short last chunk's padding slots at ``g.size`` or
        past it)."""
        w = 0
        for g in self.groups(n, segments):
            c = g.chunks * g.k
            vw, iw = self._group_words(g)
            vals = _unpack_values(payload[w:w + vw], c, self.values_dtype_name)
            w += vw
            if self.chunk_size is None:
                idx = payload[w:w + iw].astype(jnp.int32)
            else:
                idx = _unpack_u16(payload[w:w + iw], c).astype(jnp.int32)
            w += iw
            base = g.chunk * jnp.arange(g.chunks, dtype=jnp.int32)
            yield g, (idx.reshape(g.chunks, g.k) + base[:, None]).reshape(-1), vals

    def decode_sum_leaves(self, payloads, segments, *, divide=1):
        """``cut(decode_sum(payloads, n, segments, divide=divide), segments)`` for
        ``scope="leaf"``, each segment's sum scatter-added into a buffer of its own: the
        same values bit for bit (the same additions in replica order), without a
        bucket-size sum cut into copies of its leaves."""
        if self.scope != "leaf":
            raise ValueError(f"decode_sum_leaves needs scope='leaf', not {self.scope!r}")
        n = sum(s.padded_size for s in segments)
        of_group = {s.offset: i for i, s in enumerate(segments) if s.size > 0}  # as ``groups``
        # Padding slots (at or past a group's size) are dropped by the scatter.
        return _replica_sums(payloads, [s.size for s in segments],
                             lambda w: [(of_group[g.offset], p, v) for g, p, v in self._group_entries(w, n, segments)],
                             divide)

    def local_metrics(self, x, segments):
        """``density``: fraction of the bucket's entries sent as non-zeros this step,
        ``sum_chunks min(nnz, k) / n`` (a chunk's ``k`` largest magnitudes are all
        non-zero, or include all of its non-zeros)."""
        n = x.shape[0]
        if n == 0:
            return {"density": jnp.zeros((), jnp.float32)}
        sent = jnp.zeros((), jnp.int32)
        for g in self.groups(n, segments):
            nnz = jnp.sum(self._chunked(x, g) != 0, axis=1)
            sent = sent + jnp.sum(jnp.minimum(nnz, g.k))
        return {"density": sent.astype(jnp.float32) / self._domain_size(n, segments)}

    def _domain_size(self, n: int, segments) -> int:
        return max(sum(g.size for g in self.groups(n, segments)), 1)

    def payload_metrics(self, sent, segments):
        """``density`` counted in the payloads: their non-zero values over the bucket's
        selection domains (``local_metrics``' value where the selection is exact and the
        values travel in fp32; an approximate selection's or a bf16 value that underflows
        counts as what it is, and the two-phase reducer's per-chunk selection as made)."""
        count = jnp.zeros((), jnp.int32)
        for words, n, segs in sent:
            count = count + jnp.sum(self.entries(words, n, segs)[1] != 0)
        n = sum(int(s.padded_size) for s in segments)
        return {"density": count.astype(jnp.float32) / self._domain_size(n, segments)}


def top_k(
    ratio: float = 0.01,
    *,
    approximate: bool = False,
    scope: str = "leaf",
    values_dtype: Any = jnp.float32,
    chunk_size: Optional[int] = None,
    recall_target: float = 0.95,
) -> TopK:
    """Top-k sparsification: send the ``k`` entries of largest magnitude, with their indices.

    For each selection domain ``D`` (a leaf with ``scope="leaf"``, the whole flattened
    gradient with ``scope="model"``, and with ``chunk_size`` each chunk of
    ``chunk_size`` elements of it)::

        k = clip(ceil(ratio * |D|), 1, |D|)
        S = indices of the k largest |x_i|, i in D      (ties: the lower index wins)
        C(x)_i = x_i if i in S else 0

    Every domain sends at least one entry, even a leaf smaller than ``1 / ratio``.
    With error feedback (default in [`commjax.compressed_mean`][]) the unsent
    ``x - C(x)`` is added to the next step's gradient.

    Bytes per replica payload, ``K`` entries kept: ``4 K`` for fp32 values (``2 K`` for
    bfloat16) plus ``4 K`` for uint32 indices (``2 K`` for uint16 chunk offsets). The
    payloads are all-gathered: ``(N - 1) * payload`` per device, e.g. 8 replicas, 1%
    density, fp32 values and uint32 indices: ``7 * 8 * 0.01 = 0.56`` bytes per element
    against ``2 * 7/8 * 4 = 7`` for the fp32 all-reduce (12.5x less).

    Args:
      ratio: density, the fraction of entries sent, in (0, 1].
      approximate: use ``lax.approx_max_k`` (fast on TPU; exact fallback elsewhere)
        instead of ``lax.top_k``; it may miss a few of the true top entries.
      scope: ``"leaf"`` (k per tensor: every tensor keeps its share) or ``"model"``
        (k over the whole flattened gradient: large tensors can take every slot).
      values_dtype: ``jnp.float32`` or ``jnp.bfloat16`` (values rounded to nearest;
        error feedback carries the rounding error).
      chunk_size: cut each domain into chunks of this many elements (at most 65536),
        keep ``ceil(ratio * chunk_size)`` per chunk and send uint16 offsets within the
        chunk instead of uint32 indices. ``None``: one chunk per domain, uint32 indices.
      recall_target: ``lax.approx_max_k``'s recall target (``approximate=True`` only).

    Example::

        tx = optax.chain(cj.compressed_mean(cj.top_k(0.01), "data"), optax.sgd(0.1, 0.9))
    """
    r = _check_ratio(ratio, factory="top_k")
    check_choice("scope", scope, ("leaf", "model"), factory="top_k")
    vname = _value_dtype_name(values_dtype, factory="top_k")
    if chunk_size is not None:
        if isinstance(chunk_size, bool) or not isinstance(chunk_size, (int, np.integer)) or not (
            1 <= int(chunk_size) <= MAX_CHUNK
        ):
            raise ValueError(
                f"top_k: `chunk_size` must be None (uint32 indices) or an integer in "
                f"[1, {MAX_CHUNK}] (uint16 offsets within a chunk), got {chunk_size!r}."
            )
        chunk_size = int(chunk_size)
    if not (0.0 < float(recall_target) <= 1.0):
        raise ValueError(f"top_k: `recall_target` must be in (0, 1], got {recall_target!r}.")
    return TopK(
        ratio=r, approximate=check_bool("approximate", approximate, factory="top_k"), scope=scope,
        values_dtype_name=vname,
        chunk_size=chunk_size, recall_target=float(recall_target),
    )


# ---------------------------------------------------------------------------- random-k


def _raw_key(key: Optional[jax.Array]) -> jax.Array:
    if key is None:
        raise ValueError(
            "random_k needs the PRNG key shared by all replicas (compressed_mean passes it); "
            "got key=None."
        )
    if jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        key = jax.random.key_data(key)
    return key.astype(jnp.uint32).reshape(-1)[:2]


@dataclasses.dataclass(frozen=True)
class RandomK(Compressor):
    """Send the values at ``k`` positions drawn from a key shared by all replicas
    (see [`random_k`][commjax.compressors.sparse.random_k])."""

    ratio: float = 0.01
    rescale: bool = False
    values_dtype_name: str = "float32"
    name: ClassVar[str] = "random_k"
    linear: ClassVar[bool] = True
    shared_randomness: ClassVar[bool] = True
    # Only the K values travel (commjax.collectives._reducers.SharedMask reduces them): decoding
    # needs the positions, which the shared key gives.
    metric_names: ClassVar[tuple[str, ...]] = ("density",)

    @property
    def values_dtype(self) -> Any:
        return _VALUE_DTYPES[self.values_dtype_name]

    def groups(self, n: int, segments: Optional[Sequence[Segment]] = None) -> list[tuple[int, int, int]]:
        """``(offset, size, k)`` per leaf (the whole bucket when ``segments`` is None)."""
        return [(o, s, keep_count(self.ratio, s)) for o, s in _domains(n, segments, True)]

    def num_kept(self, n: int, segments: Optional[Sequence[Segment]] = None) -> int:
        return sum(k for _, _, k in self.groups(n, segments))

    def positions(
        self, key: jax.Array, n: int, segments: Optional[Sequence[Segment]] = None
    ) -> tuple[jax.Array, jax.Array]:
        """``(positions int32[K], stratum float32[K])`` for this key.

        Each leaf of ``s`` elements is cut into ``k`` strata ``[b_j, b_{j+1})`` with
        ``b_j = floor(j s / k)`` and one position is drawn uniformly in each: exactly
        ``k`` distinct positions in O(k) work (no sort of the whole leaf), and every
        element is chosen with probability ``1 / (b_{j+1} - b_j) ~ k / s``. ``stratum``
        is that stratum length, the inverse inclusion probability.
        """
        raw = _raw_key(key)
        pos, length = [], []
        for i, (off, size, k) in enumerate(self.groups(n, segments)):
            bounds = (np.arange(k + 1, dtype=np.int64) * size) // k
            lo = jnp.asarray(bounds[:-1].astype(np.int32))
            ln = np.diff(bounds).astype(np.int32)
            u = jax.random.uniform(jax.random.fold_in(raw, i), (k,), jnp.float32)
            r = jnp.minimum((u * ln).astype(jnp.int32), jnp.asarray(ln - 1))
            pos.append(off + lo + r)
            length.append(jnp.asarray(ln.astype(np.float32)))
        if not pos:
            return jnp.zeros((0,), jnp.int32), jnp.zeros((0,), jnp.float32)
        return jnp.concatenate(pos), jnp.concatenate(length)

    # Linear interface: the k values themselves (summable), positions from the key.
    def encode_linear(self, x, key, segments=None):
        pos, stratum = self.positions(key, x.shape[0], segments)
        vals = x[pos]
        out = vals * stratum if self.rescale else vals
        # Finite values stay finite: saturated at the values' largest (a rescaled value
        # above float32's, or one above bfloat16's), a bias only where |x| > max * k / n.
        return _saturate(out, jnp.isfinite(vals), self.values_dtype).astype(self.values_dtype)

    def decode_linear(self, summed, n, key=None, segments=None):
        if key is None:
            raise TypeError(
                "random_k: decode_linear needs the shared key that chose the positions; "
                "random_k runs its own exchange inside compressed_mean."
            )
        pos, _ = self.positions(key, n, segments)
        return jnp.zeros((n,), jnp.float32).at[pos].set(
            summed.astype(jnp.float32), unique_indices=True
        )

    def linear_payload_bytes(self, n: int, segments: Optional[Sequence[Segment]] = None) -> int:
        return jnp.dtype(self.values_dtype).itemsize * self.num_kept(n, segments)

    # Self-contained payload for the generic interface: [key (2 words) | values].
    def payload_words(self, n, segments=None):
        return 2 + _value_words(self.num_kept(n, segments), self.values_dtype_name)

    def encode(self, x, key, segments=None):
        raw = _raw_key(key)
        vals = self.encode_linear(x, raw, segments).astype(jnp.float32)
        return jnp.concatenate([raw, _pack_values(vals, self.values_dtype_name)])

    def decode(self, payload, n, segments=None):
        raw = payload[:2]
        k = self.num_kept(n, segments)
        vals = _unpack_values(payload[2:], k, self.values_dtype_name)
        return self.decode_linear(vals, n, raw, segments)

    def encode_and_decode(self, x, key, segments=None):
        raw = _raw_key(key)
        vals = self.encode_linear(x, raw, segments)
        words = jnp.concatenate([raw, _pack_values(vals.astype(jnp.float32), self.values_dtype_name)])
        return words, self.decode_linear(vals, x.shape[0], raw, segments)

    @property
    def value_codec(self) -> Compressor:
        """How the ``K`` values travel: fp32 ([`identity`][commjax.compressors.sparse.identity], one
        all-reduce) or bf16
        ([`cast`][commjax.compressors.sparse.cast], packed words summed in fp32 by the two-phase
        reducer)."""
        # A few values: blocks of 2, so that padding to N chunks of whole blocks stays small.
        return identity() if self.values_dtype_name == "float32" else Cast(block_size=2)

    def local_metrics(self, x, segments):
        """``density``: fraction of the bucket's entries sent (``K / n``, static)."""
        n = x.shape[0]
        return {"density": jnp.asarray(self.num_kept(n, segments) / max(n, 1), jnp.float32)}


def random_k(ratio: float = 0.01, *, rescale: bool = False, values_dtype: Any = jnp.float32) -> RandomK:
    """Random-k sparsification with a mask shared by every replica: no indices travel.

    Each step, ``k = clip(ceil(ratio * s), 1, s)`` positions of every leaf of ``s``
    elements are drawn from the per-step key that [`commjax.compressed_mean`][] makes
    identically on all replicas (``fold_in(key, step)``), so the mask changes every step
    but is the same everywhere. Only the ``k`` values are sent and summed with one
    all-reduce::

        C(x)_i = w_i x_i  for i in S_t,  0 elsewhere;   mean = (1/N) sum_r C(x_r)

    with ``w_i = 1`` (default; use error feedback), or ``w_i = 1 / P(i in S_t) ~ 1/ratio``
    with ``rescale=True``, which makes ``E[C(x)] = x`` (use it with
    ``error_feedback=False``: with error feedback the rescaled estimate overshoots and
    the residual grows).

    Positions are drawn by stratified sampling: each leaf is cut into ``k`` equal strata
    and one position is drawn uniformly in each, so exactly ``k`` distinct positions
    cost O(k) random numbers (no permutation of millions of elements).

    Bytes per device: the ``K`` values (``4 K`` bytes in fp32) in one ring all-reduce,
    ``2 (N - 1) / N * 4 K``; 1% density is ~100x less than the fp32 all-reduce.
    With ``values_dtype=jnp.bfloat16`` the values go as packed 16-bit words (``2 K``
    bytes per replica) through an all-to-all and an all-gather and are summed in fp32.

    Args:
      ratio: density in (0, 1].
      rescale: unbiased scaling by the inverse inclusion probability (~``1 / ratio``); a
        rescaled value beyond the values' largest (``|x| > 3.4e38 ratio`` in float32)
        saturates there (finite, biased toward zero).
      values_dtype: ``jnp.float32`` or ``jnp.bfloat16`` (values above 3.3895e38 saturate).
    """
    r = _check_ratio(ratio, factory="random_k")
    vname = _value_dtype_name(values_dtype, factory="random_k")
    return RandomK(ratio=r, rescale=check_bool("rescale", rescale, factory="random_k"),
                   values_dtype_name=vname)


# --------------------------------------------------------------------------- threshold


@dataclasses.dataclass(frozen=True)
class Threshold(_SparseDecode, Compressor):
    """Send the entries with ``|x_i| >= tau``, at most ``capacity`` (see
    [`threshold`][commjax.compressors.sparse.threshold])."""

    tau: float = 1e-3
    capacity: int = 1024
    values_dtype_name: str = "float32"
    name: ClassVar[str] = "threshold"
    metric_names: ClassVar[tuple[str, ...]] = ("density", "dropped")

    def slots(self, n: int) -> int:
        return min(self.capacity, n)

    def payload_words(self, n, segments=None):
        c = self.slots(n)
        return _value_words(c, self.values_dtype_name) + c

    def encode(self, x, key=None, segments=None):
        n = x.shape[0]
        c = self.slots(n)
        if c == 0:
            return jnp.zeros((0,), jnp.uint32)
        mag = jnp.abs(x)
        # Entries under the threshold rank below every entry over it.
        score = jnp.where(mag >= self.tau, mag, -1.0)
        top, idx = lax.top_k(score, c)
        ok = top >= 0
        vals = jnp.where(ok, x[idx], 0.0)
        idx = jnp.where(ok, idx, 0).astype(jnp.uint32)
        return jnp.concatenate([_pack_values(vals, self.values_dtype_name), idx])

    def entries(self, payload, n, segments=None):
        c = self.slots(n)
        vw = _value_words(c, self.values_dtype_name)
        vals = _unpack_values(payload[:vw], c, self.values_dtype_name)
        idx = payload[vw:vw + c].astype(jnp.int32)
        # Unused slots carry (index 0, value 0): a harmless add.
        return _entries([idx], [vals])

    def local_metrics(self, x, segments):
        """``density``: fraction of entries sent; ``dropped``: entries over the threshold
        left out for lack of capacity (carried by error feedback)."""
        n = x.shape[0]
        over = jnp.sum(jnp.abs(x) >= self.tau)  # tau > 0: these are all non-zero
        sent = jnp.minimum(over, self.slots(n))
        return {
            "density": sent.astype(jnp.float32) / max(n, 1),
            "dropped": (over - sent).astype(jnp.float32),
        }


def threshold(tau: float, capacity: int, *, values_dtype: Any = jnp.float32) -> Threshold:
    """Threshold sparsification with a fixed-size payload.

    Sends every entry with ``|x_i| >= tau``; when more than ``capacity`` qualify, the
    ``capacity`` largest in magnitude are sent (ties: the lower index) and the others
    are *dropped* for this step (error feedback carries them)::

        S = top-capacity of {i : |x_i| >= tau};   C(x)_i = x_i if i in S else 0

    The payload always has ``capacity`` slots (unused ones are zeros), so its size is
    static: ``4 * capacity`` bytes of fp32 values (``2 *`` in bfloat16) plus
    ``4 * capacity`` of uint32 indices per replica, all-gathered:
    ``(N - 1) * 8 * capacity`` bytes per device.

    Per-step metrics (``state.metrics`` of [`commjax.compressed_mean`][], per replica):
    ``density`` (fraction of entries actually sent) and ``dropped`` (entries over the
    threshold that did not fit).

    Args:
      tau: the magnitude threshold, a finite number > 0.
      capacity: the most entries sent per step and replica (over the whole compressed
        bucket), an integer >= 1.
      values_dtype: ``jnp.float32`` or ``jnp.bfloat16``.
    """
    if isinstance(tau, bool) or not isinstance(tau, (int, float, np.floating, np.integer)) or not (
        math.isfinite(float(tau)) and float(tau) > 0
    ):
        raise ValueError(f"threshold: `tau` must be a finite number > 0, got {tau!r}.")
    if isinstance(capacity, bool) or not isinstance(capacity, (int, np.integer)) or int(capacity) < 1:
        raise ValueError(f"threshold: `capacity` must be an integer >= 1, got {capacity!r}.")
    vname = _value_dtype_name(values_dtype, factory="threshold")
    return Threshold(tau=float(tau), capacity=int(capacity), values_dtype_name=vname)
