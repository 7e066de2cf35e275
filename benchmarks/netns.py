"""A private, rate-limited network of Linux network namespaces for benchmarks (root only).

:class:`Network` builds ``n`` *host* namespaces, each with one interface ``eth0``, joined
by veth pairs to a Linux bridge that lives in a separate *switch* namespace::

      ns <tag>-0 (eth0 10.213.7.1) --veth--+
      ns <tag>-1 (eth0 10.213.7.2) --veth--+-- bridge br0 in ns <tag>-sw
      ...                                   |
      ns <tag>-{n-1}              --veth--+

Addresses (``10.213.7.0/24`` by default, a private range) exist only inside these
namespaces; nothing is added to, or routed from, the machine's own network. Every link
is shaped in **both** directions with a token bucket (``tc qdisc ... tbf``): on the
host side (``eth0`` egress: what the host sends) and on the switch side (the bridge
port's egress: what the host receives), so each host has a full-duplex port of the
chosen rate, like a switched Ethernet. ``tbf`` limits the rate only; it adds no
propagation delay (``netem``, which would, is checked by :func:`netem_available` and is
missing from some kernels).

Cleanup: :meth:`Network.close` deletes the namespaces (which deletes their veths and
the bridge); use the object as a context manager and install
:func:`install_signal_handlers` so that SIGINT/SIGTERM/SIGHUP unwind through it.
:func:`remove_stale` deletes namespaces left by a run that was killed with SIGKILL
(only those whose name starts with this module's prefix).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from typing import Optional, Sequence

__all__ = [
    "PREFIX",
    "NetworkError",
    "check_environment",
    "netem_available",
    "parse_rate",
    "format_rate",
    "Network",
    "install_signal_handlers",
    "remove_stale",
]

#: Every namespace this module creates has a name starting with this.
PREFIX = "cjbw"


class NetworkError(RuntimeError):
    """A command that builds or shapes the network failed."""


def check_environment() -> None:
    """Raise SystemExit with a clear message unless we are root and ``ip``/``tc`` exist."""
    problems = []
    if os.geteuid() != 0:
        problems.append(
            "must run as root: it creates network namespaces, veth pairs and a bridge, and "
            "shapes them with tc (try: sudo -E env PATH=$PATH python ...)")
    for tool, pkg in (("ip", "iproute2"), ("tc", "iproute2")):
        if shutil.which(tool) is None:
            problems.append(f"`{tool}` not found on PATH (install {pkg})")
    if problems:
        raise SystemExit("bandwidth benchmark: " + "; ".join(problems))


def _run(cmd: Sequence[str], *, check: bool = True) -> subprocess.CompletedProcess:
    out = subprocess.run(list(cmd), capture_output=True, text=True)
    if check and out.returncode != 0:
        raise NetworkError(f"`{' '.join(cmd)}` failed ({out.returncode}): {out.stderr.strip()}")
    return out


def parse_rate(text: str) -> Optional[float]:
    """``"100mbit"``, ``"1gbit"``, ``"10gbit"``, ``"2.5gbit"``, ``"500kbit"`` -> bits/s;
    ``"none"`` (or ``"unlimited"``) -> None (no shaping)."""
    t = text.strip().lower()
    if t in ("none", "unlimited", "inf", "0"):
        return None
    for suffix, mult in (("gbit", 1e9), ("mbit", 1e6), ("kbit", 1e3), ("bit", 1.0)):
        if t.endswith(suffix):
            try:
                value = float(t[: -len(suffix)])
            except ValueError:
                break
            if value <= 0:
                break
            return value * mult
    raise ValueError(
        f"link rate {text!r}: expected a number followed by gbit, mbit or kbit "
        "(e.g. 100mbit, 1gbit, 10gbit), or 'none' for an unshaped link")


def format_rate(bits_per_s: Optional[float]) -> str:
    """Inverse of :func:`parse_rate` (``None`` -> ``"none"``)."""
    if bits_per_s is None:
        return "none"
    for suffix, mult in (("gbit", 1e9), ("mbit", 1e6), ("kbit", 1e3)):
        if bits_per_s >= mult:
            v = bits_per_s / mult
            return f"{v:g}{suffix}"
    return f"{bits_per_s:g}bit"


def _ns_exists(name: str) -> bool:
    out = _run(["ip", "netns", "list"], check=False)
    return any(line.split()[0] == name for line in out.stdout.splitlines() if line.strip())


def remove_stale(prefix: str = PREFIX) -> list[str]:
    """Delete namespaces named ``<prefix>...`` whose creating process is gone.

    Names carry the creator's pid (``<prefix><pid>-...``); namespaces of a live process
    are left alone (another run may be using them).
    """
    out = _run(["ip", "netns", "list"], check=False)
    removed = []
    for line in out.stdout.splitlines():
        name = line.split()[0] if line.strip() else ""
        if not name.startswith(prefix):
            continue
        pid_text = name[len(prefix):].split("-", 1)[0]
        if pid_text.isdigit():
            try:
                os.kill(int(pid_text), 0)
                continue  # its creator still runs
            except ProcessLookupError:
                pass
            except PermissionError:
                continue
        _run(["ip", "netns", "delete", name], check=False)
        removed.append(name)
    return removed


def netem_available() -> tuple[bool, str]:
    """Whether ``tc qdisc ... netem`` works here (tried on a throw-away namespace's
    loopback). Returns ``(ok, message)``."""
    ns = f"{PREFIX}{os.getpid()}-probe"
    _run(["ip", "netns", "add", ns])
    try:
        _run(["ip", "-n", ns, "link", "set", "lo", "up"])
        out = _run(["tc", "-n", ns, "qdisc", "add", "dev", "lo", "root", "netem", "delay", "1ms"],
                   check=False)
        if out.returncode == 0:
            return True, "netem is available"
        return False, ("netem is NOT available in this kernel (`tc qdisc add ... netem` failed: "
                       f"{out.stderr.strip() or out.returncode}); links are rate-limited with tbf "
                       "only, with no added latency")
    finally:
        _run(["ip", "netns", "delete", ns], check=False)


class Network:
    """``n`` host namespaces on one bridge, each link shaped by :meth:`shape`.

    Args:
      n: number of hosts.
      subnet: the first three octets of the private /24 the hosts get (``.1`` ... ``.n``).
      interface: the name of each host's interface.
      mtu: link MTU.
    """

    def __init__(self, n: int, *, subnet: str = "10.213.7", interface: str = "eth0",
                 mtu: int = 1500) -> None:
        if not 1 <= n <= 200:
            raise ValueError(f"Network: `n` must be in [1, 200], got {n!r}")
        octets = subnet.split(".")
        if len(octets) != 3 or not all(o.isdigit() and 0 <= int(o) < 256 for o in octets):
            raise ValueError(f"Network: `subnet` must look like '10.213.7', got {subnet!r}")
        first = int(octets[0])
        second = int(octets[1])
        private = first == 10 or (first == 172 and 16 <= second < 32) or (
            first == 192 and second == 168)
        if not private:
            raise ValueError(f"Network: `subnet` {subnet!r} is not in a private range "
                             "(10/8, 172.16/12, 192.168/16)")
        self.n = n
        self.subnet = subnet
        self.interface = interface
        self.mtu = mtu
        tag = f"{PREFIX}{os.getpid()}"
        self.switch = f"{tag}-sw"
        self.hosts = [f"{tag}-{i}" for i in range(n)]
        self.addresses = [f"{subnet}.{i + 1}" for i in range(n)]
        self.rate: Optional[float] = None
        self._created: list[str] = []
        self._closed = False

    # ----------------------------------------------------------------- lifecycle

    def __enter__(self) -> "Network":
        self.create()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def create(self) -> None:
        """Build the namespaces, veths and bridge (undone on failure)."""
        try:
            for ns in [self.switch, *self.hosts]:
                if _ns_exists(ns):
                    raise NetworkError(f"namespace {ns} already exists")
                _run(["ip", "netns", "add", ns])
                self._created.append(ns)
                _run(["ip", "-n", ns, "link", "set", "lo", "up"])
            sw = self.switch
            _run(["ip", "-n", sw, "link", "add", "br0", "type", "bridge"])
            _run(["ip", "-n", sw, "link", "set", "br0", "mtu", str(self.mtu)])
            _run(["ip", "-n", sw, "link", "set", "br0", "up"])
            for i, (ns, addr) in enumerate(zip(self.hosts, self.addresses)):
                port = f"p{i}"
                _run(["ip", "link", "add", "name", self.interface, "netns", ns, "mtu",
                      str(self.mtu), "type", "veth", "peer", "name", port, "netns", sw,
                      "mtu", str(self.mtu)])
                _run(["ip", "-n", sw, "link", "set", port, "master", "br0"])
                _run(["ip", "-n", sw, "link", "set", port, "up"])
                _run(["ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", self.interface])
                _run(["ip", "-n", ns, "link", "set", self.interface, "up"])
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Delete every namespace this object created (idempotent)."""
        while self._created:
            ns = self._created.pop()
            _run(["ip", "netns", "delete", ns], check=False)
        self._closed = True

    # ------------------------------------------------------------------- shaping

    def _links(self) -> list[tuple[str, str]]:
        """(namespace, device) of every shaped egress: each host's eth0 and each port."""
        out = [(ns, self.interface) for ns in self.hosts]
        out += [(self.switch, f"p{i}") for i in range(self.n)]
        return out

    @staticmethod
    def tbf_args(rate: float) -> list[str]:
        """``tc ... tbf`` arguments for ``rate`` bits/s: a bucket of 2 ms at the rate (at
        least 64 KiB, so that a GSO super-packet fits) and a queue of 50 ms."""
        rate_bytes = rate / 8.0
        burst = int(max(64 * 1024, rate_bytes * 0.002))
        limit = int(max(2 * burst, rate_bytes * 0.05))
        return ["tbf", "rate", f"{int(rate)}bit", "burst", str(burst), "limit", str(limit)]

    def shape(self, rate: Optional[float]) -> None:
        """Limit every link to ``rate`` bits/s in each direction (``None``: unshaped)."""
        for ns, dev in self._links():
            _run(["tc", "-n", ns, "qdisc", "del", "dev", dev, "root"], check=False)
            if rate is not None:
                _run(["tc", "-n", ns, "qdisc", "add", "dev", dev, "root", *self.tbf_args(rate)])
        self.rate = rate

    def qdiscs(self) -> str:
        """``tc qdisc show`` of every shaped device (for the record)."""
        lines = []
        for ns, dev in self._links():
            out = _run(["tc", "-n", ns, "qdisc", "show", "dev", dev], check=False)
            lines.append(f"{ns}/{dev}: {out.stdout.strip()}")
        return "\n".join(lines)

    def exec_prefix(self, host: int) -> list[str]:
        """Command prefix that runs a program inside host ``host``'s namespace."""
        return ["ip", "netns", "exec", self.hosts[host]]


_SINK = r"""
import socket, sys
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], int(sys.argv[2]))); s.listen(1)
print("ready", flush=True)
c, _ = s.accept(); n = 0
while True:
    b = c.recv(1 << 20)
    if not b:
        break
    n += len(b)
print(n, flush=True)
"""

_SOURCE = r"""
import socket, sys, time
c = socket.create_connection((sys.argv[1], int(sys.argv[2])))
buf = b"\0" * (1 << 20); t0 = time.perf_counter(); n = 0; dur = float(sys.argv[3])
while time.perf_counter() - t0 < dur:
    c.sendall(buf); n += len(buf)
c.shutdown(socket.SHUT_WR); c.recv(1); c.close()
print(n / (time.perf_counter() - t0) * 8, flush=True)
"""


def tcp_goodput(net: "Network", src: int = 0, dst: int = 1, seconds: float = 2.0,
                port: int = 29517) -> float:
    """Measured one-way TCP payload rate (bits/s) from host ``src`` to host ``dst``."""
    py = sys.executable
    sink = subprocess.Popen([*net.exec_prefix(dst), py, "-c", _SINK, net.addresses[dst],
                             str(port)], stdout=subprocess.PIPE, text=True)
    try:
        assert sink.stdout is not None
        sink.stdout.readline()  # "ready"
        out = _run([*net.exec_prefix(src), py, "-c", _SOURCE, net.addresses[dst], str(port),
                    str(seconds)])
        return float(out.stdout.strip().splitlines()[-1])
    finally:
        sink.wait(timeout=30)


def install_signal_handlers() -> None:
    """Turn SIGTERM and SIGHUP into SystemExit (SIGINT already raises KeyboardInterrupt),
    so that ``with Network(...)`` and ``finally`` blocks run and delete the namespaces."""

    def handler(signum, frame):
        raise SystemExit(128 + signum)

    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, handler)
    signal.signal(signal.SIGINT, signal.default_int_handler)


if __name__ == "__main__":  # a quick self-check: build, shape, show, tear down
    check_environment()
    install_signal_handlers()
    print(netem_available()[1])
    with Network(2) as net:
        net.shape(parse_rate(sys.argv[1] if len(sys.argv) > 1 else "100mbit"))
        print(net.qdiscs())
        print(f"TCP goodput host 0 -> 1: {tcp_goodput(net) / 1e6:.1f} Mbit/s")
