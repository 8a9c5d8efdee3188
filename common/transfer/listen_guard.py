"""Keep a transfer engine's TCP listeners to the address it was configured with, when the
engine itself binds them to every interface.

Mooncake's Transfer Engine does: its handshake (RPC) port and its TCP data port are bound
to 0.0.0.0 and [::] whatever hostname `initialize` gets, and no setting changes that
(docs/security-data-plane.md). What a socket is bound to cannot change once it listens,
but its socket filter can: `restrict` attaches a classic BPF filter (SO_ATTACH_FILTER)
that drops every packet whose destination address is not one of the allowed ones. A SYN
to any other address of the host is dropped (the peer's connect times out, as behind a
firewall's DROP rule), and accepted connections inherit the filter. The effect is that of
binding the configured address; `ss -ltn` still shows the wildcard.

    before = own_listeners()
    <start the engine>
    opened = opened_since(before)         # this process's new wildcard listeners
    guarded = restrict(opened, hostname)  # Listener.addresses: what peers can reach now

Linux only: reads /proc/self/net/tcp{,6} and /proc/self/fd. A connection accepted between
the engine's listen() and restrict() (a few milliseconds at start-up) is not filtered.
Not thread-safe against other threads opening listeners meanwhile: callers serialize the
engine's start and the snapshot (common/transfer/mooncake.py holds a lock).
"""
from __future__ import annotations

import ctypes
import dataclasses
import ipaddress
import os
import socket
from dataclasses import dataclass

SO_ATTACH_FILTER = 26
WILDCARDS = ("0.0.0.0", "::")
_LISTEN = "0A"                       # TCP_LISTEN in /proc/net/tcp
_NET = -0x100000 & 0xFFFFFFFF        # SKF_NET_OFF: offsets from the IP header
# classic BPF opcodes (linux/filter.h)
_LD_W_ABS, _LD_B_ABS, _LD_MEM, _ST = 0x20, 0x30, 0x60, 0x02
_RSH_K, _JEQ_K, _RET_K = 0x74, 0x15, 0x06
_ACCEPT = 0xFFFFFFFF


@dataclass(frozen=True)
class Listener:
    inode: int
    family: int          # socket.AF_INET or AF_INET6 (dual-stack)
    host: str            # as bound: "0.0.0.0", "::", "127.0.0.1"
    port: int
    accepts: tuple[str, ...] = ()   # filtered to connections to these addresses; () = unfiltered

    @property
    def addresses(self) -> tuple[str, ...]:
        """Where peers can connect, as "host:port" (IPv6 in brackets); a wildcard host
        ("0.0.0.0:P", "[::]:P") means every interface of this machine."""
        return tuple(_host_port(h, self.port) for h in (self.accepts or (self.host,)))


def _host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _proc_listeners() -> dict[int, Listener]:
    out: dict[int, Listener] = {}
    for name, family in (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6)):
        try:
            with open(f"/proc/self/net/{name}") as f:
                lines = f.readlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if fields[3] != _LISTEN:
                continue
            hex_addr, hex_port = fields[1].split(":")
            raw = bytes.fromhex(hex_addr)   # each 32-bit word in host (little-endian) order
            raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
            inode = int(fields[9])
            out[inode] = Listener(inode, family, socket.inet_ntop(family, raw), int(hex_port, 16))
    return out


def _socket_fds() -> dict[int, int]:
    """inode -> one fd of this process holding that socket."""
    fds: dict[int, int] = {}
    for name in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue
        if target.startswith("socket:["):
            fds.setdefault(int(target[8:-1]), int(name))
    return fds


def own_listeners() -> dict[int, Listener]:
    """This process's listening TCP sockets by inode. OSError when /proc cannot be read."""
    fds = _socket_fds()
    return {inode: l for inode, l in _proc_listeners().items() if inode in fds}


def opened_since(before: dict[int, Listener]) -> list[Listener]:
    """This process's wildcard-bound listeners that were not in `before`, by port."""
    return sorted((l for inode, l in own_listeners().items() if inode not in before and l.host in WILDCARDS),
                  key=lambda l: l.port)


def allowed_addresses(host: str) -> tuple[str, ...]:
    """The addresses of this machine that `host` (an IP or a name) stands for; () for a
    wildcard (no filter). OSError when a name does not resolve, or when it stands for no
    address of this machine (a NAT or virtual address: peers' packets arrive addressed to
    another one, which a filter to it would drop)."""
    try:
        ip = ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
        resolved = tuple(dict.fromkeys(info[4][0] for info in infos))
    else:
        if str(ip) in WILDCARDS:
            return ()
        resolved = (str(ip),)
    local = tuple(a for a in resolved if _is_local(a))
    if not local:
        raise OSError(f"{host} ({', '.join(resolved)}) is no address of this machine")
    return local


def _is_local(address: str) -> bool:
    """Whether a socket can bind `address` here (only an address of this machine can)."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.bind((address, 0))
    except OSError:
        return False
    return True


def program(addresses: tuple[str, ...]) -> list[tuple[int, int, int, int]]:
    """Classic BPF: accept a packet iff its IPv4/IPv6 destination is one of `addresses`.

        M[0] = ip version (first nibble of the IP header)
        for each address:  version matches and every 32-bit word of the destination
                           matches -> accept; else try the next address
        drop
    """
    code: list[list] = [[_LD_B_ABS, 0, 0, _NET], [_RSH_K, 0, 0, 4], [_ST, 0, 0, 0]]
    ends: list[int] = []                 # index of the first instruction after each block
    jumps: list[tuple[int, int]] = []    # (instruction, address block) whose false branch leaves it
    accepts: list[int] = []              # instructions whose true branch accepts
    for n, text in enumerate(addresses):
        ip = ipaddress.ip_address(text)
        words = [int.from_bytes(ip.packed[i:i + 4], "big") for i in range(0, len(ip.packed), 4)]
        dst = 16 if ip.version == 4 else 24
        code.append([_LD_MEM, 0, 0, 0])
        jumps.append((len(code), n))
        code.append([_JEQ_K, 0, 0, ip.version])
        for i, word in enumerate(words):
            code.append([_LD_W_ABS, 0, 0, _NET + dst + 4 * i])
            jumps.append((len(code), n))
            if i == len(words) - 1:
                accepts.append(len(code))
            code.append([_JEQ_K, 0, 0, word])
        ends.append(len(code))
    drop = len(code)
    code += [[_RET_K, 0, 0, 0], [_RET_K, 0, 0, _ACCEPT]]
    for at, n in jumps:
        code[at][2] = ends[n] - at - 1      # jf: on to the next address's block (the last: drop)
    for at in accepts:
        code[at][1] = drop + 1 - at - 1     # jt: to accept
    if any(not 0 <= ins[1] <= 255 or not 0 <= ins[2] <= 255 for ins in code):
        raise ValueError(f"too many addresses for one socket filter: {len(addresses)}")
    return [tuple(ins) for ins in code]


class _SockFilter(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint16), ("jt", ctypes.c_uint8), ("jf", ctypes.c_uint8),
                ("k", ctypes.c_uint32)]


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_uint16), ("filter", ctypes.POINTER(_SockFilter))]


def attach(fd: int, addresses: tuple[str, ...]) -> None:
    """Attach the filter of `program(addresses)` to the socket open at fd (through a
    duplicate of it, closed again). OSError when the kernel refuses it."""
    code = program(addresses)
    instructions = (_SockFilter * len(code))(*[_SockFilter(*ins) for ins in code])
    fprog = _SockFprog(len(code), instructions)
    sock = socket.socket(fileno=os.dup(fd))
    try:
        sock.setsockopt(socket.SOL_SOCKET, SO_ATTACH_FILTER, bytes(fprog))
    finally:
        sock.close()


def restrict(listeners: list[Listener], host: str) -> list[Listener]:
    """Filter each listener to connections addressed to `host`; returns them with
    `accepts` set (unchanged for a wildcard host). OSError when /proc cannot be read, a
    listener is gone, `host` does not resolve or the kernel refuses the filter."""
    addresses = allowed_addresses(host)
    if not addresses or not listeners:
        return list(listeners)
    fds = _socket_fds()
    guarded = []
    for listener in listeners:
        if listener.inode not in fds:
            raise OSError(f"listener {listener.addresses[0]} is no longer open in this process")
        attach(fds[listener.inode], addresses)
        guarded.append(dataclasses.replace(listener, accepts=addresses))
    return guarded
