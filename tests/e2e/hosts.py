"""Hosts emulated by network namespaces, for the multi-host tests.

Each host is a network namespace with its own network stack (loopback and
one address), joined to the others by veth pairs on a bridge that lives in a
namespace of its own. This process's namespace gets one more address on the
bridge, so the test reaches the hosts' servers directly; it sends traffic to
nothing else. Everything is removed on every exit path (``ip netns del``
takes the veth pairs with it).

Needs root and ``ip`` (iproute2); :func:`unavailable` says why not when not.
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass


@dataclass(frozen=True)
class Host:
    """One emulated host."""

    name: str  # the network namespace
    address: str
    interface: str

    def argv(self, argv: list[str]) -> list[str]:
        """``argv`` run on this host."""
        return ["ip", "netns", "exec", self.name, *argv]


def unavailable() -> str | None:
    """Why namespaces cannot be made here, or None."""
    if shutil.which("ip") is None:
        return "needs ip (iproute2)"
    if os.geteuid() != 0:
        return "needs root (network namespaces)"
    probe = f"afdprobe{os.getpid() % 100000}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True)
    if made.returncode != 0:
        return f"cannot make a network namespace: {made.stderr.decode().strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def _ip(*args: str, netns: str | None = None) -> None:
    argv = ["ip", *(["-n", netns] if netns else []), *args]
    done = subprocess.run(argv, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}: {done.stderr.strip()}")


@contextlib.contextmanager
def emulated_hosts(n: int) -> Iterator[tuple[list[Host], str]]:
    """``n`` hosts on one bridge, and this namespace's address on it.

    Addresses are ``10.X.Y.1`` … ``10.X.Y.n`` with X.Y random per call, this
    namespace ``10.X.Y.254``.
    """
    tag = f"{os.getpid() % 10000}{random.randrange(100):02d}"
    subnet = f"10.{random.randrange(200, 250)}.{random.randrange(1, 250)}"
    bridge_ns = f"afd{tag}br"
    names = [f"afd{tag}h{i}" for i in range(n)]
    made: list[str] = []
    root_if = f"afd{tag}r"
    try:
        _ip("netns", "add", bridge_ns)
        made.append(bridge_ns)
        _ip("link", "add", "br0", "type", "bridge", netns=bridge_ns)
        _ip("link", "set", "br0", "up", netns=bridge_ns)
        hosts = []
        for i, name in enumerate(names):
            _ip("netns", "add", name)
            made.append(name)
            inner, outer = "eth0", f"p{i}"
            _ip("link", "add", outer, "netns", bridge_ns, "type", "veth",
                "peer", "name", inner, "netns", name)  # fmt: skip
            _ip("link", "set", outer, "master", "br0", "up", netns=bridge_ns)
            address = f"{subnet}.{i + 1}"
            _ip("addr", "add", f"{address}/24", "dev", inner, netns=name)
            _ip("link", "set", inner, "up", netns=name)
            _ip("link", "set", "lo", "up", netns=name)
            hosts.append(Host(name, address, inner))
        _ip("link", "add", root_if, "type", "veth",
            "peer", "name", "q", "netns", bridge_ns)  # fmt: skip
        _ip("link", "set", "q", "master", "br0", "up", netns=bridge_ns)
        _ip("addr", "add", f"{subnet}.254/24", "dev", root_if)
        _ip("link", "set", root_if, "up")
        yield hosts, f"{subnet}.254"
    finally:
        for name in made:
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
        subprocess.run(["ip", "link", "del", root_if], capture_output=True)
