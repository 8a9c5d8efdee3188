"""deploy/k8s/ runs TLS by default: each pdmesh service gets the Secret pdmesh-tls (from
`pdmesh certs init`) at $PDMESH_TLS_DIR with only the CA's certificate and its own pair,
and with it the mesh config's 0.0.0.0 binds pass the plaintext policy
(services/security/bind_policy.py). Rendered as tests/unit/test_k8s.py renders them."""
from __future__ import annotations

import pytest

from services.security.bind_policy import PlaintextBindError, check_mesh_binds
from tests.k8s_manifests import is_pool, secret_mount, serve_container, tls_name, workloads, overlay  # noqa: F401
from tests.unit.test_k8s_autoscaling import pool_certs


def test_every_service_runs_tls_with_only_its_own_key(overlay):
    """Secure by default: PDMESH_TLS_DIR is the Secret pdmesh-tls (from `pdmesh certs
    init`), holding the CA's certificate and the service's own pair only (a scaled pool's
    pods: the pairs of the pool's pod names, one pod template for all); with it every
    service's 0.0.0.0 bind passes the plaintext policy, without it each would refuse."""
    _, objs, mesh, _ = overlay
    assert ("Secret", "pdmesh-tls") not in objs, "no key is committed"
    assert not mesh.security.allow_plaintext and not mesh.security.tls_dir
    tls_dirs = set()
    for name, wl in workloads(objs).items():
        if serve_container(wl) is None:
            continue
        args, c = serve_container(wl)
        [tls_dir] = [e["value"] for e in c["env"] if e["name"] == "PDMESH_TLS_DIR"]
        path, files = secret_mount(wl, c, "pdmesh-tls")
        owns = pool_certs(objs, name) if is_pool(args) else [tls_name(args)]   # a pool: its pods' own
        assert path == tls_dir and files == {f: f for f in ("ca.crt", *(f"{own}.{ext}" for own in owns
                                                                        for ext in ("crt", "key")))}, name
        tls_dirs.add(tls_dir)
    [tls_dir] = tls_dirs
    check_mesh_binds(mesh, environ={"PDMESH_TLS_DIR": tls_dir})
    with pytest.raises(PlaintextBindError, match="security.allow_plaintext"):
        check_mesh_binds(mesh, environ={})
