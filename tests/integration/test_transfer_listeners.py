"""The Mooncake backend's listeners admit only connections to the configured host
(Mooncake binds its handshake and TCP data ports to 0.0.0.0 / [::] itself; the backend
filters them, common/transfer/listen_guard.py), they are what `listen_addresses` says,
and transfers through them still work. Evidence: this process's listening sockets read
from /proc/net/tcp{,6} here, and connections to this host's other addresses."""
from __future__ import annotations

import ctypes
import os
import socket

import pytest

from common.transfer import create_transfer
from tests.host_addresses import connects, other_ipv4

pytestmark = pytest.mark.skipif(not os.path.exists("/proc/self/net/tcp"), reason="Linux /proc needed")


def _mooncake_importable() -> bool:
    try:
        import mooncake.engine  # noqa: F401
    except ImportError:
        return False
    return True


needs_mooncake = pytest.mark.skipif(not _mooncake_importable(), reason="mooncake.engine cannot be imported")


def listening_ports() -> dict[int, set[str]]:
    """port -> the addresses this process's sockets listen on there (as /proc shows them)."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    ports: dict[int, set[str]] = {}
    for name, family in (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6)):
        with open(f"/proc/self/net/{name}") as f:
            for line in f.readlines()[1:]:
                p = line.split()
                if p[3] != "0A" or p[9] not in inodes:
                    continue
                addr, port = p[1].split(":")
                raw = bytes.fromhex(addr)
                raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
                ports.setdefault(int(port, 16), set()).add(socket.inet_ntop(family, raw))
    return ports


def opened_by(make):
    """(engine, the ports it opened listeners on)."""
    before = set(listening_ports())
    engine = make()
    return engine, sorted(set(listening_ports()) - before)


@needs_mooncake
def test_mooncake_listeners_admit_only_loopback_when_configured_so():
    engine, ports = opened_by(lambda: create_transfer("mooncake", hostname="127.0.0.1"))
    try:
        rpc_port = int(engine.endpoint.rsplit(":", 1)[1])
        assert rpc_port in ports and len(ports) == 2          # handshake + TCP data
        other = other_ipv4()
        for port in ports:
            assert connects("127.0.0.1", port)
            assert not connects("::1", port), f"port {port} admits a connection to ::1"
            if other is not None:
                assert not connects(other, port), f"port {port} admits a connection to {other}"
        assert sorted(engine.listen_addresses) == sorted(f"127.0.0.1:{p}" for p in ports)
    finally:
        engine.close()


@needs_mooncake
def test_mooncake_on_another_address_admits_only_that_address_and_still_moves_bytes():
    other = other_ipv4()
    if other is None:
        pytest.skip("this host has no non-loopback IPv4 address")
    (a, ports), b = opened_by(lambda: create_transfer("mooncake", hostname=other)), None
    try:
        for port in ports:
            assert connects(other, port)
            assert not connects("127.0.0.1", port), f"port {port} admits a connection to 127.0.0.1"
        assert sorted(a.listen_addresses) == sorted(f"{other}:{p}" for p in ports)
        b = create_transfer("mooncake", hostname=other)
        src = ctypes.create_string_buffer(os.urandom(1 << 16), 1 << 16)
        dst = ctypes.create_string_buffer(1 << 16)
        back = ctypes.create_string_buffer(1 << 16)
        a.register(ctypes.addressof(dst), 1 << 16)
        b.register(ctypes.addressof(src), 1 << 16)
        b.register(ctypes.addressof(back), 1 << 16)
        assert b.write(a.endpoint, [(ctypes.addressof(src), ctypes.addressof(dst), 1 << 16)], timeout_s=5) == 1 << 16
        assert b.read(a.endpoint, [(ctypes.addressof(back), ctypes.addressof(dst), 1 << 16)], timeout_s=5) == 1 << 16
        assert dst.raw == src.raw == back.raw
    finally:
        a.close()
        if b is not None:
            b.close()


def test_backends_without_listeners_of_their_own_report_none():
    fake = create_transfer("fake")
    try:
        assert fake.listen_addresses == ()
    finally:
        fake.close()
