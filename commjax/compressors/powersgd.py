"""PowerSGD: low-rank gradient compression by one step of subspace iteration per step.

Each compressed leaf (a matrix ``M`` of ``m`` rows and ``n`` columns; N-D leaves are
viewed as matrices, see ``matrix_dims``) is replaced, on every replica, by a rank-``r``
approximation of the replicas' *mean* ``M_bar = (1/N) sum_i M_i``. With ``Q`` an
``n x r`` matrix that every replica holds identically (the previous step's ``Q``: warm
start)::

    Q^    = orth(Q)                                   # n x r, orthonormal columns
    P     = (1/N) sum_i M_i Q^          = M_bar Q^    # all-reduce #1: m r floats
    P^    = orth(P)                                   # m x r
    Q     = (1/N) sum_i M_i^T P^        = M_bar^T P^  # all-reduce #2: n r floats
    M_hat = P^ Q^T                      = P^ P^^T M_bar

``M_hat`` is the orthogonal projection of ``M_bar`` onto the span of ``P^``; with warm
start, successive steps are the iterations of the block power (subspace) method, which
converges to the best rank-``r`` approximation of a slowly changing ``M_bar``. Linear
products of the replicas' own matrices are what travel, so an fp32 ``psum`` sums them
exactly (no quantized integers are ever summed). All ``P`` of a step (every leaf, every
same-shape group) travel in **one** fused all-reduce, all ``Q`` in a second one.

Error feedback is [`commjax.compressed_mean`][]'s ``error_feedback`` option (default
on). The transform adds the residual ``e_i`` to the gradient and keeps
``e_i <- x_i - M_hat`` with ``x_i = g_i + e_i``: the residual is taken against the
decompressed **mean** approximation, as in PyTorch's DDP hook and the paper. PowerSGD is
biased, so turning it off is rarely a good idea. Only the replicas' *mean* residual
enters ``M_hat`` (``P`` sums the ``M_i Q^``), and it is the residual of the mean's
compression; each replica's own residual also keeps its accumulated deviation from the
mean, so the ``residual_norm`` metric grows with the replicas' disagreement (non-i.i.d.
data) without biasing the result.

State: the factors (``Q``; ``P`` too with ``alternating``) are replicated, in
``CompressedMeanState.compressor_state``
([`PowerSGDState`][commjax.compressors.powersgd.PowerSGDState], ``P()`` under
``shard_map``); the residual is per replica. The phase (warm-up, P-step, Q-step) follows
the transform's step counter, so a restored checkpoint resumes in the right phase.
Columns of ``Q`` (or ``P``) that die (a zero gradient) are re-drawn from the key shared
by all replicas before use, so the iteration never stays stuck at zero.

Bytes sent per step and device (ring all-reduce of fp32 over ``N`` replicas; sums over
the compressed leaves, ``r_l = min(r, m_l, n_l)``)::

    warm-up (step < start_step):  2 (N-1)/N * 4 * sum_l m_l n_l          (exact mean)
    PowerSGD:                     2 (N-1)/N * 4 * sum_l (m_l + n_l) r_l  (P, then Q)
    alternating, P-step:          2 (N-1)/N * 4 * sum_l m_l r_l
    alternating, Q-step:          2 (N-1)/N * 4 * sum_l n_l r_l

Leaves that are 1-D, or whose compression rate ``m n / ((m + n) r)`` is below
``min_compression_rate``, are averaged exactly in the transform's fused exact bucket.
With ``start_step > 0`` or ``alternating`` the phases are branches of one ``lax.cond``
/ ``lax.switch``; a static count of the compiled HLO's collectives
([`commjax.collective_bytes`][]) lists every branch's all-reduce, while
[`PowerSGD.phase_bytes`][commjax.compressors.powersgd.PowerSGD.phase_bytes] gives each phase's bytes
and
[`PowerSGD.exchange_bytes`][commjax.compressors.powersgd.PowerSGD.exchange_bytes] (what
[`commjax.communication_plan`][] reports) the
steady state after the warm-up.

References:
  T. Vogels, S. P. Karimireddy, M. Jaggi. "PowerSGD: Practical Low-Rank Gradient
  Compression for Distributed Optimization". NeurIPS 2019. arXiv:1905.13727.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, ClassVar, Mapping, NamedTuple, Sequence, Union

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from commjax import _compat
from commjax import noise
from commjax.accounting import ring_bytes
from commjax.compressors.base import Compressor, Segment, check_choice, check_positive_int
from commjax.kernels._dispatch import fence

__all__ = ["PowerSGD", "PowerSGDState", "powersgd", "orthogonalize", "matrix_shape", "shared_uniform",
           "reseed", "seeded", "low_rank_product", "outer_sum", "transposed_product", "product"]

ORTHOGONALIZATIONS = ("gram_schmidt", "qr")
_HIGHEST = lax.Precision.HIGHEST


class PowerSGDState(NamedTuple):
    """Replicated state of [`PowerSGD`][commjax.compressors.powersgd.PowerSGD]
    (``CompressedMeanState.compressor_state``).

    One entry per *group* of compressed leaves (leaves of the same matrix shape when
    ``batch_same_shape``, else one leaf each), in the order the groups first appear in
    the gradient pytree.

    Attributes:
      q: ``float32[G, n, r]`` per group: the last ``Q`` (warm start). Without
        ``alternating`` it is the raw all-reduced ``M_bar^T P^`` and is orthogonalized
        when next used; with ``alternating`` it is kept orthonormal. ``()`` when
        ``warm_start=False`` (a fresh ``Q`` is drawn every step).
      p: ``float32[G, m, r]`` per group, orthonormal: the last ``P^`` (``alternating``
        only; ``()`` otherwise).

    Every leaf is identical on all replicas: lay it out with ``P()`` (as
    [`commjax.state_specs`][] does for ``compressor_state``).
    """

    q: tuple
    p: tuple


@dataclasses.dataclass(frozen=True)
class _Group:
    m: int
    n: int
    r: int
    members: tuple[int, ...]  # indices into the segments


def matrix_shape(shape: Sequence[int], matrix_dims: Any = None) -> tuple[int, int]:
    """``(rows, cols)`` of the matrix view of a leaf of ``shape`` (C order, no copy).

    ``matrix_dims``: ``None`` (last dim is the columns, all others the rows: a flax
    ``Dense`` kernel ``(in, out)`` or ``Conv`` kernel ``(h, w, in, out)`` becomes
    ``(h w in) x out``); an int ``k``, the number of leading dims that form the rows
    (negative: counted from the end, ``-1`` is the default), which must leave at least one
    dim on each side of every compressed leaf (``0 < k < ndim`` or ``-ndim < k < 0``; else a
    ``ValueError`` names the leaf); or a mapping ``{ndim: k}`` that applies per number of
    dims (other ranks use the default).
    """
    shape = tuple(int(d) for d in shape)
    nd = len(shape)
    if nd < 2:
        raise ValueError(f"powersgd: a leaf of shape {shape} has no matrix view (needs >= 2 dims)")
    k: Any = matrix_dims
    if isinstance(k, tuple):  # the normalized mapping: ((ndim, k), ...)
        k = dict(k).get(nd)
    if k is None:
        k = -1
    split = k if k >= 0 else nd + k
    if not 1 <= split <= nd - 1:
        raise ValueError(
            f"powersgd: `matrix_dims`={matrix_dims!r} leaves no rows or no columns for a leaf of "
            f"shape {shape}: an int k takes the first k dims as rows (0 < k < {nd}, or "
            f"-{nd} < k < 0). For leaves of several ranks give a mapping {{ndim: k}}.")
    return math.prod(shape[:split]), math.prod(shape[split:])


# ----------------------------------------------------------------------------- maths


def _norm(v: jax.Array, axis: int) -> jax.Array:
    """Euclidean norm along ``axis`` (kept), scaled by the largest entry first so that
    neither tiny (squares underflow) nor huge (squares overflow) values go wrong."""
    amax = jnp.max(jnp.abs(v), axis=axis, keepdims=True)
    s = jnp.where(amax > 0, amax, 1.0)
    return s * jnp.sqrt(jnp.sum(jnp.square(v / s), axis=axis, keepdims=True))


def _col_norms(a: jax.Array) -> jax.Array:
    """Euclidean norms of the columns of ``[..., m, r]``: ``[..., r]``."""
    return _norm(a, -2)[..., 0, :]


def _gram_schmidt(a: jax.Array, epsilon: float) -> jax.Array:
    """Column-by-column Gram-Schmidt with re-orthogonalization, batched over ``[..., m, r]``.

    Column ``i``, with ``U`` the columns already done: ``v1 = a_i - U U^T a_i`` and
    ``v2 = v1 - U U^T v1`` (the second pass restores the orthogonality that cancellation
    loses: Kahan and Parlett's "twice is enough"). ``u_i = v2 / ||v2||``, unless the column
    is numerically in the span of ``U``, and then ``u_i = 0`` exactly: when the second pass
    still cancels (``||v2|| < ||v1|| / 2``) or when ``||v2|| <= epsilon ||a_i||``. So every
    output column is unit-norm and orthogonal to the others to fp32 round-off, or zero:
    never NaN or Inf, whatever the input's scale. One loop body for all columns keeps
    compile time flat in ``r``.
    """
    r = a.shape[-1]

    def project_out(u, v):  # columns >= i of u are still zero and drop out
        c = jnp.einsum("...mk,...m->...k", u, v, precision=_HIGHEST)
        return v - jnp.einsum("...mk,...k->...m", u, c, precision=_HIGHEST)

    def body(i, u):
        v = lax.dynamic_index_in_dim(a, i, axis=a.ndim - 1, keepdims=False)
        n0 = _norm(v, -1)
        v1 = project_out(u, v)
        v2 = project_out(u, v1)
        n1, n2 = _norm(v1, -1), _norm(v2, -1)
        keep = (n2 > epsilon * n0) & (2.0 * n2 >= n1) & (n2 > 0)
        v = jnp.where(keep, v2 / jnp.where(keep, n2, 1.0), 0.0)
        return lax.dynamic_update_index_in_dim(u, v, i, axis=a.ndim - 1)

    if r == 1:
        return body(0, jnp.zeros_like(a))
    return lax.fori_loop(0, r, body, jnp.zeros_like(a))


def orthogonalize(
    matrices: jax.Array, *, method: str = "gram_schmidt", epsilon: float = 1e-8
) -> jax.Array:
    """Orthonormal columns spanning the columns of ``matrices`` (``[..., m, r]``, ``r <= m``).

    ``method="gram_schmidt"``: see ``_gram_schmidt``; columns that are (numerically,
    or up to a relative ``epsilon``) linearly dependent on earlier ones come out as exact
    zeros, the others orthonormal.
    ``method="qr"``: the ``Q`` factor of ``jnp.linalg.qr`` (Householder): always
    orthonormal, columns of a rank-deficient input complete the basis arbitrarily.
    Either way ``U U^T A == A`` for the result ``U`` and input ``A``, in fp32.
    """
    check_choice("method", method, ORTHOGONALIZATIONS, factory="orthogonalize")
    a = jnp.asarray(matrices, jnp.float32)
    if a.ndim < 2 or a.shape[-1] > a.shape[-2]:
        raise ValueError(
            f"orthogonalize: `matrices` must be [..., m, r] with r <= m, got shape {a.shape}."
        )
    if method == "qr":
        return jnp.linalg.qr(a, mode="reduced")[0]
    return _gram_schmidt(a, float(epsilon))


def shared_uniform(key: jax.Array, salt: int, shape: tuple[int, ...]) -> jax.Array:
    """i.i.d. ``U(-sqrt 3, sqrt 3)`` (zero mean, unit variance) entries, a pure function of
    ``key``, ``salt`` and the position: identical on every replica that holds ``key``.

    Counter-based noise ([`commjax.noise.uniform`][]) rather than ``jax.random.normal``:
    a start or restart vector of the power iteration needs no more than a continuous
    distribution, and this costs a few integer ops instead of a Threefry/erf-inverse
    kernel per call site (which dominates compile time on CPU)."""
    u = noise.uniform(key, shape, salt)
    return (2.0 * u - 1.0) * jnp.float32(math.sqrt(3.0))


def reseed(a: jax.Array, key: jax.Array, salt: int, epsilon: float) -> jax.Array:
    """Replace the dead columns of ``[G, k, r]`` (norm <= epsilon * the largest column of
    that matrix, so every column of an all-zero matrix) by fresh shared random columns.

    Without it a zero gradient (a frozen or not yet reached layer) would zero ``P`` and
    ``Q``, and the warm-started iteration would stay at zero for ever."""
    norms = _col_norms(a)
    dead = norms <= epsilon * jnp.max(norms, axis=-1, keepdims=True)
    fresh = shared_uniform(key, salt, a.shape)
    return jnp.where(dead[..., None, :], fresh, a)


def seeded(key: jax.Array, seed: int) -> jax.Array:
    """``key`` with the compressor's ``seed`` mixed in (the key itself when seed is 0)."""
    if seed == 0:
        return key
    if jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        key = jax.random.key_data(key)
    words = jnp.ravel(key).astype(jnp.uint32)
    return words.at[0].set(noise.fmix32(words[0] ^ noise.fmix32(jnp.uint32(seed & 0xFFFFFFFF) + jnp.uint32(0x1B873593))))


#: GPU contractions of a thin factor longer than this are taken in chunks (``_gpu_chunks``).
_GPU_CHUNK_ROWS = 2048
#: ... unless their length is a multiple of this: XLA's split-K then needs no padding.
_GPU_SPLIT_ALIGN = 256


def _gpu_chunks(k: int) -> int:
    """Chunks (a divisor of ``k``) to contract a length-``k`` axis against a thin factor in,
    on GPU; 1 for one dot.

    XLA's GPU dot of a thin result (``[n, r]``, ``r <= 8``) over a long axis splits that
    axis over thread blocks (split-K) and, where its length is not a multiple of the split
    times the tile, first writes a zero-padded copy of the whole matrix: H100, GPT-2's
    ``[50304, 768]`` embedding, ``M^T P`` of ``g`` and ``e`` read 935 MB where one read of
    each is 309 MB. A batched dot over chunks of at most ``_GPU_CHUNK_ROWS`` is not split
    (312 MB, plus a sum of ``chunks x n x r`` partial products). Lengths that are a
    multiple of ``_GPU_SPLIT_ALIGN`` split without padding and keep one dot; a length
    with no divisor giving chunks of 64 to ``_GPU_CHUNK_ROWS`` (a prime) keeps it too."""
    if k <= _GPU_CHUNK_ROWS or k % _GPU_SPLIT_ALIGN == 0:
        return 1
    for c in range(-(-k // _GPU_CHUNK_ROWS), k // 64 + 1):
        if k % c == 0:
            return c
    return 1


def product(m: jax.Array, f: jax.Array, *, transposed: bool) -> jax.Array:
    """``M F`` (``[m, r]``, ``f`` ``[n, r]``) or with ``transposed`` ``M^T F`` (``[n, r]``,
    ``f`` ``[m, r]``) for ``M`` ``[m, n]``: PowerSGD's two products, each in the form that
    reads ``M`` once on the backend it is lowered for.

    * CPU, ``M^T F`` with ``r <= 8``: a broadcast multiply and a sum over rows. XLA:CPU
      runs the dot, which contracts the large matrix over its leading axis, several times
      slower than one streaming pass over ``M``.
    * GPU, a contraction longer than ``_GPU_CHUNK_ROWS`` and not a multiple of
      ``_GPU_SPLIT_ALIGN``: a batched dot over ``c`` equal chunks of the contracted axis
      and the sum of the ``c`` partial products (``_gpu_chunks``).
    * Otherwise the dot, at ``HIGHEST`` precision.

    The forms agree to fp32 rounding; every replica on one backend computes the same bits."""
    k = m.shape[0] if transposed else m.shape[1]
    r = f.shape[-1]

    def dot(m, f):
        return jnp.matmul(m.T if transposed else m, f, precision=_HIGHEST)

    def streamed(m, f):
        # F^T laid out [r, m]: each of its rows is read contiguously.
        return jnp.sum(m[None, :, :] * f.T[:, :, None], axis=1).T

    if r > 8:
        return dot(m, f)
    branches = {"cpu": streamed} if transposed else {}
    chunks = _gpu_chunks(k)
    if chunks > 1:
        branches["cuda"] = functools.partial(_chunked_product, transposed=transposed, chunks=chunks)
    if not branches:
        return dot(m, f)
    return _compat.platform_dependent(m, f, **branches, default=dot)


def _chunked_product(m: jax.Array, f: jax.Array, *, transposed: bool, chunks: int) -> jax.Array:
    """``product``'s GPU form: ``sum_c M_c^T F_c`` over ``chunks`` equal row blocks of
    ``M`` and ``F`` (``transposed``), or ``sum_c M_c F_c`` over column blocks of ``M`` and
    row blocks of ``F``; ``chunks`` divides the contracted length."""
    k, r = (m.shape[0] if transposed else m.shape[1]), f.shape[-1]
    fc = f.reshape(chunks, k // chunks, r)
    if transposed:
        parts = jnp.einsum("ckn,ckr->cnr", m.reshape(chunks, k // chunks, m.shape[1]), fc, precision=_HIGHEST)
    else:
        parts = jnp.einsum("mck,ckr->cmr", m.reshape(m.shape[0], chunks, k // chunks), fc, precision=_HIGHEST)
    return jnp.sum(parts, axis=0)


def transposed_product(m: jax.Array, p: jax.Array) -> jax.Array:
    """``M^T P`` (``[n, r]``) for ``M`` ``[m, n]`` and a thin ``P`` ``[m, r]``: ``product``."""
    return product(m, p, transposed=True)


def low_rank_product(p: jax.Array, q: jax.Array) -> jax.Array:
    """``P Q^T`` (``[m, n]``) for thin ``P`` ``[m, r]`` and ``Q`` ``[n, r]``.

    On CPU, the dot: ``M_hat`` is written once and read by both of its consumers (the mean
    and the error-feedback residual); a sum of ``r`` broadcast products fused into each
    consumer would compute the product twice, and is no faster there. On GPU and TPU (and
    ``r <= 8``), ``sum_k P[:, k] Q[:, k]^T`` as element-wise products that XLA fuses into
    each consumer: ``M_hat`` is never written, and each consumer reads the small factors
    instead of an ``m x n`` matrix (an H100 step of a 21M-parameter MLP moved 250 MB less).
    Each product is rounded to fp32 before it is added (``fence``) and the terms are added
    in ``k`` order, so every consumer computes the same bits whatever it is fused with.
    """

    def dot(p, q):
        return jnp.matmul(p, q.T, precision=_HIGHEST)

    if p.shape[-1] > 8:
        return dot(p, q)
    return _compat.platform_dependent(p, q, cpu=dot, default=outer_sum)


def outer_sum(p: jax.Array, q: jax.Array) -> jax.Array:
    """``P Q^T`` as ``((t_0 + t_1) + t_2) + ...`` with ``t_k = fence(P[:, k] Q[:, k]^T)``:
    element-wise, so it fuses into whatever reads it."""
    # A factor whose sign bit is 0 but that no compiler knows: the fence's guard.
    guard = jnp.abs(q[0, 0])
    total = None
    for k in range(p.shape[-1]):
        t = fence(p[:, k, None] * q[None, :, k], guard)
        total = t if total is None else total + t
    return total


# ----------------------------------------------------------------------------- compressor


@dataclasses.dataclass(frozen=True)
class PowerSGD(Compressor):
    """Rank-``r`` PowerSGD with its own two-all-reduce exchange (see
    [`powersgd`][commjax.compressors.powersgd.powersgd])."""

    rank: int = 4
    start_step: int = 0
    min_compression_rate: float = 2.0
    warm_start: bool = True
    orthogonalization: str = "gram_schmidt"
    epsilon: float = 1e-8
    seed: int = 0
    batch_same_shape: bool = True
    matrix_dims: Any = None  # None | int | tuple of (ndim, k) pairs
    alternating: bool = False

    name: ClassVar[str] = "powersgd"
    has_exchange: ClassVar[bool] = True  # run by commjax.exchanges.powersgd
    # Fresh and first factors are drawn from replica 0's key (16 bytes in the exact
    # all-reduce): a key that differed between processes would part the replicas.
    shared_randomness: ClassVar[bool] = True
    # Factors are per leaf: the fused all-reduces add slot by slot, and Gram-Schmidt runs
    # per matrix (a stacked group is a batch, and zero-padding stays zero).
    leaf_local: ClassVar[bool] = True
    metric_names: ClassVar[tuple[str, ...]] = ("compression_rate", "compressed_leaves")

    # -------------------------------------------------------------- shapes and routing

    def matrix_shape(self, shape: Sequence[int]) -> tuple[int, int]:
        """``(m, n)``: how a leaf of ``shape`` is viewed as a matrix."""
        return matrix_shape(shape, self.matrix_dims)

    def leaf_rank(self, shape: Sequence[int]) -> int:
        """``min(rank, m, n)``: the rank used for a leaf of ``shape``."""
        m, n = self.matrix_shape(shape)
        return min(self.rank, m, n)

    def accepts(self, shape: tuple[int, ...]) -> bool:
        """Compress iff the leaf has >= 2 dims, no zero-size dimension and ``m n >=
        min_compression_rate (m + n) r``."""
        if len(shape) < 2 or 0 in shape:
            return False
        m, n = self.matrix_shape(shape)
        r = min(self.rank, m, n)
        return m * n >= self.min_compression_rate * (m + n) * r

    def groups(self, segments: Sequence[Segment]) -> tuple[_Group, ...]:
        return _make_groups(self, tuple(segments))

    # -------------------------------------------------------------- bytes and metrics

    def _factor_floats(self, segments: Sequence[Segment]) -> tuple[int, int]:
        """Floats of all ``P`` and of all ``Q`` of one step."""
        fp = fq = 0
        for g in self.groups(segments):
            fp += len(g.members) * g.m * g.r
            fq += len(g.members) * g.n * g.r
        return fp, fq

    def phase_bytes(self, segments: Sequence[Segment], num_replicas: int) -> dict[str, float]:
        """Per-device ring bytes of one step in each phase: ``warmup`` (exact fp32 mean of
        the compressed leaves), ``p_step`` and ``q_step`` (the two all-reduces; with
        ``alternating`` a step sends only one of them), ``powersgd`` (their sum)."""
        fp, fq = self._factor_floats(segments)
        size = sum(s.padded_size for s in segments)
        p = ring_bytes("all-reduce", 4 * fp, num_replicas) if fp else 0.0
        q = ring_bytes("all-reduce", 4 * fq, num_replicas) if fq else 0.0
        w = ring_bytes("all-reduce", 4 * size, num_replicas) if size else 0.0
        return {"warmup": w, "p_step": p, "q_step": q, "powersgd": p + q}

    def exchange_bytes(self, segments: Sequence[Segment], num_replicas: int) -> float:
        """Steady-state per-device bytes of one step, after the warm-up: ``P`` plus ``Q``
        (the mean of the two with ``alternating``). See ``phase_bytes`` per phase."""
        if num_replicas <= 1 or not segments:
            return 0.0
        b = self.phase_bytes(segments, num_replicas)
        return b["powersgd"] / 2 if self.alternating else b["powersgd"]

    def compression_rate(self, segments: Sequence[Segment]) -> float:
        """Elements of the compressed leaves per float sent in a PowerSGD step."""
        fp, fq = self._factor_floats(segments)
        sent = (fp + fq) / 2 if self.alternating else fp + fq
        size = sum(s.size for s in segments)
        return float(size / sent) if sent else 1.0

    def local_metrics(self, x: jax.Array, segments: Sequence[Segment]) -> dict[str, jax.Array]:
        """``compression_rate`` (see ``compression_rate``) and ``compressed_leaves``;
        both static, the same in the warm-up."""
        return {
            "compression_rate": jnp.asarray(self.compression_rate(segments), jnp.float32),
            "compressed_leaves": jnp.asarray(len(segments), jnp.float32),
        }

    # -------------------------------------------------------------- maths

    def orth(self, a: jax.Array) -> jax.Array:
        """Orthonormal columns of ``[..., k, r]`` by the configured method."""
        if self.orthogonalization == "qr":
            return jnp.linalg.qr(a, mode="reduced")[0]
        return _gram_schmidt(a, self.epsilon)

    def orth_all(self, mats: Sequence[jax.Array]) -> list[jax.Array]:
        """Orthogonalize every group's ``[G, k, r]`` factors.

        Gram-Schmidt runs once for all groups when zero-padding them to a common
        ``[sum G, max k, max r]`` costs at most twice their size: zero rows change no
        inner product and zero columns stay zero, so the result is the same, and one loop
        compiles instead of one per group. (Householder QR is not padding-invariant for
        rank-deficient inputs, so ``"qr"`` always runs per group.)"""
        mats = list(mats)
        if len(mats) == 1 or self.orthogonalization == "qr":
            return [self.orth(a) for a in mats]
        kmax = max(a.shape[1] for a in mats)
        rmax = max(a.shape[2] for a in mats)
        size = sum(a.size for a in mats)
        if sum(a.shape[0] for a in mats) * kmax * rmax > 2 * size:
            return [self.orth(a) for a in mats]
        padded = jnp.concatenate(
            [jnp.pad(a, ((0, 0), (0, kmax - a.shape[1]), (0, rmax - a.shape[2]))) for a in mats])
        out = self.orth(padded)
        res, pos = [], 0
        for a in mats:
            res.append(out[pos:pos + a.shape[0], :a.shape[1], :a.shape[2]])
            pos += a.shape[0]
        return res

@functools.lru_cache(maxsize=256)
def _make_groups(c: PowerSGD, segments: tuple[Segment, ...]) -> tuple[_Group, ...]:
    """Group the segments by matrix view and rank (first appearance order)."""
    order: list[tuple[int, int, int]] = []
    members: dict[tuple[int, int, int], list[int]] = {}
    groups: list[_Group] = []
    for i, seg in enumerate(segments):
        m, n = c.matrix_shape(seg.shape)
        r = min(c.rank, m, n)
        if not c.batch_same_shape:
            groups.append(_Group(m, n, r, (i,)))
            continue
        k = (m, n, r)
        if k not in members:
            members[k] = []
            order.append(k)
        members[k].append(i)
    if c.batch_same_shape:
        groups = [_Group(*k, tuple(members[k])) for k in order]
    return tuple(groups)


def _normalize_matrix_dims(matrix_dims: Any) -> Any:
    if matrix_dims is None:
        return None
    if isinstance(matrix_dims, bool):
        raise ValueError(
            f"powersgd: `matrix_dims` must be None, an int or a mapping {{ndim: int}}; got {matrix_dims!r}."
        )
    if isinstance(matrix_dims, (int, np.integer)):
        if int(matrix_dims) == 0:
            raise ValueError(
                "powersgd: `matrix_dims` = 0 leaves no dimension for the rows; use a positive "
                "count of leading row dims, or a negative one counted from the end (-1 = default)."
            )
        return int(matrix_dims)
    if isinstance(matrix_dims, Mapping):
        items = []
        for nd, k in sorted(matrix_dims.items()):
            if (isinstance(nd, bool) or not isinstance(nd, (int, np.integer)) or nd < 2
                    or isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k == 0):
                raise ValueError(
                    "powersgd: `matrix_dims` as a mapping must map a number of dims (>= 2) to a "
                    f"non-zero int split; got {{{nd!r}: {k!r}}}."
                )
            items.append((int(nd), int(k)))
        return tuple(items)
    raise ValueError(
        f"powersgd: `matrix_dims` must be None, an int or a mapping {{ndim: int}}; got {matrix_dims!r}."
    )


def powersgd(
    rank: int = 4,
    *,
    start_step: int = 0,
    min_compression_rate: float = 2.0,
    warm_start: bool = True,
    orthogonalization: str = "gram_schmidt",
    epsilon: float = 1e-8,
    seed: int = 0,
    batch_same_shape: bool = True,
    matrix_dims: Union[None, int, Mapping[int, int]] = None,
    alternating: bool = False,
) -> PowerSGD:
    """PowerSGD (Vogels et al., 2019): rank-``rank`` factors ``P``, ``Q`` instead of gradients.

    Use it through the transform, which adds error feedback and the exact bucket::

        tx = optax.chain(cj.compressed_mean(cj.powersgd(4), "data"), optax.sgd(0.1, 0.9))

    Per compressed leaf viewed as an ``m x n`` matrix, one step sends ``(m + n) r`` fp32
    values instead of ``m n`` (rate ``m n / ((m + n) r)``), in two fused all-reduces: all
    ``P = M_bar Q^`` of the step, then all ``Q = M_bar^T P^``; every replica gets
    ``M_hat = P^ Q^T``, the projection of the mean onto ``span(P^)``. Bytes per step and
    device: ``2 (N-1)/N * 4 * sum (m + n) r`` (the module docstring has every phase).

    Options (the DDP hook's ``PowerSGDState`` names in brackets):

    Args:
      rank: ``r`` [``matrix_approximation_rank``]; a leaf uses ``min(r, m, n)``.
      start_step: steps of exact fp32 mean before PowerSGD starts
        [``start_powerSGD_iter``]; no residual builds up during them. The transform's
        step counter decides, so a restored checkpoint resumes in the right phase.
      min_compression_rate: leaves with ``m n / ((m + n) r)`` below it, and 1-D
        leaves, go to the transform's exact bucket [``min_compression_rate``].
      warm_start: reuse the previous step's ``Q`` (kept in the replicated optimizer
        state) [``warm_start``]; ``False`` draws a fresh random ``Q`` every step from a
        key shared by all replicas (the step key of ``compressed_mean``). The initial
        ``Q`` comes from such a key too. Entries are i.i.d. ``U(-sqrt 3, sqrt 3)`` from a
        counter-based hash of the key (cheap to compile; the hook uses ``randn``: any
        continuous distribution starts the power iteration equally well).
      orthogonalization: ``"gram_schmidt"`` (column by column, re-orthogonalized; a
        column that cancels below ``epsilon`` times its input norm becomes exactly zero)
        or ``"qr"`` (``jnp.linalg.qr``, Householder). Factors are fp32 either way.
      epsilon: relative tolerance of Gram-Schmidt [``orthogonalization_epsilon``]; unlike
        the hook's absolute term added to the norm, it is scale-free, so tiny gradients
        are not shrunk, and a zero column gives zeros, not NaN. Warm-started columns
        that died (a zero gradient) are re-drawn from the shared key, so the iteration
        never gets stuck at zero. ``0`` is allowed.
      seed: folded into the shared keys of the initial and fresh ``Q`` [``random_seed``]
        (on top of ``compressed_mean``'s own ``seed``).
      batch_same_shape: stack leaves of the same matrix shape into one batched matmul
        and one orthogonalization [``batch_tensors_with_same_shape``]. Results equal the
        unbatched ones up to fp32 round-off; the wire bytes are the same.
      matrix_dims: how an N-D leaf is viewed as a matrix: ``None`` (last dim = columns,
        the rest rows: ``(h, w, in, out) -> (h w in) x out``), an int ``k`` (the first
        ``k`` dims are rows; negative counts from the end), or a mapping ``{ndim: k}``.
      alternating: one all-reduce per step instead of two, alternating the two halves of
        the power iteration (the variant the paper discusses and the hook leaves as a
        TODO; needs ``warm_start``). With ``s = step - start_step``: even ``s`` sends
        ``P = M_bar Q^`` (``m r`` floats per leaf) and gives ``M_hat = M_bar Q^ Q^^T``
        (projection on the rows' subspace ``Q^``), then stores ``P^ = orth(P)``; odd
        ``s`` sends ``Q = M_bar^T P^`` (``n r`` floats) and gives
        ``M_hat = P^ P^^T M_bar``, then stores ``Q^ = orth(Q)``. Every step's
        ``M_hat`` is an orthogonal projection of the mean, so error feedback stays
        contractive; two steps make one power iteration, at half the bytes per step.

    Returns:
      A [`PowerSGD`][commjax.compressors.powersgd.PowerSGD] compressor; its exchange state is a
      [`PowerSGDState`][commjax.compressors.powersgd.PowerSGDState]
      (replicated), its metrics ``compression_rate`` and ``compressed_leaves``.

    Raises:
      ValueError: an option out of range (the message names it).
    """
    check_positive_int("rank", rank, factory="powersgd")
    if isinstance(start_step, bool) or not isinstance(start_step, (int, np.integer)) or start_step < 0:
        raise ValueError(f"powersgd: `start_step` must be an integer >= 0, got {start_step!r}.")
    if (isinstance(min_compression_rate, bool) or not isinstance(min_compression_rate, (int, float))
            or not math.isfinite(min_compression_rate) or min_compression_rate <= 0):
        raise ValueError(
            f"powersgd: `min_compression_rate` must be a finite number > 0, got {min_compression_rate!r}."
        )
    check_choice("orthogonalization", orthogonalization, ORTHOGONALIZATIONS, factory="powersgd")
    if (isinstance(epsilon, bool) or not isinstance(epsilon, (int, float))
            or not math.isfinite(epsilon) or not 0 <= epsilon < 1):
        raise ValueError(f"powersgd: `epsilon` must be a number in [0, 1), got {epsilon!r}.")
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
        raise ValueError(f"powersgd: `seed` must be an integer, got {seed!r}.")
    for nm, v in (("warm_start", warm_start), ("batch_same_shape", batch_same_shape),
                  ("alternating", alternating)):
        if not isinstance(v, (bool, np.bool_)):
            raise ValueError(f"powersgd: `{nm}` must be True or False, got {v!r}.")
    if alternating and not warm_start:
        raise ValueError(
            "powersgd: `alternating=True` needs `warm_start=True`: each step continues the "
            "power iteration from the factor the previous step stored."
        )
    return PowerSGD(
        rank=int(rank), start_step=int(start_step), min_compression_rate=float(min_compression_rate),
        warm_start=bool(warm_start), orthogonalization=orthogonalization, epsilon=float(epsilon),
        seed=int(seed), batch_same_shape=bool(batch_same_shape),
        matrix_dims=_normalize_matrix_dims(matrix_dims), alternating=bool(alternating),
    )
