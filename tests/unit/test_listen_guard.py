"""common/transfer/listen_guard.py on plain sockets: a wildcard listener filtered to one
address admits connections to that address only (IPv4, IPv6, dual-stack, several
addresses), and its Listener entries are what /proc shows."""
from __future__ import annotations

import os
import socket

import pytest

from common.transfer import listen_guard
from tests.host_addresses import connects, other_ipv4

pytestmark = pytest.mark.skipif(not os.path.exists("/proc/self/net/tcp"), reason="Linux /proc needed")


def ipv6_works() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
    except OSError:
        return False
    return True


def wildcard_listener(family: int):
    before = listen_guard.own_listeners()
    s = socket.socket(family)
    if family == socket.AF_INET6:
        s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
    s.bind(("::" if family == socket.AF_INET6 else "0.0.0.0", 0))
    s.listen(8)
    opened = listen_guard.opened_since(before)
    return s, opened


def test_opened_since_lists_the_new_wildcard_listener_as_proc_shows_it():
    s, opened = wildcard_listener(socket.AF_INET)
    try:
        port = s.getsockname()[1]
        assert [(l.host, l.port, l.family) for l in opened] == [("0.0.0.0", port, socket.AF_INET)]
        assert opened[0].addresses == (f"0.0.0.0:{port}",)
        with socket.socket() as bound:      # a listener bound to one address is not a wildcard one
            before = listen_guard.own_listeners()
            bound.bind(("127.0.0.1", 0))
            bound.listen(1)
            assert listen_guard.opened_since(before) == []
    finally:
        s.close()


def test_an_ipv4_listener_filtered_to_loopback():
    s, opened = wildcard_listener(socket.AF_INET)
    try:
        port = s.getsockname()[1]
        guarded = listen_guard.restrict(opened, "127.0.0.1")
        assert guarded[0].addresses == (f"127.0.0.1:{port}",)
        assert connects("127.0.0.1", port)
        other = other_ipv4()
        if other is not None:
            assert not connects(other, port)
    finally:
        s.close()


@pytest.mark.skipif(not ipv6_works(), reason="no IPv6 loopback")
def test_a_dual_stack_listener_filtered_to_one_family_or_to_both():
    s, opened = wildcard_listener(socket.AF_INET6)
    try:
        port = s.getsockname()[1]
        assert connects("127.0.0.1", port) and connects("::1", port)
        guarded = listen_guard.restrict(opened, "::1")
        assert guarded[0].addresses == (f"[::1]:{port}",)
        assert connects("::1", port)
        assert not connects("127.0.0.1", port)
    finally:
        s.close()
    s, opened = wildcard_listener(socket.AF_INET6)
    try:
        port = s.getsockname()[1]
        fds = listen_guard._socket_fds()
        listen_guard.attach(fds[opened[0].inode], ("127.0.0.1", "::1"))
        assert connects("127.0.0.1", port) and connects("::1", port)
        other = other_ipv4()
        if other is not None:
            assert not connects(other, port)
    finally:
        s.close()


def test_a_wildcard_or_foreign_host_leaves_listeners_open_and_names_resolve():
    s, opened = wildcard_listener(socket.AF_INET)
    try:
        assert listen_guard.restrict(opened, "0.0.0.0") == opened
        assert listen_guard.allowed_addresses("127.0.0.1") == ("127.0.0.1",)
        assert listen_guard.allowed_addresses("[::1]") == ("::1",)
        assert "127.0.0.1" in listen_guard.allowed_addresses("localhost")
        with pytest.raises(OSError, match="no address of this machine"):
            listen_guard.restrict(opened, "203.0.113.254")   # a NAT / virtual address: left unfiltered
        assert connects("127.0.0.1", s.getsockname()[1])
    finally:
        s.close()
