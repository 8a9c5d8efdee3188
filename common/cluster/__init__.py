"""Cluster membership (see base.py for the key layout and lifecycles).

`base` needs nothing beyond the standard library; the etcd backend (aetcd) is imported
only when one of its names is first used, so a missing aetcd never breaks import.
"""
from common.cluster.base import (DEFAULT_TTL_S, AdminStore, Backoff, ChangeKind, ClusterKeys,
                                 LeaderElection, MemberChange, MemberView, Membership,
                                 StoreUnavailableError, diff_members, election_ttl_seconds)

_LAZY = {"EtcdConfig": "common.cluster.etcd", "EtcdCluster": "common.cluster.etcd",
         "EtcdLeaderElection": "common.cluster.etcd_election"}

__all__ = ["DEFAULT_TTL_S", "AdminStore", "Backoff", "ChangeKind", "ClusterKeys", "LeaderElection",
           "MemberChange", "MemberView", "Membership", "StoreUnavailableError", "diff_members",
           "election_ttl_seconds", *_LAZY]


def __getattr__(name):
    if name in _LAZY:
        import importlib
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'common.cluster' has no attribute {name!r}")
