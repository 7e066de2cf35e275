"""Bytes on the wire of each codec and reducer, from the plan (equal to the compiled HLO's:
tests/test_contract.py)."""

import jax
import jax.numpy as jnp
import pytest

import commjax as cj
from commjax.testing import mlp_4m_params, update_collectives

PARAMS = mlp_4m_params()

# compressor, minimum ratio against the exact fp32 mean (per device, 8 replicas)
TARGETS = {
    "cast": (cj.cast(), 1.9),
    "q8": (cj.quantize(8), 3.5),
    "q4": (cj.quantize(4), 6.5),
    "q2": (cj.quantize(2), 12.0),
    "terngrad": (cj.terngrad(), 12.0),
    "sign": (cj.sign(), 20.0),
    "qsgd": (cj.qsgd(), 4.0),
}


@pytest.mark.parametrize("name", sorted(TARGETS))
def test_each_codec_meets_its_ratio(name):
    """Per device on 8 replicas, against the exact fp32 mean of the same tree (the compiled
    step sends the plan, in uint32 words: tests/test_contract.py)."""
    comp, target = TARGETS[name]
    plan = cj.communication_plan(comp, PARAMS, 8)
    assert plan.compression_ratio >= target, f"{name}: {plan.compression_ratio:.2f}x < {target}x"


def _bytes(comp, reducer, n_rep):
    return cj.communication_plan(comp, PARAMS, n_rep, reducer=reducer).bytes_per_step


def test_two_phase_bytes_flat_in_replicas_allgather_grows():
    comp = cj.quantize(4)
    tp2, tp8 = _bytes(comp, "two_phase", 2), _bytes(comp, "two_phase", 8)
    ag2, ag8 = _bytes(comp, "allgather", 2), _bytes(comp, "allgather", 8)
    assert tp8 / tp2 <= 2.0  # only the ring factor 2(N-1)/N grows
    assert ag8 / ag2 >= 6.0  # (N-1) * payload
    assert tp8 < ag8


def test_auto_picks_the_cheapest_valid_reducer():
    for comp, _ in TARGETS.values():
        for n in (2, 4, 8):
            plan = cj.communication_plan(comp, PARAMS, n)
            for r in ("allreduce", "allgather", "two_phase"):
                try:
                    other = cj.communication_plan(comp, PARAMS, n, reducer=r)
                except ValueError:
                    continue
                assert plan.bytes_per_step <= other.bytes_per_step + 1e-6
    assert cj.communication_plan(cj.identity(), PARAMS, 8).routing.reducer == "allreduce"
    assert cj.communication_plan(cj.quantize(4), PARAMS, 8).routing.reducer == "two_phase"


def test_exact_mean_is_one_all_reduce_of_the_leaves_themselves():
    """The identity keeps no residual and sends every leaf, uncopied, as an operand of the
    exact bucket's all-reduce: one collective in all."""
    tx = cj.compressed_mean(cj.identity(), "data")
    assert tx.init(jax.tree_util.tree_map(lambda s: jnp.zeros(s.shape), PARAMS)).residual == ()
    rep = update_collectives(tx, PARAMS, 8)
    assert len(rep.collectives) == 1 and rep.collectives[0].kind == "all-reduce", rep.table()
    # The exact bucket (biases and NaN flags) and each of the four weight matrices.
    assert rep.collectives[0].dtypes == ("f32",) * 5
