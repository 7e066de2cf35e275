"""DeMo (``cj.decoupled_momentum``): the DCT, the whole step against a float64 NumPy
reference, error feedback, bit-identical replicas, NaN handling, HLO bytes, bad input."""

from __future__ import annotations

import importlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import commjax as cj
from commjax import _compat
from commjax.testing import ready, update_collectives

# The module (the package attribute of the same name is the factory function).
dm = importlib.import_module("commjax.optimizers.decoupled_momentum")

N = 8
AX = "data"
C, K = 8, 5
BETA, WD = 0.9, 0.1
LR = optax.linear_schedule(0.1, 0.05, 4)

# A tile-aligned matrix, a matrix whose columns need padding, a rank-3 leaf viewed as a
# (24, 8) matrix, a 1-D leaf with a padded last chunk, and an integer leaf (no update).
SHAPES = {"a": (16, 16), "w": (16, 12), "t": (3, 8, 8), "b": (10,)}


def _params():
    out = {k: np.random.default_rng(i).normal(size=s).astype(np.float32)
           for i, (k, s) in enumerate(sorted(SHAPES.items()))}
    out["n"] = np.arange(3, dtype=np.int32)
    return out


def _grads(step, shapes=SHAPES, nan_at=None):
    out = {}
    for i, (k, s) in enumerate(sorted(shapes.items())):
        rng = np.random.default_rng([step, i])
        out[k] = (rng.normal(size=(N,) + s) + np.arange(N).reshape((N,) + (1,) * len(s)) * 0.3
                  ).astype(np.float32)
    if nan_at is not None:
        out["w"][nan_at, 2, 3] = np.nan
    out["n"] = np.zeros((N, 3), np.int32)
    return out


# ------------------------------------------------------------------ NumPy reference


def _ref_chunks(x, c):
    """Zero-padded chunks of a leaf in the order the docstring gives: ``[chunks, c, c]``
    tiles in row-major tile order for rank >= 2, ``[chunks, c]`` otherwise."""
    if x.ndim < 2:
        flat = np.zeros(-(-max(x.size, 1) // c) * c)
        flat[:x.size] = x.ravel()
        return flat.reshape(-1, c)
    m = x.reshape(-1, x.shape[-1])
    pad = np.zeros((-(-m.shape[0] // c) * c, -(-m.shape[1] // c) * c))
    pad[:m.shape[0], :m.shape[1]] = m
    return np.stack([pad[i:i + c, j:j + c] for i in range(0, pad.shape[0], c)
                     for j in range(0, pad.shape[1], c)])


def _ref_unchunk(chunks, shape, c):
    if len(shape) < 2:
        return chunks.reshape(-1)[:int(np.prod(shape))].reshape(shape)
    rows, cols = int(np.prod(shape[:-1])), shape[-1]
    tr, tc = -(-rows // c), -(-cols // c)
    pad = np.zeros((tr * c, tc * c))
    for t, tile in enumerate(chunks):
        i, j = divmod(t, tc)
        pad[i * c:(i + 1) * c, j * c:(j + 1) * c] = tile
    return pad[:rows, :cols].reshape(shape)


def _basis(c):
    n = np.arange(c)
    b = np.sqrt(2.0 / c) * np.cos(np.pi * (2 * n[None] + 1) * n[:, None] / (2 * c))
    b[0] /= np.sqrt(2.0)
    return b


def _ref_dct(chunks, inverse=False):
    b = _basis(chunks.shape[-1])
    b = b.T if inverse else b
    if chunks.ndim == 3:
        return np.einsum("ij,tjk,lk->til", b, chunks, b)
    return np.einsum("ij,tj->ti", b, chunks)


def _ref_keep(coeff, k):
    """The ``k`` largest coefficients of each chunk by magnitude, others zero."""
    flat = coeff.reshape(len(coeff), -1)
    kept = np.zeros_like(flat)
    top = np.argsort(-np.abs(flat), axis=1, kind="stable")[:, :k]
    np.put_along_axis(kept, top, np.take_along_axis(flat, top, 1), 1)
    return kept.reshape(coeff.shape)


def _ref_step(m, g, params, count, k):
    """One DeMo step in float64 for all replicas: ``(updates, new momentum, Q)``."""
    upd, new_m, qs = {}, {}, {}
    for key in SHAPES:
        kept = []
        for r in range(N):
            mr = BETA * m[key][r] + g[key][r]
            kr = _ref_keep(_ref_dct(_ref_chunks(mr, C)), k)
            kept.append(kr)
            m[key][r] = mr - _ref_unchunk(_ref_dct(kr, inverse=True), mr.shape, C)
        q = _ref_unchunk(_ref_dct(np.mean(kept, 0), inverse=True), SHAPES[key], C)
        qs[key] = q
        upd[key] = -float(LR(count)) * (np.sign(q) + WD * params[key])
    return upd, m, qs


# ------------------------------------------------------------------------ compiled step


def _placed(mesh, tree, spec):
    return jax.device_put(tree, NamedSharding(mesh, spec))


def _stepper(mesh, tx, params):
    """A compiled step: replicated params, per-replica gradients in; per-replica updates
    (to compare replicas) and the state out (``check_vma=True``)."""
    state = cj.init_sharded(tx, params, mesh, AX)
    specs = cj.state_specs(state, AX)

    def step(p, s, g):
        u, s = tx.update(jax.tree_util.tree_map(lambda a: a[0], g), s, p)
        return jax.tree_util.tree_map(lambda a: a[None], u), s

    f = jax.jit(_compat.shard_map(step, mesh=mesh, in_specs=(P(), specs, P(AX)),
                                  out_specs=(P(AX), specs)))
    return f, state


@pytest.fixture(scope="module")
def demo(mesh):
    tx = cj.decoupled_momentum(LR, beta=BETA, chunk_size=C, top_k=K, weight_decay=WD, values_dtype=jnp.float32)
    return _stepper(mesh, tx, _params())


def _identical(tree) -> bool:
    return all(bool(np.all(np.asarray(l) == np.asarray(l)[:1]))
               for l in jax.tree_util.tree_leaves(tree))


def _momentum(state):
    """Per-replica momentum ``{key: [N, *shape]}`` from the flat global state."""
    flat = np.asarray(state.momentum).reshape(N, -1)
    out, off = {}, 0
    for key in sorted(SHAPES):  # the tree order of the floating leaves
        size = int(np.prod(SHAPES[key]))
        out[key] = flat[:, off:off + size].reshape((N,) + SHAPES[key])
        off += size
    assert off == flat.shape[1]
    return out


# ----------------------------------------------------------------------------- tests


def test_dct_matrix_orthonormal_and_round_trip():
    fft = pytest.importorskip("scipy.fft")
    for c in (1, 5, 8, 64):
        b = dm.dct_matrix(c)
        np.testing.assert_allclose(b @ b.T, np.eye(c), atol=1e-12)
        x = np.random.default_rng(c).normal(size=c)
        np.testing.assert_allclose(b @ x, fft.dct(x, norm="ortho"), atol=1e-12)
    assert dm.dct_matrix(8) is dm.dct_matrix(8)  # computed once per size
    # Chunk, DCT, inverse DCT, unchunk: every leaf comes back (padding dropped) in fp32.
    cfg = dm._Config(0.1, 0.9, C, K, None, 0.0, jnp.float32)
    b = dm._basis(C)
    for it in dm._layout([jnp.zeros(s) for s in SHAPES.values()], cfg, "test"):
        x = jnp.asarray(np.random.default_rng(it.size).normal(size=it.size), jnp.float32)
        coeff = dm._dct(dm._to_chunks(x, it, C), b)
        back = dm._from_chunks(dm._idct(coeff, it.tiled, b), it, C)
        np.testing.assert_allclose(back, x, atol=1e-6)
        np.testing.assert_allclose(coeff.reshape(_ref_chunks(np.asarray(x).reshape(it.shape), C).shape),
                                   _ref_dct(_ref_chunks(np.asarray(x).reshape(it.shape), C)), atol=1e-5)


def test_steps_match_numpy_reference_and_replicas_identical(mesh, demo):
    f, state = demo
    params = _params()
    m = {k: np.zeros((N,) + s) for k, s in SHAPES.items()}
    for t in range(3):
        g = _grads(t)
        u, state = ready(*f(_placed(mesh, params, P()), state, _placed(mesh, g, P(AX))))
        assert _identical(u), f"step {t}: replicas' updates differ"
        ref_u, m, q = _ref_step(m, {k: g[k].astype(np.float64) for k in SHAPES}, params, t, K)
        got_m = _momentum(state)
        for key in SHAPES:
            np.testing.assert_allclose(got_m[key], m[key], atol=2e-5, err_msg=f"momentum {key}, step {t}")
            clear = np.abs(q[key]) > 1e-4  # sign decided beyond fp32 rounding
            assert clear.mean() > 0.95
            np.testing.assert_allclose(np.asarray(u[key])[0][clear], ref_u[key][clear], rtol=1e-6,
                                       err_msg=f"update {key}, step {t}")
        assert np.all(np.asarray(u["n"]) == 0)
        assert int(np.asarray(state.count)) == t + 1


def test_error_feedback_removes_exactly_the_sent_coefficients(mesh, demo):
    """``m_after + sent == beta m + g``: in the DCT domain the new momentum is the old one
    with the ``top_k`` largest coefficients of each chunk set to zero, the rest unchanged
    (on leaves without padding: the part of ``sent`` that lands on padding is dropped,
    which the reference test covers)."""
    f, state = demo
    g = _grads(7)
    _, new = ready(*f(_placed(mesh, _params(), P()), state, _placed(mesh, g, P(AX))))
    after = _momentum(new)
    for key in ("a", "t"):
        for r in (0, 5):
            before = _ref_dct(_ref_chunks(g[key][r].astype(np.float64), C))  # m0 = 0
            coeff = _ref_dct(_ref_chunks(after[key][r].astype(np.float64), C))
            sent = _ref_keep(before, K) != 0
            assert sent.reshape(len(sent), -1).sum(1).tolist() == [K] * len(sent)
            np.testing.assert_allclose(coeff[sent], 0.0, atol=1e-5)
            np.testing.assert_allclose(coeff[~sent], before[~sent], atol=1e-5)


def test_everything_kept_is_the_sign_of_the_exact_mean(mesh):
    """With ``top_k = chunk_size**2`` nothing stays behind: the momentum is empty after
    each step and DeMo is signSGD on the exact mean gradient."""
    shapes = {"a": (16, 16), "w": (16, 12)}
    tx = cj.decoupled_momentum(0.5, beta=BETA, chunk_size=4, top_k=16, values_dtype=jnp.float32)
    f, state = _stepper(mesh, tx, {k: np.zeros(s, np.float32) for k, s in shapes.items()})
    for t in range(2):
        g = {k: v for k, v in _grads(t, shapes).items() if k in shapes}
        u, state = ready(*f(_placed(mesh, {k: np.zeros(s, np.float32) for k, s in shapes.items()}, P()),
                            state, _placed(mesh, g, P(AX))))
        assert _identical(u)
        np.testing.assert_allclose(np.asarray(state.momentum), 0.0, atol=1e-5)
        for key in shapes:
            mean = g[key].astype(np.float64).mean(0)
            clear = np.abs(mean) > 1e-4
            np.testing.assert_array_equal(np.asarray(u[key])[0][clear], -0.5 * np.sign(mean[clear]))


def test_nan_on_one_replica_nans_every_leaf(mesh, demo):
    """One replica's NaN in one leaf: every leaf's update is NaN (the shared decode of all
    coefficients is non-finite); the kept state and the other checks: tests/test_contract.py."""
    f, state = demo
    params = _placed(mesh, _params(), P())
    u_bad, _ = ready(*f(params, state, _placed(mesh, _grads(1, nan_at=3), P(AX))))
    for key in SHAPES:
        assert np.all(np.isnan(np.asarray(u_bad[key]))), key


def test_bf16_values_travel_as_u32_words_in_one_all_gather():
    params = {k: jax.ShapeDtypeStruct(s, jnp.float32) for k, s in SHAPES.items()}
    tx = cj.decoupled_momentum(0.1, chunk_size=C, top_k=K, values_dtype=jnp.bfloat16)
    rep = update_collectives(tx, params, N)
    assert rep.total_ring_bytes == cj.communication_plan(tx, params, N).compiled_bytes, rep.table()
    assert [c.kind for c in rep.collectives] == ["all-gather"] and rep.dtypes == {"u32"}


@pytest.mark.parametrize("values_dtype,n_rep", [(jnp.float32, 8), (jnp.bfloat16, 8), (jnp.float32, 2)])
def test_the_plan_counts_the_payload_words(values_dtype, n_rep):
    params = {k: jax.ShapeDtypeStruct(s, jnp.float32) for k, s in SHAPES.items()}
    tx = cj.decoupled_momentum(0.1, chunk_size=C, top_k=K, values_dtype=values_dtype)
    plan = cj.communication_plan(tx, params, n_rep).compiled_bytes
    # Analytic count by hand: tiles a 4, w 4, t 3 -> 11; 1-D chunks b 2; K coefficients
    # each; each group's uint16 indices padded to whole words, then fp32 or bf16 values.
    sent = [11 * K, 2 * K]
    value_words = sum(sent) if values_dtype == jnp.float32 else sum(-(-s // 2) for s in sent)
    words = sum(-(-s // 2) for s in sent) + value_words
    assert plan == (n_rep - 1) * 4 * words


def test_payload_ratio_of_a_full_tile():
    """A 64 x 64 tile with the default 48 bf16 coefficients sends 48 * (2 + 2) bytes, as 32
    fp32 ones do (32 * (4 + 2)): 85x below fp32."""
    params = {"w": jax.ShapeDtypeStruct((256, 128), jnp.float32)}
    payload = cj.communication_plan(cj.decoupled_momentum(0.1), params, 2).bytes_per_step
    fp32 = cj.communication_plan(cj.decoupled_momentum(0.1, top_k=32, values_dtype=jnp.float32), params, 2)
    assert payload == 8 * 48 * 4 == fp32.bytes_per_step == 8 * 32 * 6
    assert 256 * 128 * 4 / payload == pytest.approx(4096 * 4 / 192)


@pytest.mark.parametrize("kwargs,match", [
    (dict(chunk_size=0), "`chunk_size` must be an integer >= 1"),
    (dict(chunk_size=-4), "`chunk_size` must be an integer >= 1"),
    (dict(chunk_size=512), "`chunk_size` must be an integer >= 1 and <= 256"),
    (dict(chunk_size=8.0), "`chunk_size`"),
    (dict(chunk_size=4, top_k=17), "`top_k`=17 is more than the chunk_size"),
    (dict(top_k=0), "`top_k` must be a positive integer"),
    (dict(top_k=-1), "`top_k` must be a positive integer"),
    (dict(beta=1.0), r"`beta` must be a number in \[0.0, 1.0\)"),
    (dict(beta=-0.1), "`beta`"),
    (dict(weight_decay=-1.0), "`weight_decay`"),
    (dict(values_dtype=jnp.float16), "`values_dtype`"),
    (dict(axis_name=3), "`axis_name`"),
])
def test_bad_options_name_the_argument(kwargs, match):
    with pytest.raises(ValueError, match=match):
        cj.decoupled_momentum(0.1, **kwargs)


def test_top_k_larger_than_a_1d_chunk_names_the_leaf():
    tx = cj.decoupled_momentum(0.1, chunk_size=4, top_k=9)
    tx.init({"w": jnp.zeros((8, 8))})  # a 4 x 4 tile holds 16 coefficients: fine
    with pytest.raises(ValueError, match=r"more than the 4 entries of a chunk of the leaf of shape \(10,\)"):
        tx.init({"w": jnp.zeros((8, 8)), "b": jnp.zeros((10,))})


def test_missing_params_and_a_state_for_other_shapes():
    p = {"w": jnp.zeros((8, 8))}
    local = cj.decoupled_momentum(0.1, chunk_size=C, top_k=K, axis_name=None, weight_decay=0.1,
                                   values_dtype=jnp.float32)
    with pytest.raises(ValueError, match="weight_decay needs the parameters"):
        local.update(p, local.init(p))
    with pytest.raises(ValueError, match="state's momentum has shape"):
        local.update(p, local.init({"w": jnp.zeros((4, 4))}), p)


def test_one_replica_is_signum_of_the_transmitted_momentum():
    """``axis_name=None``: no collective; the step is the sign of what was sent, and the
    momentum keeps the rest."""
    tx = cj.decoupled_momentum(0.1, beta=0.5, chunk_size=4, top_k=16, axis_name=None,
                                values_dtype=jnp.float32)
    g = {"w": jnp.asarray(np.random.default_rng(0).normal(size=(8, 8)), jnp.float32)}
    u, s = jax.jit(tx.update)(g, tx.init(g))
    np.testing.assert_array_equal(np.asarray(u["w"]), -0.1 * np.sign(np.asarray(g["w"])))
    np.testing.assert_allclose(np.asarray(s.momentum), 0.0, atol=1e-6)


def test_an_empty_leaf_changes_nothing_and_gets_an_empty_update(mesh):
    """An empty float leaf beside a matrix: the matrix's trajectory is the one without
    it, bit for bit, and the empty leaf's update is empty and replicated (its chunk
    layout divided by its zero-size last axis, and its ``zeros_like`` update varied over
    the replicas where replicated parameters need it replicated)."""
    w = jnp.asarray(np.random.default_rng(3).normal(size=(16, 12)), jnp.float32)
    tx = cj.decoupled_momentum(0.1, chunk_size=C, top_k=K, values_dtype=jnp.float32)

    def loss(p, batch):
        return jnp.sum(jnp.square(p["w"] - jnp.mean(batch))) + sum(jnp.sum(v) for k, v in p.items() if k != "w")

    def run(params):
        dp = cj.data_parallel(loss, tx, mesh)
        state = dp.init(params)
        for _ in range(3):
            state, _ = dp.step(state, jnp.arange(N * 2, dtype=jnp.float32).reshape(N, 2))
        return state.params

    with_empty = run({"w": w, "z": jnp.zeros((4, 0)), "e": jnp.zeros((0,))})
    alone = run({"w": w})
    assert with_empty["z"].shape == (4, 0) and with_empty["e"].shape == (0,)
    np.testing.assert_array_equal(np.asarray(with_empty["w"]), np.asarray(alone["w"]))
    assert not np.array_equal(np.asarray(alone["w"]), np.asarray(w))
