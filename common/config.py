"""Frozen configuration dataclasses. Lower layers take plain arguments; services compose
these. Nothing here mutates at run time."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

# parts of the config defined apart for their length, re-exported here
from common.engine_config import DEVICES, DTYPES, KERNEL_BACKENDS, EngineConfig  # noqa: F401
from common.timeouts import TimeoutConfig  # noqa: F401
from common.planner_config import PlannerConfig  # noqa: F401
# engine fields a node may not override: nodes exchange KV, and these change what it holds
MESH_WIDE_ENGINE_FIELDS = {"lm_head_quantization"}


def check_optional_port(field: str, port) -> None:
    """A port a service may open beside its gRPC one (metrics_port, dashboard_port,
    http_port); 0 = off. ValueError naming `field` ("gateway.http_port") otherwise."""
    if not isinstance(port, int) or isinstance(port, bool) or not 0 <= port <= 65535:
        raise ValueError(f"{field} must be an integer in [0, 65535] (0 = off), got {port!r}")


def check_metrics_port(section: str, port) -> None:
    """metrics_port: where the service serves GET /metrics (common/metrics.py)."""
    check_optional_port(f"{section}.metrics_port", port)


ROLES = ("prefill", "decode", "both")
POLICIES = ("cache_aware", "least_load", "round_robin")
TRANSFER_BACKENDS = ("mooncake", "grpc", "fake")
KV_PUSH_MODES = ("layerwise", "chunk")


@dataclass(frozen=True)
class TransferConfig:
    """hostname: the address peers reach this node's transfer engine at; "" = each node's
    advertised host (NodeConfig.advertised_host), which a multi-host mesh needs.
    kv_push: how a prefill node pushes KV (services/prefill/kv_push.py): "layerwise", each
    layer's as soon as the forward pass wrote it (the transfer overlaps the later layers),
    or "chunk", all layers after each step."""

    backend: str = "mooncake"
    protocol: str = "tcp"            # mooncake: tcp here, rdma on RoCE, ascend on HCCS
    hostname: str = "127.0.0.1"
    device_name: str = ""            # mooncake rdma NIC, e.g. mlx5_0
    metadata_server: str = "P2PHANDSHAKE"
    kv_push: str = "layerwise"

    def __post_init__(self) -> None:
        if self.backend not in TRANSFER_BACKENDS:
            raise ValueError(f"transfer.backend must be one of {TRANSFER_BACKENDS}, got {self.backend!r}")
        if self.kv_push not in KV_PUSH_MODES:
            raise ValueError(f"transfer.kv_push must be one of {KV_PUSH_MODES}, got {self.kv_push!r}")


@dataclass(frozen=True)
class MetaConfig:
    """host is where the meta-server binds; the other services dial `address`, which uses
    advertise_host when set (e.g. bind 0.0.0.0, advertise a DNS name)."""

    host: str = "127.0.0.1"
    port: int = 50051
    ttl_seconds: float = 5.0             # membership lease / heartbeat TTL; refreshed every TTL/3
    policy: str = "least_load"
    local_prefill_max_tokens: int = 0   # prompts shorter than this prefill on the decode node
    prefill_queue_threshold: int = 0    # > 0: prefill locally past this backlog gap (router.py)
    standbys: int = 0                   # extra meta-servers (`pdmesh up`); need etcd_endpoint
    advertise_host: str = ""            # "" = host
    metrics_port: int = 0               # GET /metrics on host (0 = off); standbys get free ports
    dashboard_port: int = 0             # GET /dashboard, /api/cluster on host (0 = off; admin token)
    planner: PlannerConfig = PlannerConfig()   # section meta_server.planner (common/planner_config.py)

    def __post_init__(self) -> None:
        object.__setattr__(self, "planner", PlannerConfig.from_dict(self.planner))   # YAML gives a mapping
        check_metrics_port("meta_server", self.metrics_port)
        check_optional_port("meta_server.dashboard_port", self.dashboard_port)
        if self.policy not in POLICIES:
            raise ValueError(f"meta_server.policy must be one of {POLICIES}, got {self.policy!r}")
        for name in ("local_prefill_max_tokens", "prefill_queue_threshold"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"meta_server.{name} must be an integer >= 0 (0 = off), got {value!r}")
        if self.ttl_seconds <= 0:
            raise ValueError(f"meta_server.ttl_seconds must be > 0, got {self.ttl_seconds}")

    @property
    def address(self) -> str:
        return f"{self.advertise_host or self.host}:{self.port}"


@dataclass(frozen=True)
class GatewayConfig:
    """max_migrations: how many times one request may move to another decode node after
    its stream broke mid-way (the node died or stopped); 0 = never (the client gets
    UNAVAILABLE). api_keys_file: the keys clients send as `authorization: Bearer KEY`
    (services/security); without one (and no $PDMESH_API_KEYS_FILE) the public API is open
    to anyone who reaches the port. http_port: the OpenAI-compatible HTTP API
    (services/gateway/openai_http) on the same host and keys; 0 = off."""

    meta_addresses: tuple[str, ...] = ()   # every meta-server, to follow the leader; () = meta_server
    host: str = "127.0.0.1"
    port: int = 50050
    max_migrations: int = 3
    api_keys_file: str = ""             # one client key per line; "" = $PDMESH_API_KEYS_FILE, else open
    metrics_port: int = 0               # GET /metrics on host (0 = off)
    http_port: int = 0                  # the OpenAI-compatible HTTP API on host (0 = off)

    def __post_init__(self) -> None:
        check_metrics_port("gateway", self.metrics_port)
        check_optional_port("gateway.http_port", self.http_port)
        if not isinstance(self.max_migrations, int) or self.max_migrations < 0:
            raise ValueError(f"gateway.max_migrations must be an integer >= 0, got {self.max_migrations!r}")


@dataclass(frozen=True)
class NodeConfig:
    """host is where the node binds; it registers `advertised_host`:port with the
    meta-server (advertise_host when set, else host). engine: this node's engine fields
    over the mesh's `engine` section (e.g. {tensor_parallel_size: 2} on one prefill node,
    a bigger num_blocks on the decode nodes); the model is the mesh's."""

    role: str
    node_id: str
    host: str = "127.0.0.1"
    port: int = 0
    max_queue: int = 256                # waiting requests before RESOURCE_EXHAUSTED
    advertise_host: str = ""            # "" = host
    metrics_port: int = 0               # GET /metrics on host (0 = off)
    engine: dict[str, Any] = dataclasses.field(default_factory=dict)   # over the mesh's engine section

    @property
    def advertised_host(self) -> str:
        return self.advertise_host or self.host

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"nodes[].role must be one of {ROLES}, got {self.role!r}")
        check_metrics_port(f"nodes[{self.node_id}]", self.metrics_port)
        if not isinstance(self.engine, dict):
            raise ValueError(f"nodes[{self.node_id}].engine must be a mapping of engine fields, "
                             f"got {type(self.engine).__name__}")
        allowed = {f.name for f in dataclasses.fields(EngineConfig)} - {"model", "model_id"}
        unknown = sorted(set(self.engine) - allowed)
        if unknown:
            raise ValueError(f"nodes[{self.node_id}].engine: unknown field(s) {unknown}; allowed: {sorted(allowed)}")
        for name in MESH_WIDE_ENGINE_FIELDS & set(self.engine):
            raise ValueError(f"nodes[{self.node_id}].engine.{name} is mesh-wide: it changes the embeddings, so "
                             f"the KV every node writes; set it in the mesh's engine section")


@dataclass(frozen=True)
class KVStoreConfig:
    """The kv-store service (services/kv_store). Each key space (model x KV layout) gets a
    pool of capacity_mb, at most max_spaces of them. Nodes and the meta-server dial
    `address` (advertise_host when set, else host)."""

    host: str = "127.0.0.1"
    port: int = 50080
    advertise_host: str = ""
    capacity_mb: float = 512.0
    max_spaces: int = 4
    high_watermark: float = 0.9         # evict when used slots would pass this fraction ...
    low_watermark: float = 0.7          # ... down to this one
    redis_url: str = ""                 # redis://HOST:PORT/DB: evicted blocks spill there
    redis_ttl_s: float = 0.0            # expiry of spilled blocks in Redis (0 = none)
    metrics_port: int = 0               # GET /metrics on host (0 = off)

    def __post_init__(self) -> None:
        check_metrics_port("kv_store", self.metrics_port)
        if self.capacity_mb <= 0:
            raise ValueError(f"kv_store.capacity_mb must be > 0, got {self.capacity_mb}")
        if self.max_spaces < 1:
            raise ValueError(f"kv_store.max_spaces must be >= 1, got {self.max_spaces}")
        if not 0 < self.low_watermark <= self.high_watermark <= 1:
            raise ValueError("kv_store watermarks must satisfy 0 < low_watermark <= high_watermark <= 1, "
                             f"got {self.low_watermark}, {self.high_watermark}")
        if self.redis_url and not self.redis_url.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError(f"kv_store.redis_url must start with redis://, rediss:// or unix://, "
                             f"got {self.redis_url!r}")

    @property
    def address(self) -> str:
        return f"{self.advertise_host or self.host}:{self.port}"


@dataclass(frozen=True)
class LimitsConfig:
    """Bounds on one public request (section `limits:`), checked by the gateway before any
    work (the prompt's bytes before it is tokenized); beyond one: INVALID_ARGUMENT naming
    the field and the limit. The prompt's tokens are bounded by max_model_len.

    max_prompt_bytes        a text prompt (UTF-8) or a Tokenize text
    max_prompt_token_ids    a prompt given as token ids (also <= max_model_len)
    max_stop_strings        entries of sampling.stop ...
    max_stop_string_bytes   ... and the bytes of each
    max_stop_token_ids      entries of sampling.stop_token_ids
    max_request_id_bytes    request_id
    tokenizer_threads       the pool that tokenizes off the event loop (at most 5 x as many
                            texts in it at once: beyond, RESOURCE_EXHAUSTED)
    """

    max_prompt_bytes: int = 1 << 20
    max_prompt_token_ids: int = 1 << 20
    max_stop_strings: int = 16
    max_stop_string_bytes: int = 256
    max_stop_token_ids: int = 256
    max_request_id_bytes: int = 256
    tokenizer_threads: int = 2

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"limits.{f.name} must be an integer >= 1, got {value!r}")


@dataclass(frozen=True)
class SecurityConfig:
    """Where this mesh's secrets are (section `security:`; services/security reads them).
    Each "" falls back to an environment variable, and a secret itself may also come in
    the environment (never on a command line):

    cluster_secret_file  the secret every internal RPC carries (PDMESH_CLUSTER_SECRET_FILE,
                         or the value in PDMESH_CLUSTER_SECRET); required unless tls_dir
                         is set: a service without one refuses to start.
    admin_token_file     the token of pdmesh.v1.MetaAdmin (PDMESH_ADMIN_TOKEN_FILE or
                         PDMESH_ADMIN_TOKEN); without one every admin call is refused.
    tls_dir              TLS on every gRPC port, mTLS between services, with the files
                         `pdmesh certs init DIR` writes (PDMESH_TLS_DIR); "" = plaintext.
    allow_plaintext      false: a service without TLS refuses to start when it would bind
                         anything but a loopback address (0.0.0.0, ::, a LAN address, a host
                         name), since anyone who reaches the port reads the secrets and the
                         traffic off the wire (services/security/bind_policy.py); true: the
                         network is the mesh's own. Loopback binds never need it.

    `pdmesh up` without any of them makes fresh ones per mesh under its log dir.
    """

    cluster_secret_file: str = ""
    admin_token_file: str = ""
    tls_dir: str = ""
    allow_plaintext: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.allow_plaintext, bool):
            raise ValueError(f"security.allow_plaintext must be true or false, got {self.allow_plaintext!r}")


@dataclass(frozen=True)
class MeshConfig:
    """A whole mesh (deploy/local.yaml). Every service reads the part it needs."""

    model: str
    model_id: str = ""
    tiny_arch: str = ""                 # make the model folder with the tiny maker if missing
    pull: str = ""                      # or pull this known model into it (pdmesh models list)
    cluster: str = "local"
    engine: dict[str, Any] = dataclasses.field(default_factory=dict)
    meta: MetaConfig = MetaConfig()
    gateway: GatewayConfig = GatewayConfig()
    nodes: tuple[NodeConfig, ...] = ()
    transfer: TransferConfig = TransferConfig()
    etcd_endpoint: str = ""             # "host:port": membership and admin state in etcd
    kv_store: KVStoreConfig | None = None   # None: no kv-store in this mesh
    timeouts: TimeoutConfig = TimeoutConfig()
    limits: LimitsConfig = LimitsConfig()
    security: SecurityConfig = SecurityConfig()

    def __post_init__(self) -> None:
        if self.pull and self.tiny_arch:
            raise ValueError(f"pull ({self.pull!r}) and tiny_arch ({self.tiny_arch!r}) both say how to make the "
                             "model folder: set one")
        if self.pull:
            from common.model.catalog import known_model
            known_model(self.pull)   # ValueError naming the known ones
        if self.engine.get("borrow_cores"):
            raise ValueError("engine.borrow_cores would lend cores to every node: set it in a decode "
                             "node's own section (nodes[].engine.borrow_cores)")
        for node in self.nodes:
            if node.role != "decode" and (node.engine or {}).get("borrow_cores"):
                raise ValueError(f"nodes[{node.node_id}].engine.borrow_cores: only a decode node borrows "
                                 f"cores, this node's role is {node.role}")

    def engine_config(self, node: NodeConfig | None = None) -> EngineConfig:
        """The engine of `node` (the mesh's engine section, then the node's own fields), or
        the mesh's when node is None. ValueError naming the node's section when its
        fields are the bad ones."""
        args = {"model_id": self.resolved_model_id, **self.engine}
        if node is None:
            return EngineConfig.from_kwargs(self.model, **args)
        base = EngineConfig.from_kwargs(self.model, **args)   # the mesh's own fields are checked first
        try:
            config = dataclasses.replace(base, **node.engine) if node.engine else base
        except (ValueError, TypeError) as e:
            raise ValueError(f"nodes[{node.node_id}].engine: {e}") from None
        if config.w8a8_mix_path == "auto":     # a W8A8_MIX checkpoint: decode static, prefill dynamic
            config = dataclasses.replace(config, w8a8_mix_path="static" if node.role == "decode" else "dynamic")
        return config

    def etcd_config(self):
        """A common.cluster EtcdConfig for etcd_endpoint and cluster; None without etcd."""
        if not self.etcd_endpoint:
            return None
        from common.cluster.etcd import EtcdConfig
        return EtcdConfig(endpoint=self.etcd_endpoint, cluster=self.cluster)

    @property
    def resolved_model_id(self) -> str:
        from pathlib import Path
        return self.model_id or Path(self.model).name

    def node(self, node_id: str) -> NodeConfig:
        for n in self.nodes:
            if n.node_id == node_id:
                return n
        raise ValueError(f"node_id must be one of {[n.node_id for n in self.nodes]}, got {node_id!r}")


def _section(cls, raw: Any, name: str):
    if raw is None:
        return cls()
    if not isinstance(raw, dict):
        raise ValueError(f"{name} must be a mapping, got {type(raw).__name__}")
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise ValueError(f"{name}: unknown field(s) {unknown}; allowed: {sorted(known)}")
    return cls(**raw)


def mesh_config_from_dict(raw: dict[str, Any], base_dir: str = ".") -> MeshConfig:
    """Build a MeshConfig; relative model paths are taken from base_dir."""
    from pathlib import Path
    known = {"model", "model_id", "tiny_arch", "pull", "cluster", "engine", "meta_server", "gateway",
             "nodes", "transfer", "etcd_endpoint", "kv_store", "timeouts", "limits", "security"}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise ValueError(f"unknown top-level field(s) {unknown}; allowed: {sorted(known)}")
    if "model" not in raw:
        raise ValueError("model (the model folder) is required")
    model = Path(raw["model"])
    if not model.is_absolute():
        model = Path(base_dir) / model
    nodes = tuple(_section(NodeConfig, n, f"nodes[{i}]") for i, n in enumerate(raw.get("nodes") or []))
    return MeshConfig(
        model=str(model), model_id=raw.get("model_id", ""), tiny_arch=raw.get("tiny_arch", ""),
        pull=str(raw.get("pull", "") or ""),
        cluster=raw.get("cluster", "local"), engine=dict(raw.get("engine") or {}),
        meta=_section(MetaConfig, raw.get("meta_server"), "meta_server"),
        gateway=_section(GatewayConfig, raw.get("gateway"), "gateway"),
        nodes=nodes, transfer=_section(TransferConfig, raw.get("transfer"), "transfer"),
        etcd_endpoint=str(raw.get("etcd_endpoint", "")),
        kv_store=_section(KVStoreConfig, raw["kv_store"], "kv_store") if "kv_store" in raw else None,
        timeouts=_section(TimeoutConfig, raw.get("timeouts"), "timeouts"),
        limits=_section(LimitsConfig, raw.get("limits"), "limits"),
        security=_section(SecurityConfig, raw.get("security"), "security"))


def load_mesh_config(path: str) -> MeshConfig:
    """Read a mesh YAML; relative paths in it are relative to the working directory."""
    import yaml
    with open(path) as f:
        raw = yaml.safe_load(f) or {}
    try:
        return mesh_config_from_dict(raw)
    except (ValueError, TypeError) as e:
        raise ValueError(f"{path}: {e}") from None
