"""The node profile file: what `pdmesh bench profile` measured on one node (services/bench/
profile.py writes it) and the planner loads (meta_server.planner.profile).

    {
      "format": "pdmesh-node-profile/1",
      "prefill": [{"prompt_tokens": 512, "ttft_s": 0.2, "tokens_per_s": 4000.0}, ...],
      "decode":  [{"context_tokens": 1024, "batch": 8, "itl_s": 0.04}, ...],
      "about":   {"model_id": ..., "device": ..., ...}          (optional, not read)
    }

prefill: at each prompt length, the time to first token of one prompt on an idle node and
the prompt tokens a second it computes at full load; decode: at each (context, batch), the
time of one decode step (NodeProfile's fields, services/meta_server/planner.py).
load_profile raises ProfileError naming the file and the entry that is wrong.
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from services.meta_server.planner import NodeProfile

FORMAT = "pdmesh-node-profile/1"
PREFILL_KEYS = ("prompt_tokens", "ttft_s", "tokens_per_s")
DECODE_KEYS = ("context_tokens", "batch", "itl_s")


class ProfileError(ValueError):
    """A profile file that cannot be read or is not a profile; the message names it."""


def profile_dict(profile: NodeProfile, about: dict[str, Any] | None = None) -> dict[str, Any]:
    """The JSON-able form of profile (the file's content)."""
    return {"format": FORMAT,
            "prefill": [dict(zip(PREFILL_KEYS, p)) for p in profile.prefill],
            "decode": [dict(zip(DECODE_KEYS, d)) for d in profile.decode],
            "about": dict(about or {})}


def write_profile(path: str | Path, profile: NodeProfile, about: dict[str, Any] | None = None) -> None:
    """Write the file (whole: a temporary sibling renamed over it)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.partial")
    partial.write_text(json.dumps(profile_dict(profile, about), indent=2) + "\n")
    partial.replace(path)


def _points(raw: dict, section: str, keys: tuple[str, ...], ints: tuple[str, ...]) -> tuple[tuple, ...]:
    entries = raw.get(section)
    if not isinstance(entries, list) or not entries:
        raise ValueError(f'"{section}" must be a non-empty list of {{{", ".join(keys)}}} entries')
    points = []
    for i, entry in enumerate(entries):
        if not isinstance(entry, dict) or set(entry) != set(keys):
            raise ValueError(f'{section}[{i}] must have exactly the keys {list(keys)}, got {entry!r}')
        for key in keys:
            value = entry[key]
            good = (isinstance(value, int) if key in ints else isinstance(value, (int, float)))
            if not good or isinstance(value, bool) or not math.isfinite(value) or value <= 0:
                kind = "an integer" if key in ints else "a number"
                raise ValueError(f"{section}[{i}].{key} must be {kind} > 0, got {value!r}")
        points.append(tuple(entry[k] for k in keys))
    return tuple(points)


def profile_from_dict(raw: Any) -> NodeProfile:
    """ValueError naming the entry that is wrong."""
    if not isinstance(raw, dict):
        raise ValueError(f"a profile is a JSON object, got {type(raw).__name__}")
    if raw.get("format") != FORMAT:
        raise ValueError(f'"format" must be {FORMAT!r}, got {raw.get("format")!r}')
    prefill = _points(raw, "prefill", PREFILL_KEYS, ("prompt_tokens",))
    decode = _points(raw, "decode", DECODE_KEYS, ("context_tokens", "batch"))
    for section, points, width in (("prefill", prefill, 1), ("decode", decode, 2)):
        keys = [p[:width] for p in points]
        if len(set(keys)) != len(keys):
            raise ValueError(f"{section}: a point is measured twice: {sorted(k for k in keys if keys.count(k) > 1)[0]}")
    return NodeProfile(prefill=prefill, decode=decode)


def load_profile(path: str | Path) -> NodeProfile:
    """ProfileError naming the file and what is wrong with it."""
    try:
        raw = json.loads(Path(path).read_text())
    except OSError as e:
        raise ProfileError(f"node profile {path}: cannot read it ({e.strerror}); measure one with "
                           "`pdmesh bench profile --config MESH --out FILE`") from None
    except json.JSONDecodeError as e:
        raise ProfileError(f"node profile {path}: not JSON ({e})") from None
    try:
        return profile_from_dict(raw)
    except ValueError as e:
        raise ProfileError(f"node profile {path}: {e}") from None
