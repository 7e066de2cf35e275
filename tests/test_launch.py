"""Multi-process support: commjax.launch, commjax.distributed and the test harness.

The multi-process tests start real JAX processes joined by ``jax.distributed`` (gloo
CPU collectives over loopback TCP). Each JAX process costs ~1-2 s to start, so the
file starts as few as possible: 2+4 (collectives), 3+3 (dead process), plus a few
interpreter-only processes for the CLI.
"""

from __future__ import annotations

import fcntl
import inspect
import os
import re
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from commjax import distributed as cd
from commjax import launch as cl
from multiprocess import MP_SCRIPTS, leftover_processes, load_script, run_workers

REPO = Path(__file__).resolve().parent.parent
#: Bound on how long a job with a dead process may take to end, launcher or not.
DEAD_PROCESS_BOUND_S = 60.0


def _ipv4_of(interface: str) -> str | None:
    """IPv4 address of ``interface`` (SIOCGIFADDR), or None."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            packed = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", interface[:15].encode()))
        except OSError:
            return None
    return socket.inet_ntoa(packed[20:24])


def _pick_interface() -> tuple[str, str]:
    """A non-loopback interface with an IPv4 address if there is one (so pinning is
    visible: gloo's default here is the hostname's address), else ``lo``."""
    for _, name in socket.if_nameindex():
        ip = _ipv4_of(name)
        if name != "lo" and ip and not ip.startswith("127."):
            return name, ip
    return "lo", "127.0.0.1"


# --------------------------------------------------------------------------- collectives


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "processes,devices,pin_interface",
    [(2, 2, True), (4, 2, False)],
    ids=["2x2-interface", "4x2"],
)
def test_collectives_across_processes(processes, devices, pin_interface):
    worker = load_script("collectives")
    interface, ip = _pick_interface() if pin_interface else (None, None)
    run = run_workers("collectives.py", processes, devices, interface=interface, check=True)
    g = processes * devices
    want = worker.expected(g)
    first = run.results[0]
    for pid, res in enumerate(run.results):
        assert res["process_id"] == pid
        assert (res["num_processes"], res["local_devices"], res["global_devices"]) == (
            processes, devices, g)
        np.testing.assert_allclose(np.asarray(res["values"]["psum"], np.float32), want["psum"],
                                   rtol=0, atol=1e-5)
        for name in ("all_gather", "all_to_all"):
            assert res["dtypes"][name] == "uint8"
            np.testing.assert_array_equal(np.asarray(res["values"][name], np.uint8), want[name],
                                          err_msg=f"{name} bytes wrong on process {pid}")
        # Identical on every process, bit for bit.
        assert res["digests"] == first["digests"], f"process {pid} differs from process 0"
        assert res["reduce_scatter_in_hlo"] is False
        if interface is not None:
            hosts = {a.rsplit(":", 1)[0] for a in res["gloo_listen"]}
            assert hosts == {ip}, (
                f"gloo should listen on {interface} ({ip}) only, got {res['gloo_listen']}")
    assert not leftover_processes(run.launch.pids)


# ------------------------------------------------------------------------ dead process


def _assert_all_gone(run) -> None:
    assert not leftover_processes(run.launch.pids), "child processes left running"


@pytest.mark.multiprocess
def test_dead_process_launcher_stops_the_others():
    t0 = time.monotonic()
    run = run_workers("dead_peer.py", 3, 2, args=["--die", "1"], timeout=DEAD_PROCESS_BOUND_S)
    wall = time.monotonic() - t0
    res = run.launch
    assert wall < DEAD_PROCESS_BOUND_S, run.report()
    assert not res.timed_out, run.report()
    assert res.failed_process == 1, run.report()
    assert res.returncodes[1] == 3
    assert res.returncode == 3
    assert "dying with os._exit(3)" in res.stdout[1]
    for pid in (0, 2):
        assert res.returncodes[pid] != 0, run.report()
    assert res.terminated == [0, 2]
    assert "process 1 exited with code 3" in res.describe()
    _assert_all_gone(run)


@pytest.mark.multiprocess
def test_dead_process_survivors_fail_on_their_own():
    """Without the launcher's help (kill_on_failure=False) the survivors must still end
    non-zero with a clear error: gloo sees the closed socket at once, and the
    coordination service declares the dead process gone after the heartbeat time-out
    and aborts the others."""
    heartbeat = 5
    run = run_workers(
        "dead_peer.py", 3, 2, args=["--die", "1"], timeout=DEAD_PROCESS_BOUND_S,
        kill_on_failure=False,
        env={cd.ENV_HEARTBEAT_TIMEOUT: str(heartbeat), cd.ENV_SHUTDOWN_TIMEOUT: str(heartbeat)},
    )
    res = run.launch
    assert not res.timed_out, f"survivors hung\n{run.report()}"
    assert res.elapsed < DEAD_PROCESS_BOUND_S
    assert res.returncodes[1] == 3
    assert res.terminated == []
    clear = re.compile(r"Connection closed by peer|heartbeat timeout|another task died|"
                       r"stopped sending heartbeats")
    for pid in (0, 2):
        assert res.returncodes[pid] != 0, run.report()
        assert clear.search(res.output(pid)), f"no clear error on process {pid}\n{run.report()}"
    _assert_all_gone(run)


# -------------------------------------------------------------------------------- CLI


def _cli(*argv: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "commjax.launch", *argv], cwd=REPO,
                          capture_output=True, text=True, timeout=timeout)


def _cli_in_process(capsys, *argv: str) -> tuple[int, str, str]:
    """``commjax.launch.main(argv)`` in this process, for what fails or ends before any
    process starts (the parser): each ``python -m commjax.launch`` first pays for
    importing JAX. The entry point itself runs in the tests below."""
    with pytest.raises(SystemExit) as exit_:
        cl.main(list(argv))
    out = capsys.readouterr()
    return exit_.value.code, out.out, out.err


def test_cli_help(capsys):
    code, out, _ = _cli_in_process(capsys, "--help")
    assert code == 0
    for word in ("--processes", "--devices-per-process", "--timeout", "--interface",
                 "COMMJAX_COORDINATOR"):
        assert word in out


@pytest.mark.multiprocess
def test_cli_failing_script_exit_code_propagates(tmp_path):
    t0 = time.monotonic()
    out = _cli("--processes", "3", "--grace", "1", str(MP_SCRIPTS / "exit_code.py"),
               "--fail", "1", "--code", "7", "--barrier", str(tmp_path))
    assert time.monotonic() - t0 < 30  # the sleeping processes were stopped
    assert out.returncode == 7, out.stdout + out.stderr
    assert "[p0] hello from process 0 of 3" in out.stdout
    assert "[p1] process 1 failing with code 7" in out.stderr
    assert "[launch] process 1 exited with code 7" in out.stderr


@pytest.mark.multiprocess
def test_cli_timeout_and_success():
    out = _cli("-n", "2", "--timeout", "1", "--grace", "1", str(MP_SCRIPTS / "exit_code.py"),
               "--fail", "-1")
    assert out.returncode == cl.TIMEOUT_EXIT_CODE, out.stderr
    assert "timed out" in out.stderr
    out = _cli("-n", "2", str(MP_SCRIPTS / "exit_code.py"), "--fail", "-1", "--sleep", "0")
    assert out.returncode == 0, out.stderr
    assert out.stdout.count("hello from process") == 2


@pytest.mark.parametrize("argv,message", [
    (("--processes", "0", str(MP_SCRIPTS / "exit_code.py")), "--processes must be >= 1"),
    (("--processes", "2", "--devices-per-process", "0", str(MP_SCRIPTS / "exit_code.py")),
     "--devices-per-process must be >= 1"),
    (("--processes", "2", "--timeout", "0", str(MP_SCRIPTS / "exit_code.py")), "--timeout must be > 0"),
    (("--processes", "2", "--grace", "-1", str(MP_SCRIPTS / "exit_code.py")), "--grace must be >= 0"),
    (("--processes", "2", "no_such_script.py"), "script not found"),
])
def test_cli_rejects_bad_arguments(capsys, argv, message):
    code, _, err = _cli_in_process(capsys, *argv)
    assert code == 2 and message in err


# ------------------------------------------------------------------- in-process units


def test_launch_api_validation():
    with pytest.raises(ValueError, match="processes must be"):
        cl.launch("x.py", 0, 1)
    with pytest.raises(ValueError, match="devices_per_process must be"):
        cl.launch("x.py", 2, 0)
    with pytest.raises(ValueError, match="timeout"):
        cl.launch("x.py", 2, 1, timeout=0)
    with pytest.raises(ValueError, match="empty"):
        cl.launch([], 2, 1)


def test_child_env():
    base = {"XLA_FLAGS": "--xla_force_host_platform_device_count=8 --foo=1", "PATH": "/bin"}
    env = cl.child_env(2, 4, 3, "127.0.0.1:1234", interface="eth9", base=base,
                       extra={"X": "1"})
    assert env[cd.ENV_COORDINATOR] == "127.0.0.1:1234"
    assert (env[cd.ENV_NUM_PROCESSES], env[cd.ENV_PROCESS_ID], env[cd.ENV_LOCAL_DEVICES]) == (
        "4", "2", "3")
    assert env[cd.ENV_INTERFACE] == "eth9"
    assert env["XLA_FLAGS"] == "--foo=1"
    assert env["JAX_PLATFORMS"] == "cpu" and env["X"] == "1" and env["PATH"] == "/bin"
    assert env["PYTHONPATH"].split(os.pathsep)[0] == str(REPO)
    # Twice the local devices in CPU-client threads, and a value the caller set is kept.
    assert int(env[cl.CPU_THREADS_ENV]) >= 6
    kept = cl.child_env(0, 2, 4, "127.0.0.1:1", base={cl.CPU_THREADS_ENV: "40"})
    assert kept[cl.CPU_THREADS_ENV] == "40"


def test_config_from_env():
    assert cd.config_from_env({}) is None
    assert cd.initialize_from_env({}) is False  # single process: a no-op
    with pytest.raises(RuntimeError, match="commjax.launch"):
        cd.initialize_from_env({}, required=True)
    with pytest.raises(ValueError, match="missing"):
        cd.config_from_env({cd.ENV_COORDINATOR: "127.0.0.1:1"})
    with pytest.raises(ValueError, match="not an integer"):
        cd.config_from_env({cd.ENV_COORDINATOR: "h:1", cd.ENV_NUM_PROCESSES: "two",
                            cd.ENV_PROCESS_ID: "0"})
    cfg = cd.config_from_env({cd.ENV_COORDINATOR: "h:1", cd.ENV_NUM_PROCESSES: "2",
                              cd.ENV_PROCESS_ID: "1", cd.ENV_LOCAL_DEVICES: "4",
                              cd.ENV_HEARTBEAT_TIMEOUT: "7"})
    assert cfg == cd.DistributedConfig("h:1", 2, 1, 4, None, cd.DEFAULT_INIT_TIMEOUT, 7,
                                       cd.DEFAULT_SHUTDOWN_TIMEOUT)


def test_initialize_validates_before_touching_jax():
    with pytest.raises(ValueError, match="process_id"):
        cd.initialize("127.0.0.1:1", 2, 2)
    with pytest.raises(ValueError, match="host:port"):
        cd.initialize("127.0.0.1", 2, 0)
    with pytest.raises(ValueError, match="local_devices"):
        cd.initialize("127.0.0.1:1", 2, 0, 0)


def test_initialize_kwargs_match_installed_jax():
    """Every keyword we pass exists in this JAX; unknown ones would be dropped."""
    import jax

    params = inspect.signature(jax.distributed.initialize).parameters
    for name in ("coordinator_address", "num_processes", "process_id", "initialization_timeout",
                 "heartbeat_timeout_seconds", "shutdown_timeout_seconds",
                 "cluster_detection_method"):
        assert name in params, name

    def old_initialize(coordinator_address, num_processes, process_id):
        pass

    kept = cd._supported_kwargs(old_initialize, {"coordinator_address": "h:1", "num_processes": 2,
                                                 "process_id": 0, "heartbeat_timeout_seconds": 5})
    assert kept == {"coordinator_address": "h:1", "num_processes": 2, "process_id": 0}


def test_global_mesh_single_process():
    import jax

    mesh = cd.global_mesh("data")
    assert mesh.axis_names == ("data",)
    assert mesh.devices.size == jax.device_count() == 8
    assert mesh.axis_types == (jax.sharding.AxisType.Auto,)


def test_helpers_never_use_psum_scatter():
    """With jaxlib 0.10.2 one small cross-process psum_scatter reportedly slows later
    cross-process collectives 10-200x: the multi-process helpers and worker scripts
    must not use it (source), and their compiled collectives carry no reduce-scatter
    (HLO, compiled here on the 8 local devices)."""
    files = [REPO / "commjax" / "distributed.py", REPO / "commjax" / "launch.py",
             REPO / "tests" / "multiprocess.py", *sorted(MP_SCRIPTS.glob("*.py"))]
    for f in files:
        text = f.read_text()
        call = re.search(r"\b(psum_scatter|reduce_scatter)\s*\(", text)
        assert call is None, f"{f} calls {call.group(1)}"

    worker = load_script("collectives")
    mesh = cd.global_mesh("data")
    g = mesh.devices.size
    fns = worker.build(mesh)
    inputs = {"psum": worker.psum_input(g), "all_gather": worker.gather_input(g),
              "all_to_all": worker.all_to_all_input(g)}
    want = worker.expected(g)
    for name, fn in fns.items():
        hlo = fn.lower(inputs[name]).compile().as_text()
        assert "reduce-scatter" not in hlo, name
        np.testing.assert_array_equal(np.asarray(fn(inputs[name])), want[name])
    # The byte collectives really move uint8 words.
    a2a_hlo = fns["all_to_all"].lower(inputs["all_to_all"]).compile().as_text()
    assert _result_types(a2a_hlo, "all-to-all") == {"u8"}, a2a_hlo
    ag_hlo = fns["all_gather"].lower(inputs["all_gather"]).compile().as_text()
    assert _result_types(ag_hlo, "all-gather") == {"u8"}, ag_hlo


def _result_types(hlo: str, op: str) -> set[str]:
    """Element types in the result shapes of every ``op`` instruction of ``hlo``."""
    types: set[str] = set()
    for line in hlo.splitlines():
        m = re.match(rf"\s*(?:ROOT )?%\S+ = (.*?) {re.escape(op)}\(", line)
        if m:
            types.update(re.findall(r"\b([a-z]+\d*)\[", m.group(1)))
    return types


def test_the_process_that_raised_is_reported_not_a_peer_that_aborted(tmp_path):
    """Process 1 raises; its peers abort (as JAX's do when a collective loses a member),
    and here before the raiser has finished exiting. The report names process 1 and its
    error, not the first SIGABRT seen."""
    script = tmp_path / "w.py"
    script.write_text(
        "import os, time\n"
        "pid = int(os.environ['COMMJAX_PROCESS_ID'])\n"
        "if pid == 1:\n"
        "    time.sleep(0.6)\n"
        "    raise ValueError('boom in process 1')\n"
        "time.sleep(0.3)\n"
        "os.abort()\n")
    res = cl.launch(str(script), 3, stream=False, timeout=60)
    assert res.failed_process == 1, res.describe()
    assert res.error == "ValueError: boom in process 1"
    assert "ValueError: boom in process 1" in res.describe()
