"""Pins named by their caller (PinGetRequest.pin_id), so a caller whose PinGet answer was
lost (its deadline passed, it was cancelled, its process was stopped while the store
answered) can still end the pin with Release(name) instead of leaving the blocks pinned
for the whole lease.

    bind(name, space, pin_id)  a PinGet made store pin `pin_id` for `name`
    unbind(name) -> (space, pin_id) | None      Release(name), or the PinGet answers nothing
    overtaken(name)            a Release found no pin of that name: a PinGet of it may
                               still be on its way, and is then answered "nothing pinned"
    was_overtaken(name)        consumed by that PinGet

Names are 8-64 of [0-9A-Za-z_]: never a "-", so never one of the store's own ids
("<space>-pin-<n>"). A binding outlives its pin's lease by keep_s (one pin lease), so a
Release after the lease still finds the slots and checks their generations (a late read
may still be valid). The overtaken names are kept for keep_s too (a PinGet older than
that has been given up by its caller) and at most MAX_OVERTAKEN of them (a flood of
releases of unknown names evicts the oldest: that PinGet then pins until its lease).

Not thread-safe: the store's event loop owns it.
"""
from __future__ import annotations

import re
from collections import OrderedDict
from typing import Callable

NAME = re.compile(r"[0-9A-Za-z_]{8,64}")
MAX_OVERTAKEN = 4096


def check_name(name: str) -> str:
    if not NAME.fullmatch(name):
        raise ValueError(f"pin_id must be empty or 8-64 characters of [0-9A-Za-z_], got {name[:80]!r}")
    return name


class PinNames:
    def __init__(self, keep_s: float, clock: Callable[[], float]):
        self.keep_s, self.clock = keep_s, clock
        self._bound: dict[str, tuple[object, str]] = {}
        self._ended: dict[str, float] = {}       # bound names whose pin lapsed -> when to forget them
        self._overtaken: OrderedDict[str, float] = OrderedDict()   # name -> when to forget it

    def __contains__(self, name: str) -> bool:
        return name in self._bound

    def bind(self, name: str, space, pin_id: str) -> None:
        self._bound[name] = (space, pin_id)

    def unbind(self, name: str):
        self._ended.pop(name, None)
        return self._bound.pop(name, None)

    def __len__(self) -> int:
        """Bindings and overtaken names held (a leak check for tests)."""
        return len(self._bound) + len(self._overtaken)

    def overtaken(self, name: str) -> None:
        self._overtaken[name] = self.clock() + self.keep_s
        self._overtaken.move_to_end(name)
        while len(self._overtaken) > MAX_OVERTAKEN:
            self._overtaken.popitem(last=False)

    def was_overtaken(self, name: str) -> bool:
        return self._overtaken.pop(name, None) is not None

    def expire(self, live: Callable[[object, str], bool]) -> None:
        """Forget the names whose pin lapsed keep_s ago and the overtaken names past keep_s."""
        now = self.clock()
        for name, (space, pin_id) in list(self._bound.items()):
            if live(space, pin_id):
                continue
            forget_at = self._ended.setdefault(name, now + self.keep_s)
            if forget_at <= now:
                self.unbind(name)
        while self._overtaken and next(iter(self._overtaken.values())) <= now:
            self._overtaken.popitem(last=False)
