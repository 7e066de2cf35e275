"""``ppermute`` with a codec: point-to-point sends (pipeline stages, gossip neighbours)
compressed, differentiable, with delta modes for activations that repeat.

For replica ``d`` of the axis, ``perm`` a list of ``(source, destination)`` pairs (each
replica a source at most once and a destination at most once), ``C`` the codec::

    y_d = C(x_s)    where (s, d) is in perm;   y_d = 0 if d is no destination

as ``jax.lax.ppermute`` (which it is, bit for bit, for ``codec=None`` or
[`commjax.identity`][]). The encoded words of every floating leaf travel in **one**
``collective-permute`` of uint32 words; integer and boolean leaves travel exactly.

Bytes sent per device and call: ``4 * sum_leaves payload_words`` (+ the exact leaves'
bytes): for ``cj.quantize(bits=4)`` at block 256, ``4.125/32`` of the fp32 send;
``cj.powersgd(rank=r)`` sends the two factors of each matrix, ``4 r (m + n)`` bytes for
an ``m x n`` leaf (two subspace iterations from a random start: no state shared
between the two ends).

Differentiation: the VJP sends the cotangent back along the inverse permutation,
encoded with ``grad_codec`` (``None``: exact), so a pipeline's backward sends are
compressed too. Straight-through: the codec's rounding is not differentiated.

**Lazy error propagation** (Optimus-CC) for the backward sends: pass ``grad_residual``
(a pytree like ``x``, usually zeros; the returned one is chained into the next call).
Its forward value passes through unchanged; in the backward pass its cotangent is the
residual ``e`` left by the later send (in backward order), and the send encodes
``y = ct + e`` and hands ``y - C(y)`` on as the cotangent of its own ``grad_residual``::

    y, tok = cc.ppermute(h, "stage", fwd, grad_codec=cj.powersgd(4), grad_residual=tok)

Differentiate the loss with respect to the first token to read the residual left over,
and start the next step's backward with it through
[`inject_residual`][commjax.collectives.permute.inject_residual]. One
residual the size of one send (one microbatch) per stage, carried in the values the
program returns. An exact send (``grad_codec=None``) sends ``ct + e`` exactly and
leaves no residual, so compressing only chosen sends (Optimus-CC's epilogue) is a
choice of ``grad_codec`` per call.

**Delta modes** for activations sent again and again (``delta=``, with ``state`` made
by [`delta_state`][commjax.collectives.permute.delta_state]; the call then returns ``(y,
new_state)``):

* ``"sample"`` (AQ-SGD): sender and receiver keep the same reconstruction ``m[i]`` of
  every training sample ``i``; the sender sends ``C(x - m[ids])`` and both add what it
  decodes to. A sample's first visit goes exact (fp32) and sets ``m``: a flag summed over
  the axis (4 bytes) makes every replica take the exact branch together. Needs
  ``sample_ids`` (``int32[B]``, the rows' sample ids); the receiver's ids travel along
  (``4 B`` bytes) unless ``recv_ids`` is given.
* ``"slot"`` (storage-free, in the spirit of Clapping): one reference per call site,
  the size of one send: ``C(x - m)`` is sent, the receiver reads ``m + decode`` and both
  ends move ``m += delta_rate * decode``. Successive microbatches are different
  samples: with ``delta_rate=1`` the reference is the previous microbatch and the delta
  is the difference of two unrelated samples (larger than either); a small
  ``delta_rate`` makes ``m`` a running mean over the microbatches, and the delta what
  sets this sample apart from it (positions, the common offset of the activations
  removed).

Sender and receiver decode the same words in the same operation (one decode of the
stacked own and received words), so their references stay bit-identical.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, NamedTuple, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from commjax import _compat
from commjax.accounting import ring_bytes
from commjax.compressors.base import BlockCompressor, Compressor
from commjax.compressors.powersgd import PowerSGD
from commjax.collectives._common import _names, _round_up
from commjax.guards import check_bound
from commjax.layout import per_replica

__all__ = ["ppermute", "PermuteDelta", "delta_state", "inject_residual", "check_perm",
           "check_permute_codec", "permute_bytes", "inverse_perm", "DELTA_MODES"]

DELTA_MODES = ("sample", "slot")


# ------------------------------------------------------------------------- arguments


def check_perm(perm: Any, n: int, where: str = "ppermute") -> tuple:
    """``perm`` as a tuple of ``(source, destination)`` int pairs over ``n`` replicas, or a
    clear error when it is not a permutation."""
    try:
        pairs = tuple((int(s), int(d)) for s, d in perm)
    except (TypeError, ValueError):
        raise ValueError(f"{where}: `perm` must be a sequence of (source, destination) index "
                         f"pairs such as [(i, (i + 1) % {n}) for i in range({n})]; got {perm!r}.") from None
    bad = [p for p in pairs if not (0 <= p[0] < n and 0 <= p[1] < n)]
    if bad:
        raise ValueError(f"{where}: `perm` pairs {bad} name replicas outside [0, {n}) (the axis "
                         f"has {n} replicas).")
    for k, what in ((0, "source"), (1, "destination")):
        seen = [p[k] for p in pairs]
        dup = sorted({i for i in seen if seen.count(i) > 1})
        if dup:
            raise ValueError(f"{where}: `perm` is not a permutation: replicas {dup} appear more "
                             f"than once as a {what}. Each replica sends at most once and "
                             "receives at most once per call; send to two neighbours with two "
                             "calls.")
    return pairs


def inverse_perm(perm: Sequence[tuple]) -> tuple:
    """The pairs of ``perm`` reversed: where the cotangents go."""
    return tuple((d, s) for s, d in perm)


def check_permute_codec(codec: Any, where: str = "ppermute", argument: str = "codec") -> Optional[Compressor]:
    """``codec`` if its payload can travel through a point-to-point send, else an error
    that names the argument and the codecs that can."""
    if codec is None:
        return None
    if not isinstance(codec, Compressor):
        raise TypeError(f"{where}: `{argument}` must be a commjax codec such as "
                        f"cj.quantize(bits=8), or None for the exact send; got {codec!r}.")
    if isinstance(codec, PowerSGD):
        return codec
    why = None
    if codec.shared_randomness or codec.has_exchange:
        why = "draws positions from a key that every replica of the axis must share"
    elif codec.fallback is not None:
        why = ("sends a second payload when one overflows, which every replica of the axis "
               "would have to agree on")
    if why is not None:
        raise ValueError(
            f"{where}: {codec.name} cannot travel through a permute: it {why}. Codecs for "
            f"`{argument}`: cj.quantize, cj.hadamard(...), cj.fp8, cj.sign, cj.cast, cj.qsgd, "
            "cj.terngrad, cj.top_k, cj.powersgd (low rank, per send), cj.identity.")
    return codec


def _is_exact(codec: Optional[Compressor]) -> bool:
    return codec is None or (codec.lossless and codec.linear)


def _floating(leaf: Any) -> bool:
    return jnp.issubdtype(jnp.result_type(leaf), jnp.floating)


# ---------------------------------------------------------------- one leaf on the wire


@dataclasses.dataclass(frozen=True)
class _Coder:
    """How one floating leaf of ``shape`` travels as uint32 words with ``codec``."""

    codec: Compressor
    shape: tuple
    start: int  # position of the leaf in the encoded vector (block codecs' noise)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def low_rank(self) -> bool:
        return isinstance(self.codec, PowerSGD)

    @property
    def padded(self) -> int:
        return _round_up(max(self.size, 1), self.codec.alignment)

    @property
    def matrix(self) -> tuple:
        m, n = self.codec.matrix_shape(self.shape)
        return m, n, self.codec.leaf_rank(self.shape)

    @property
    def words(self) -> int:
        if self.low_rank:
            m, n, r = self.matrix
            return (m + n) * r
        return self.codec.payload_words(self.padded)

    def encode(self, value: jax.Array, key: Optional[jax.Array]) -> jax.Array:
        """``uint32[words]`` of one leaf (any float dtype, the leaf's shape)."""
        if self.low_rank:
            return _low_rank_encode(self, value, key)
        flat = jnp.pad(jnp.ravel(value).astype(jnp.float32), (0, self.padded - self.size))
        if isinstance(self.codec, BlockCompressor):
            return self.codec.encode(flat, key, start=self.start)
        return self.codec.encode(flat, key)

    def decode(self, words: jax.Array) -> jax.Array:
        """``uint32[k, words] -> float32[k, *shape]``: each row decoded on its own, in one
        operation (two rows that hold the same words decode to the same bits)."""
        k = words.shape[0]
        if self.low_rank:
            m, n, r = self.matrix
            f = lax.bitcast_convert_type(words, jnp.float32)
            p, q = f[:, :m * r].reshape(k, m, r), f[:, m * r:].reshape(k, n, r)
            return jnp.einsum("kmr,knr->kmn", p, q, precision=lax.Precision.HIGHEST).reshape((k,) + self.shape)
        if isinstance(self.codec, BlockCompressor):
            flat = self.codec.decode(words.reshape(-1), k * self.padded).reshape(k, self.padded)
        else:
            flat = jax.vmap(lambda w: self.codec.decode(w, self.padded))(words)
        return flat[:, :self.size].reshape((k,) + self.shape)


#: Subspace iterations of a low-rank send. With no state shared between the two ends there
#: is no warm start; a second iteration from the random start brought a 2-stage pipeline's
#: held-out gap with rank-4 backward sends from +8.8% to +5.6% (lazy error propagation,
#: benchmarks/model_parallel.py, seed 0), for two more products with the activations.
#: More buy little: over seeds 0-2, four gave +5.99% against +6.35%, and the truncated SVD
#: (the best rank-r subspace) +7.38%.
LOW_RANK_ITERATIONS = 2


def _low_rank_encode(coder: _Coder, value: jax.Array, key: Optional[jax.Array]) -> jax.Array:
    """Subspace iteration from a random start: ``P = orth(M Q)``, ``Q = M^T P``, twice
    (``LOW_RANK_ITERATIONS``); the receiver forms ``P Q^T``, the projection of ``M`` onto
    the span of ``P``."""
    m, n, r = coder.matrix
    mat = value.astype(jnp.float32).reshape(m, n)
    if key is None:
        key = jax.random.key_data(jax.random.PRNGKey(coder.codec.seed))
    q = jax.random.normal(jax.random.wrap_key_data(key) if key.dtype == jnp.uint32 else key,
                          (n, r), jnp.float32)
    for _ in range(LOW_RANK_ITERATIONS):
        p = coder.codec.orth(jnp.dot(mat, q, precision=lax.Precision.HIGHEST))
        q = jnp.dot(mat.T, p, precision=lax.Precision.HIGHEST)
    return lax.bitcast_convert_type(jnp.concatenate([p.reshape(-1), q.reshape(-1)]), jnp.uint32)


def _coders(leaves: Sequence[Any], codec: Optional[Compressor]) -> dict:
    """Leaf index -> ``_Coder`` of each leaf that goes through ``codec`` (the others
    travel exactly: non-floating leaves, and leaves PowerSGD would not shrink)."""
    if _is_exact(codec):
        return {}
    out, start = {}, 0
    for i, leaf in enumerate(leaves):
        shape = tuple(jnp.shape(leaf))
        if not _floating(leaf) or (isinstance(codec, PowerSGD) and not codec.accepts(shape)):
            continue
        coder = _Coder(codec, shape, start)
        out[i] = coder
        start += coder.padded
    return out


def _leaf_key(codec: Optional[Compressor], key: Optional[jax.Array], axis_name: Any, where: str):
    """This replica's encoding key: ``key`` (shared) with the replica index folded in."""
    if codec is None or not (codec.stochastic or isinstance(codec, PowerSGD)):
        return None
    if key is None:
        if isinstance(codec, PowerSGD):
            return None  # the codec's own seed
        raise ValueError(
            f"{where}: {codec.name} rounds stochastically and needs `key=`: pass a PRNG key "
            "that is the same on every replica (the send folds in the replica index), e.g. "
            "jax.random.fold_in(jax.random.key(0), step).")
    if jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        key = jax.random.key_data(key)
    return jax.random.fold_in(key, lax.axis_index(axis_name))


# ------------------------------------------------------------------ the plain send


def _receives(perm: tuple, axis_name: Any, end: int = 1) -> jax.Array:
    """Whether this replica is a destination (``end=1``) or a source (``end=0``) of
    ``perm`` (a replicated table, indexed)."""
    n = _compat.axis_size(axis_name)
    table = np.zeros((n,), bool)
    for pair in perm:
        table[pair[end]] = True
    return jnp.asarray(table)[lax.axis_index(axis_name)]


def _send(leaves: list, coders: dict, axis_name: Any, perm: tuple, key) -> tuple[list, dict]:
    """Send every leaf along ``perm``: the exact ones in one ``lax.ppermute``, the coded ones
    as one buffer of words. Returns ``(received leaves, {index: decoded [2, ...] rows of
    (own, received)})``: own decodes for error feedback and delta references."""
    out = list(leaves)
    exact = [i for i in range(len(leaves)) if i not in coders]
    if exact:
        got = lax.ppermute([_compat.vary(leaves[i], axis_name) for i in exact], axis_name, perm)
        for i, g in zip(exact, got):
            out[i] = g
    rows = {}
    if coders:
        words = [coders[i].encode(leaves[i], key) for i in coders]
        got = lax.ppermute(_compat.vary(jnp.concatenate(words), axis_name), axis_name, perm)
        receives = _receives(perm, axis_name)
        off = 0
        for (i, coder), own in zip(coders.items(), words):
            both = coder.decode(jnp.stack([own, got[off:off + coder.words]]))
            rows[i] = both
            out[i] = jnp.where(receives, both[1], 0.0).astype(jnp.result_type(leaves[i]))
            off += coder.words
    return out, rows


@dataclasses.dataclass(frozen=True)
class _Config:
    axis_name: Any
    perm: tuple
    codec: Optional[Compressor]
    grad_codec: Optional[Compressor]
    delta: Optional[str]
    delta_rate: float = 1.0


def _backward(cfg: _Config, ct: Any, residual: Any, key) -> tuple[Any, Any]:
    """The cotangent sent back along the inverse permutation with ``grad_codec``, plus
    the carried ``residual`` (lazy error propagation); returns ``(ct_x, new residual)``."""
    leaves, treedef = jax.tree_util.tree_flatten(ct)
    res = None if residual is None else jax.tree_util.tree_leaves(residual)
    ys = [l if res is None or not _floating(l) else l + r.astype(l.dtype) for l, r in
          zip(leaves, res if res is not None else leaves)]
    coders = _coders(ys, cfg.grad_codec)
    back = inverse_perm(cfg.perm)
    gkey = _leaf_key(cfg.grad_codec, None if key is None else jax.random.fold_in(key, 1),
                     cfg.axis_name, "ppermute (backward)")
    out, rows = _send(ys, coders, cfg.axis_name, back, gkey)
    if res is None:
        return jax.tree_util.tree_unflatten(treedef, out), None
    sends = _receives(cfg.perm, cfg.axis_name)  # forward destinations send the cotangents
    new = []
    for i, (y, r) in enumerate(zip(ys, res)):
        left = (y - rows[i][0].astype(y.dtype)) if i in rows else jnp.zeros_like(y)
        new.append(jnp.where(sends, left, 0).astype(r.dtype))
    return jax.tree_util.tree_unflatten(treedef, out), jax.tree_util.tree_unflatten(treedef, new)


# --------------------------------------------------------------------- delta modes


def _per_replica(cls):
    """Every field of a delta state is this replica's own (laid out ``P(axis)``)."""
    return per_replica(*cls._fields)(cls)


@_per_replica
class PermuteDelta(NamedTuple):
    """State of one call site of [`ppermute`][commjax.collectives.permute.ppermute] in a delta mode
    ([`delta_state`][commjax.collectives.permute.delta_state]).

    Attributes:
      sent: the reference ``m`` of what this replica sends, float32, per leaf of ``x``:
        ``[num_samples, *row]`` (``"sample"``: one row per training sample) or ``x``'s
        shape (``"slot"``).
      received: the same for what this replica receives (bit-identical to its source's
        ``sent``).
      sent_seen, received_seen: ``bool[num_samples]``, whether a sample has been sent
        (received) once; ``bool[0]`` in ``"slot"`` mode.

    Every leaf is per replica: under ``shard_map`` give it a leading replica axis.
    """

    sent: Any
    received: Any
    sent_seen: jax.Array
    received_seen: jax.Array


def delta_state(x: Any, mode: str = "sample", *, num_samples: Optional[int] = None) -> PermuteDelta:
    """A fresh [`PermuteDelta`][commjax.collectives.permute.PermuteDelta] for sends shaped like
    ``x`` (arrays or
    ``jax.ShapeDtypeStruct``, this replica's local view; in ``"sample"`` mode each leaf's
    leading dimension is the batch). References start at zero, no sample seen.

    Memory: ``"sample"``: ``2 * num_samples * row`` floats per leaf (sender and receiver
    side); ``"slot"``: twice one send.
    """
    if mode not in DELTA_MODES:
        raise ValueError(f"delta_state: `mode` must be one of {DELTA_MODES}; got {mode!r}.")
    leaves, treedef = jax.tree_util.tree_flatten(x)
    if not all(_floating(l) for l in leaves):
        raise ValueError("delta_state: delta modes send floating activations; `x` has an integer "
                         "or boolean leaf. Send those with a plain cc.ppermute.")
    if mode == "slot":
        zeros = [jnp.zeros(jnp.shape(l), jnp.float32) for l in leaves]
        none = jnp.zeros((0,), bool)
        return PermuteDelta(*(jax.tree_util.tree_unflatten(treedef, zeros),) * 2, none, none)
    if num_samples is None or isinstance(num_samples, bool) or int(num_samples) < 1:
        raise ValueError("delta_state: mode='sample' keeps one reference per training sample; pass "
                         f"num_samples=<size of the data set> (a positive int); got {num_samples!r}.")
    if any(not jnp.shape(l) for l in leaves):
        raise ValueError("delta_state: mode='sample' needs leaves with a leading batch dimension.")
    rows = [jnp.zeros((int(num_samples),) + tuple(jnp.shape(l)[1:]), jnp.float32) for l in leaves]
    seen = jnp.zeros((int(num_samples),), bool)
    return PermuteDelta(*(jax.tree_util.tree_unflatten(treedef, rows),) * 2, seen, seen)


def _delta_send(cfg: _Config, leaves: list, m_send: list, m_recv: list, key,
                rate: float = 1.0) -> tuple[list, list, list]:
    """``C(x - m)`` sent. Returns ``(own, received, values)`` per leaf: the new references
    ``m + rate * decode`` of the sender (``m_send``, its own words) and of the receiver
    (``m_recv``, the words it got), formed in one operation each so that the two are the
    same bits, and what the receiver reads, ``m_recv + decode`` (the references
    themselves when ``rate == 1``)."""
    d = [x.astype(jnp.float32) - m for x, m in zip(leaves, m_send)]
    coders = _coders(d, cfg.codec)
    got, rows = _send(d, coders, cfg.axis_name, cfg.perm, key)
    own, recv, values = [], [], []
    for i, (ms, mr) in enumerate(zip(m_send, m_recv)):
        delta = rows[i] if i in rows else jnp.stack([d[i], got[i]])
        refs = jnp.stack([ms, mr])
        both = refs + delta if rate == 1.0 else refs + jnp.float32(rate) * delta
        own.append(both[0])
        recv.append(both[1])
        values.append(both[1] if rate == 1.0 else mr + delta[1])
    return own, recv, values


def _delta_forward(cfg: _Config, leaves: list, state: PermuteDelta, ids, rids, key):
    """The delta modes' forward: ``(y leaves, new state)``."""
    axis, receives = cfg.axis_name, _receives(cfg.perm, cfg.axis_name)
    sent = jax.tree_util.tree_leaves(state.sent)
    received = jax.tree_util.tree_leaves(state.received)
    treedef = jax.tree_util.tree_structure(state.sent)
    if cfg.delta == "slot":
        own, recv, values = _delta_send(cfg, leaves, sent, received, key, cfg.delta_rate)
        new_recv = [jnp.where(receives, r, old) for r, old in zip(recv, received)]
        ys = [jnp.where(receives, v, 0).astype(x.dtype) for v, x in zip(values, leaves)]
        return ys, PermuteDelta(jax.tree_util.tree_unflatten(treedef, own),
                                jax.tree_util.tree_unflatten(treedef, new_recv),
                                state.sent_seen, state.received_seen)
    if rids is None:
        rids = lax.ppermute(_compat.vary(ids, axis), axis, cfg.perm)
    m_send = [s[ids] for s in sent]
    m_recv = [r[rids] for r in received]
    # Only what a source sends decides: a replica that sends nothing (the last pipeline
    # stage) has ids of its own that must not force the others' sends exact.
    fresh = jnp.any(jnp.logical_not(state.sent_seen[ids])) & _receives(cfg.perm, axis, end=0)
    fresh = _compat.psum(fresh.astype(jnp.float32), axis) > 0  # every replica takes the same branch

    def exact():
        got = lax.ppermute([_compat.vary(x.astype(jnp.float32), axis) for x in leaves], axis, cfg.perm)
        return [x.astype(jnp.float32) for x in leaves], list(got)

    own, recv = lax.cond(fresh, exact, lambda: _delta_send(cfg, leaves, m_send, m_recv, key)[:2])
    ys = [jnp.where(receives, r, 0).astype(x.dtype) for r, x in zip(recv, leaves)]
    new_sent = [s.at[ids].set(o) for s, o in zip(sent, own)]
    new_recv = [jnp.where(receives, r.at[rids].set(v), r) for r, v in zip(received, recv)]
    return ys, PermuteDelta(
        jax.tree_util.tree_unflatten(treedef, new_sent), jax.tree_util.tree_unflatten(treedef, new_recv),
        state.sent_seen.at[ids].set(True),
        jnp.where(receives, state.received_seen.at[rids].set(True), state.received_seen))


# ------------------------------------------------------------------ differentiation


def _forward(cfg: _Config, x: Any, aux: tuple, key):
    leaves, treedef = jax.tree_util.tree_flatten(x)
    state, ids, rids = aux
    rkey = _leaf_key(cfg.codec, key, cfg.axis_name, "ppermute")
    if cfg.delta is None:
        out, _ = _send(leaves, _coders(leaves, cfg.codec), cfg.axis_name, cfg.perm, rkey)
        return jax.tree_util.tree_unflatten(treedef, out), state
    ys, new = _delta_forward(cfg, leaves, state, ids, rids, rkey)
    return jax.tree_util.tree_unflatten(treedef, ys), new


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _permute_vjp(cfg: _Config, x, aux, key, token):
    y, state = _forward(cfg, x, aux, key)
    return y, state, token


def _permute_fwd(cfg, x, aux, key, token):
    return _permute_vjp(cfg, x, aux, key, token), key


def _permute_bwd(cfg, key, cts):
    ct_y, _, ct_token = cts
    leaves, treedef = jax.tree_util.tree_flatten(ct_y)
    floats = [i for i, l in enumerate(leaves) if jnp.issubdtype(l.dtype, jnp.floating)]
    res = None if ct_token is None else [jax.tree_util.tree_leaves(ct_token)[i] for i in floats]
    sent, new_res = _backward(cfg, [leaves[i] for i in floats], res, key)
    out = list(leaves)  # float0 cotangents of integer leaves stay as they are
    for i, v in zip(floats, sent):
        out[i] = v
    token_ct = None
    if ct_token is not None:
        tok = list(jax.tree_util.tree_leaves(ct_token))
        for i, v in zip(floats, new_res):
            tok[i] = v
        token_ct = jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(ct_token), tok)
    return jax.tree_util.tree_unflatten(treedef, out), None, None, token_ct


_permute_vjp.defvjp(_permute_fwd, _permute_bwd)


# ---------------------------------------------------------------------- public op


def _check_delta(delta, state, sample_ids, x, where: str) -> None:
    if delta is None:
        if state is not None or sample_ids is not None:
            raise ValueError(f"{where}: `state` and `sample_ids` are for the delta modes; pass "
                             f"delta='sample' or delta='slot' too.")
        return
    if delta not in DELTA_MODES:
        raise ValueError(f"{where}: `delta` must be None, 'sample' (AQ-SGD: a reference per "
                         f"training sample) or 'slot' (one per call site); got {delta!r}.")
    if not isinstance(state, PermuteDelta):
        raise ValueError(f"{where}: delta={delta!r} needs `state`, a PermuteDelta made by "
                         f"cc.delta_state(x, {delta!r}, ...) and returned by the previous call.")
    if not all(_floating(l) for l in jax.tree_util.tree_leaves(x)):
        raise ValueError(f"{where}: delta modes send floating activations; `x` has an integer "
                         "or boolean leaf.")
    if delta == "sample":
        if sample_ids is None:
            raise ValueError(f"{where}: delta='sample' keeps a reference per training sample and "
                             "needs `sample_ids`, int32[batch]: the id of each row of `x` in the "
                             "data set (the same ids on the sender and the receiver).")
        if not jnp.issubdtype(jnp.result_type(sample_ids), jnp.integer) or jnp.ndim(sample_ids) != 1:
            raise ValueError(f"{where}: `sample_ids` must be a 1-D integer array (one id per row).")
        if int(state.sent_seen.shape[0]) == 0:
            raise ValueError(f"{where}: the state was made for delta='slot'; make it with "
                             "cc.delta_state(x, 'sample', num_samples=...).")
    elif int(state.sent_seen.shape[0]) != 0:
        raise ValueError(f"{where}: the state was made for delta='sample'; make it with "
                         "cc.delta_state(x, 'slot').")


def _check_rate(delta, rate, where: str) -> None:
    ok = isinstance(rate, (int, float)) and not isinstance(rate, bool) and 0 < rate <= 1
    if not ok:
        raise ValueError(f"{where}: `delta_rate` must be a number in (0, 1]; got {rate!r}.")
    if rate != 1 and delta != "slot":
        raise ValueError(f"{where}: `delta_rate` is for delta='slot' (a reference shared by every "
                         "sample that passes the slot); delta='sample' keeps each sample's last "
                         f"reconstruction (AQ-SGD) and takes delta_rate=1; got delta={delta!r}.")


def ppermute(
    x: Any,
    axis_name: Any,
    perm: Sequence[tuple],
    codec: Optional[Compressor] = None,
    *,
    grad_codec: Optional[Compressor] = None,
    key: Optional[jax.Array] = None,
    grad_residual: Any = None,
    delta: Optional[str] = None,
    state: Optional[PermuteDelta] = None,
    sample_ids: Optional[jax.Array] = None,
    recv_ids: Optional[jax.Array] = None,
    delta_rate: float = 1.0,
) -> Any:
    """Send ``x`` along ``perm`` over ``axis_name``, encoded with ``codec`` (see the module
    docstring for the maths and the bytes).

    Args:
      x: pytree of arrays (this replica's local values).
      axis_name: the mesh axis (or tuple of axes) bound by ``shard_map``/``pmap``.
      perm: ``(source, destination)`` pairs of replica indices along the axis: a partial
        permutation (every replica at most once a source and once a destination).
      codec: codec of the forward send; ``None`` or ``cj.identity()``: ``lax.ppermute``.
      grad_codec: codec of the VJP's send of the cotangent (inverse permutation).
      key: PRNG key, the same on every replica (stochastic codecs; PowerSGD's start).
      grad_residual: lazy error propagation of the backward send (module docstring): a
        pytree like ``x``; the call then also returns it (unchanged) for the next call.
      delta: ``None``, ``"sample"`` (AQ-SGD) or ``"slot"``: send ``C(x - m)``.
      state: the delta mode's [`PermuteDelta`][commjax.collectives.permute.PermuteDelta]
        ([`delta_state`][commjax.collectives.permute.delta_state]).
      sample_ids: ``int32[batch]``, the sample id of each row of ``x`` (``"sample"``).
      recv_ids: the ids of the rows this replica receives, if it knows them (saves the
        ``4 * batch`` bytes of sending them along).
      delta_rate: ``"slot"`` mode: the reference moves ``delta_rate`` of the way to what
        was received, ``m += delta_rate * decode`` (in ``(0, 1]``; 1: the last send).

    Returns:
      ``y`` (like ``x``); ``(y, new_state)`` with ``delta``; ``(y, grad_residual)`` with
      ``grad_residual``; ``(y, new_state, grad_residual)`` with both.

    Raises:
      ValueError: ``perm`` is not a permutation of the axis' replicas, a codec cannot
        travel through a permute, a delta mode misses its state or ``sample_ids``.
      AxisNotBoundError: ``axis_name`` is not bound here.
    """
    where = "ppermute"
    n = check_bound(axis_name, where)
    pairs = check_perm(perm, n, where)
    codec = check_permute_codec(codec, where)
    grad_codec = check_permute_codec(grad_codec, where, "grad_codec")
    _check_delta(delta, state, sample_ids, x, where)
    _check_rate(delta, delta_rate, where)
    if delta is None and grad_residual is None and _is_exact(codec) and _is_exact(grad_codec):
        return lax.ppermute(_compat.vary(x, axis_name), axis_name, pairs)
    if grad_residual is not None and (jax.tree_util.tree_structure(grad_residual)
                                      != jax.tree_util.tree_structure(x)):
        raise ValueError(f"{where}: `grad_residual` must have the structure of `x` (zeros like "
                         "it to start).")
    cfg = _Config(axis_name, pairs, None if _is_exact(codec) else codec,
                  None if _is_exact(grad_codec) else grad_codec, delta, float(delta_rate))
    x = _compat.vary(x, axis_name)
    aux = (state, None if sample_ids is None else jnp.asarray(sample_ids, jnp.int32),
           None if recv_ids is None else jnp.asarray(recv_ids, jnp.int32))
    y, new_state, token = _permute_vjp(cfg, x, aux, key, grad_residual)
    extra = (() if delta is None else (new_state,)) + (() if grad_residual is None else (token,))
    return (y,) + extra if extra else y


def inject_residual(token: Any, residual: Any) -> jax.Array:
    """A scalar zero (``token`` is zeros) whose gradient with respect to ``token`` is
    ``residual``: add it to the loss to start a backward pass of lazy error propagation
    with the residual the previous step left (``grad_residual`` of
    [`ppermute`][commjax.collectives.permute.ppermute])."""
    terms = [jnp.sum(lax.stop_gradient(r).astype(jnp.float32) * t.astype(jnp.float32))
             for t, r in zip(jax.tree_util.tree_leaves(token), jax.tree_util.tree_leaves(residual))
             if _floating(t)]
    return sum(terms, jnp.zeros((), jnp.float32))


def permute_bytes(x: Any, num_replicas: int, codec: Optional[Compressor] = None, *,
                  delta: Optional[str] = None, carry_ids: bool = True) -> float:
    """Per-device bytes of one [`ppermute`][commjax.collectives.permute.ppermute] of ``x`` (arrays
    or shapes, this replica's
    view) with ``codec``: what the compiled HLO's ``collective-permute`` ops send. In
    ``"sample"`` delta mode: the coded branch (steady state, after every sample's first
    visit), the 4-byte flag's all-reduce and, with ``carry_ids``, the ids."""
    leaves = jax.tree_util.tree_leaves(x)
    if num_replicas <= 1:
        return 0.0
    codec = None if _is_exact(codec) else codec
    coders = _coders(leaves, codec)
    nbytes = lambda l: math.prod(jnp.shape(l)) * jnp.dtype(jnp.result_type(l)).itemsize  # noqa: E731
    if delta is not None:  # the deltas travel in float32
        nbytes = lambda l: math.prod(jnp.shape(l)) * 4  # noqa: E731
    total = sum(float(nbytes(l)) for i, l in enumerate(leaves) if i not in coders)
    total += 4.0 * sum(c.words for c in coders.values())
    if delta == "sample":
        total += ring_bytes("all-reduce", 4, num_replicas)
        if carry_ids and leaves:
            total += 4.0 * int(jnp.shape(leaves[0])[0])
    return total
