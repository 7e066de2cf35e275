"""Convergence at equal steps on a non-i.i.d. task, against the exact mean.

Targets (relative gap of the final global loss to the exact fp32 mean under the same
optimizer): 8-bit and bf16 within 2%, 4-bit and QSGD within 4%, TernGrad within 25%
(SGD + momentum after the transform); sign with error feedback under plain SGD within 5%.
"""

import optax
import pytest

import commjax as cj
from commjax.testing import noniid_classification, train

STEPS = 300


@pytest.fixture(scope="module")
def task():
    return noniid_classification(8)


def _run(task, comp, opt, **kw):
    tx = optax.chain(cj.compressed_mean(comp, "data", min_compress_size=256, **kw), opt)
    res = train(tx, task, STEPS, log_every=STEPS)
    assert res.replicas_identical
    return res.final_loss


@pytest.fixture(scope="module")
def exact_momentum(task):
    return _run(task, cj.identity(), optax.sgd(0.1, momentum=0.9))


@pytest.mark.parametrize(
    "comp,tol",
    [(cj.quantize(8), 0.02), (cj.cast(), 0.02), (cj.quantize(4), 0.04), (cj.qsgd(), 0.04),
     (cj.terngrad(), 0.25)],
    ids=["q8", "bf16", "q4", "qsgd", "terngrad"],
)
def test_momentum_sgd_gap(task, exact_momentum, comp, tol):
    loss = _run(task, comp, optax.sgd(0.1, momentum=0.9))
    gap = (loss - exact_momentum) / exact_momentum
    assert gap <= tol, f"gap {gap:.2%} > {tol:.0%}"
    # It trained: far below the initial loss.
    assert loss < 0.6 * task.global_loss(task.params)


def test_sign_with_error_feedback_plain_sgd(task):
    exact = _run(task, cj.identity(), optax.sgd(0.3))
    ef = _run(task, cj.sign(), optax.sgd(0.3))
    no_ef = _run(task, cj.sign(), optax.sgd(0.3), error_feedback=False)
    assert (ef - exact) / exact <= 0.05
    # Error feedback is what makes sign compression work.
    assert ef < no_ef
