"""This host's addresses, for tests of what listens where."""
from __future__ import annotations

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
