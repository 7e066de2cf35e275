"""Test configuration: 8 simulated CPU devices, set before JAX is imported."""
import os

from xla_flags import codegen, compile_flags

# 8 devices, and the flags that make compiling cheaper without changing the HLO (see
# xla_flags.py); the processes the tests start inherit them.
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8 " + compile_flags()
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Twice the devices in threads of XLA's CPU client (inherited by the processes the tests
# start): with one thread per device a collective can wait forever for a device whose
# thread is busy elsewhere (commjax.launch.set_cpu_threads says why).
os.environ.setdefault("PJRT_NPROC", str(max(os.cpu_count() or 1, 16)))
# LLVM's expensive passes off as well (JAX's switch for it; inherited by the processes
# the tests start): 10% off the contract matrix, and again no change to the HLO.
os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")
# Every program the tests run runs on the CPU: trace only the CPU branch of commjax's
# per-platform code (commjax._compat.platform_dependent; inherited by the processes the
# tests start). About 40% off a small step's time to first result, and the compiled CPU
# program is the same. Tests that lower for TPU or CUDA set the option to that platform;
# tests/test_platforms.py traces the other branches.
os.environ.setdefault("COMMJAX_TRACE_PLATFORM", "cpu")

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


#: Test files that take longest, started first: with ``-n 2 --dist loadfile`` (make test)
#: the two workers then finish together instead of one waiting on the last long file.
SLOW_FIRST = (
    "test_contract.py", "test_examples.py", "test_multiprocess_compressors.py",
    "test_streaming_diloco_multiprocess.py", "test_zero_multiprocess.py", "test_streaming_diloco.py",
    "test_compressed_mean.py", "test_kernels.py", "test_powersgd.py", "test_zero.py",
    "test_launch.py", "test_onebit.py", "test_checkpoint.py", "test_sparse.py",
    "test_collectives.py", "test_step.py", "test_reduce_parts.py",
)


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "exact_codegen: compares the bits of two different compiled programs, or bits "
        "XLA's older CPU emitters do not keep; runs "
        "only with XLA's default code generation (deselected under COMMJAX_TEST_CODEGEN=fast, "
        "see tests/xla_flags.py)")


def pytest_collection_modifyitems(session, config, items):
    if codegen() == "fast":
        marked = {id(i) for i in items if i.get_closest_marker("exact_codegen") is not None}
        if marked:
            config.hook.pytest_deselected(items=[i for i in items if id(i) in marked])
            items[:] = [i for i in items if id(i) not in marked]
    rank = {name: i for i, name in enumerate(SLOW_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))
