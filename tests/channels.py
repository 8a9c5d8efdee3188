"""Channels of a trusted test client: every call carries the mesh's cluster secret and the
admin token that tests/conftest.py put in the environment, so a test may call internal,
admin and public RPCs alike (tests of refusals build their own channels)."""
from __future__ import annotations

import os

from services.security.client_auth import AuthChannel, _raw_channel
from services.security.server_auth import SECRET_METADATA


def _metadata() -> tuple[tuple[str, str], ...]:
    return ((SECRET_METADATA, os.environ["PDMESH_CLUSTER_SECRET"]),
            ("authorization", f"Bearer {os.environ['PDMESH_ADMIN_TOKEN']}"))


def operator_channel(address: str, options: list | None = None):
    """A grpc.aio channel."""
    return AuthChannel(_raw_channel(address, None, options or [], sync=False), _metadata())


def operator_channel_sync(address: str, options: list | None = None):
    """A blocking grpc channel."""
    return AuthChannel(_raw_channel(address, None, options or [], sync=True), _metadata())
