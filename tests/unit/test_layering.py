"""The package layering, read from every module's imports (ast, nothing imported):

    kernels, common/model, common/runner, common/parallel   never import common/engine
    common/engine                                          never imports common/transfer
    common/*                                               never imports services/*
    services/<a> (the five services)                       never import services/<b>, but
                                                           for a service's client library

Services meet through protos and shared constants below them (common/call_metadata.py)."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SERVICES = ("gateway", "meta_server", "prefill", "decode", "kv_store")
CLIENT_LIBRARIES = {"services.kv_store.client", "services.kv_store.rank_clients"}


def imports_of(folder: str) -> dict[str, set[str]]:
    """module file -> the modules it imports (absolute names, anywhere in the file)."""
    found = {}
    for path in sorted((ROOT / folder).rglob("*.py")):
        names = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module)
        found[str(path.relative_to(ROOT))] = names
    return found


def offenders(folders: tuple[str, ...], forbidden: str) -> list[str]:
    return [f"{path}: {name}" for folder in folders for path, names in imports_of(folder).items()
            for name in sorted(names) if name == forbidden or name.startswith(forbidden + ".")]


def test_what_ranks_run_never_imports_the_engine():
    assert offenders(("kernels", "common/model", "common/runner", "common/parallel"), "common.engine") == []


def test_the_engine_never_imports_the_data_plane():
    assert offenders(("common/engine",), "common.transfer") == []


def test_common_never_imports_services():
    assert offenders(("common",), "services") == []


def test_services_meet_only_through_what_is_below_them():
    crossing = []
    for service in SERVICES:
        for other in SERVICES:
            if other != service:
                crossing += [o for o in offenders((f"services/{service}",), f"services.{other}")
                             if o.split(": ")[1] not in CLIENT_LIBRARIES]
    assert crossing == []
