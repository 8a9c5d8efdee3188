"""What a benchmark JSON records about the host it ran on, so figures from different
machines (or a loaded one) are not compared blindly."""
from __future__ import annotations

import os
import platform


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_info() -> dict:
    """{"python", "platform", "cpu", "cpus", "cpus_usable", "load_avg", "memory_gib"}:
    cpus is os.cpu_count(), cpus_usable this process's affinity; load_avg the 1/5/15-minute
    load at the call (a shared machine's noise)."""
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    try:
        memory_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError, AttributeError):
        memory_gib = 0.0
    return {"python": platform.python_version(), "platform": platform.platform(), "cpu": _cpu_model(),
            "cpus": os.cpu_count(), "cpus_usable": usable,
            "load_avg": list(os.getloadavg()) if hasattr(os, "getloadavg") else [],
            "memory_gib": round(memory_gib, 1)}
