"""Where a request's time goes, hop by hop: opt-in timestamps for benchmarks (bench/handoff.py).

With $PDMESH_TIMELINE_DIR set, every process that calls mark() appends lines
`MONOTONIC_S EVENT KEY` to DIR/PID.timeline; unset (the default) mark() returns at once.
KEY is the id this process knows the request by: the client's request_id at the client
and the gateway, the attempt's mesh id on the decode and prefill nodes, the route's id at
the meta-server; the gateway writes `link` events (KEY = "client_id|other_id") that join
them. time.monotonic is one clock (CLOCK_MONOTONIC) for every process of a host, so the
files of all services merge into one timeline per request.

EVENTS lists them in the order one remotely prefilled request meets them; read() merges a
directory's files into one timeline per request.
"""
from __future__ import annotations

import collections
import logging
import os
import threading
import time
from pathlib import Path

log = logging.getLogger("pdmesh.timeline")

EVENTS = ("client.sent", "gateway.in", "gateway.route_sent", "meta.route_in", "meta.route_out",
          "gateway.routed", "gateway.decode_sent", "decode.in", "decode.admitted", "decode.prefill_sent",
          "prefill.in", "prefill.start", "prefill.computed", "prefill.answered", "decode.prefill_answered",
          "decode.committed", "decode.first_out", "gateway.first_in", "gateway.first_out", "client.first")

_DIR = os.environ.get("PDMESH_TIMELINE_DIR", "")
_lock = threading.Lock()
_file = None


def record_to(directory: str) -> None:
    """Turn timelines on in this process (as $PDMESH_TIMELINE_DIR does at import), into
    `directory` from now on."""
    global _DIR, _file
    with _lock:
        _DIR, _file = directory, None


def mark(event: str, key: str) -> None:
    """Append `now event key` to this process's timeline, when timelines are on. Never
    raises: it runs on request paths and the engine's step thread, so a timeline that
    cannot be written is logged once and turned off."""
    global _DIR, _file
    if not _DIR:
        return
    now = time.monotonic()
    key = key.replace("\n", " ")
    with _lock:
        try:
            if _file is None:
                _file = open(os.path.join(_DIR, f"{os.getpid()}.timeline"), "a", buffering=1)
            _file.write(f"{now:.6f} {event} {key}\n")
        except OSError as e:
            log.warning("timeline in %s cannot be written (%s); timelines are off in this process", _DIR, e)
            _DIR, _file = "", None


def link(first: str, other: str) -> None:
    """Say that `other` names the same request as `first` (the client's id)."""
    if _DIR:
        mark("link", f"{first}|{other}")


def read(directory: str | Path) -> dict[str, dict[str, float]]:
    """The client's request id -> {event: its earliest time}, every process's lines merged
    (the other ids folded in by the links: a retried or migrated request has several)."""
    raw: dict[str, dict[str, float]] = collections.defaultdict(dict)
    alias: dict[str, str] = {}
    for path in Path(directory).glob("*.timeline"):
        for line in path.read_text().splitlines():
            t, event, key = line.split(" ", 2)
            if event == "link":
                first, other = key.rsplit("|", 1)
                alias[other] = first
            else:
                raw[key][event] = min(float(t), raw[key].get(event, float("inf")))
    merged: dict[str, dict[str, float]] = collections.defaultdict(dict)
    for key, events in raw.items():
        into = merged[alias.get(key, key)]
        for event, t in events.items():
            into[event] = min(t, into.get(event, float("inf")))
    return merged
