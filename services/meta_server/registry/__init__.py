"""The meta-server's node table (see base.py): one Registry interface, an embedded and an
etcd implementation, and create_registry, the one place that picks between them."""
from __future__ import annotations

from common.config import MetaConfig
from services.meta_server.registry.base import (DOWN, UP, ExpertTokens, Member, RegistrationConflictError,
                                                RegistrationRefusedError, Registry, expert_tokens_of)
from services.meta_server.registry.embedded import EmbeddedRegistry
from services.meta_server.registry.etcd import EtcdRegistry

__all__ = ["DOWN", "UP", "EmbeddedRegistry", "EtcdRegistry", "ExpertTokens", "Member",
           "RegistrationConflictError", "RegistrationRefusedError", "Registry", "create_registry",
           "expert_tokens_of"]


def create_registry(cfg: MetaConfig, cluster=None) -> Registry:
    """An EtcdRegistry over `cluster` (a common.cluster EtcdCluster) when the meta-server
    has one, else an EmbeddedRegistry; members live cfg.ttl_seconds by default."""
    if cluster is not None:
        return EtcdRegistry(cluster, default_ttl_s=cfg.ttl_seconds)
    return EmbeddedRegistry(default_ttl_s=cfg.ttl_seconds)
