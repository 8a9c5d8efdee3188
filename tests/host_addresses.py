"""This host's addresses, for tests of what listens where."""
from __future__ import annotations

import socket
import subprocess


def other_ipv4() -> str | None:
    """A non-loopback IPv4 address of this host, if it has one."""
    try:
        out = subprocess.run(["ip", "-4", "-o", "addr", "show", "scope", "global"], capture_output=True,
                             text=True, timeout=5).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    for line in out.splitlines():
        fields = line.split()
        if "inet" in fields:
            return fields[fields.index("inet") + 1].split("/")[0]
    return None


def connects(host: str, port: int, timeout_s: float = 0.5) -> bool:
    """Whether a TCP connection to host:port is accepted within timeout_s."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.settimeout(timeout_s)
        try:
            s.connect((host, port))
        except OSError:
            return False
    return True
