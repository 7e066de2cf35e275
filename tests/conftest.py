"""Test configuration: 8 simulated CPU devices, set before JAX is imported."""
import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import pytest  # noqa: E402

#: Replicas of the default test mesh (one per forced CPU device).
NUM_DEVICES = 8


@pytest.fixture(scope="module")
def mesh():
    """The 8-device mesh with one axis ``"data"``; a test module may define its own."""
    import jax

    from commjax import _compat

    assert jax.device_count() >= NUM_DEVICES, "tests need 8 forced CPU devices (see conftest.py)"
    return _compat.make_mesh((NUM_DEVICES,), ("data",))
