"""What every pdmesh gRPC server and channel shares: message-size options, health and
reflection, and the mesh's security (services/security): every server checks who calls
(AuthInterceptor) and binds with TLS when the credentials carry it; every channel from
one service to another carries the mesh's identity."""
from __future__ import annotations

import asyncio
import contextlib
import socket

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from common.bind_error import BindError
from services.security.bind_policy import check_bind
from services.security.client_auth import mesh_channel
from services.security.credentials import MeshCredentials, MissingCredentialsError, process_credentials
from services.node.malformed_requests import MalformedRequestInterceptor
from services.security.server_auth import AuthInterceptor

MAX_MESSAGE_BYTES = 64 * 1024 * 1024
# Back-pressure of the request plane. A client keeps at most MAX_CALLS_PER_PEER calls in
# flight to one peer (more fail at once with RESOURCE_EXHAUSTED, a retryable answer, not a
# queue that grows without bound); a server runs at most MAX_CONCURRENT_RPCS calls at once
# (gRPC answers RESOURCE_EXHAUSTED beyond). Both are far above what the engines admit
# (max_num_seqs + max_queue), so they bite only on a runaway client.
MAX_CALLS_PER_PEER = 2048
MAX_CONCURRENT_RPCS = 8192
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]


def new_server(credentials: MeshCredentials | None = None, public: bool = False) -> grpc.aio.Server:
    """A server that admits only the callers `credentials` (default: the process's) allow.
    public: the gateway's port (clients connect without a certificate); every other port
    asks its peers for one when TLS is on (mTLS). MissingCredentialsError when the
    credentials carry no mesh identity. SO_REUSEPORT off (gRPC turns it on by default): a
    second server on a taken port must fail to bind, not silently share the port."""
    creds = credentials or process_credentials()
    if not creds.has_identity:
        raise MissingCredentialsError(
            "no cluster secret: set security.cluster_secret_file (or $PDMESH_CLUSTER_SECRET_FILE / "
            "$PDMESH_CLUSTER_SECRET), or security.tls_dir; `pdmesh up` makes them for you")
    mtls = creds.tls is not None and not public
    server = grpc.aio.server(options=[*CHANNEL_OPTIONS, ("grpc.so_reuseport", 0)],
                             interceptors=[AuthInterceptor(creds, tls_peers=mtls), MalformedRequestInterceptor()],
                             maximum_concurrent_rpcs=MAX_CONCURRENT_RPCS)
    server.pdmesh_credentials, server.pdmesh_mtls = creds, mtls
    return server


def add_health_and_reflection(server: grpc.aio.Server, service_names: list[str]) -> health.aio.HealthServicer:
    """Serve grpc.health.v1 (SERVING for "" and each service) and reflection."""
    servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    reflection.enable_server_reflection([*service_names, health.SERVICE_NAME,
                                         reflection.SERVICE_NAME], server)
    return servicer


async def mark_serving(servicer, service_names: list[str]) -> None:
    for name in ["", *service_names]:
        await servicer.set(name, health_pb2.HealthCheckResponse.SERVING)


@contextlib.asynccontextmanager
async def stopped_on_error(server: grpc.aio.Server):
    """Around what a service starts after its gRPC server (metrics, HTTP, joining the
    mesh): if that fails, the gRPC server is stopped before the error goes on, so that no
    half-started service is left listening."""
    try:
        yield
    except BaseException:
        await server.stop(None)
        raise


def bind(server: grpc.aio.Server, host: str, port: int) -> int:
    """Bind host:port (0 = a free port), with TLS when the server's credentials carry it;
    returns the port. BindError if taken; PlaintextBindError (nothing bound) when a port
    without TLS would bind a non-loopback host and the config does not allow plaintext."""
    tls = server.pdmesh_credentials.tls
    check_bind(host, port, tls is not None, server.pdmesh_credentials.allow_plaintext)
    try:
        if tls is None:
            bound = server.add_insecure_port(f"{host}:{port}")
        else:
            creds = grpc.ssl_server_credentials([(tls.key, tls.cert)], root_certificates=tls.ca,
                                                require_client_auth=server.pdmesh_mtls)
            bound = server.add_secure_port(f"{host}:{port}", creds)
    except RuntimeError:       # grpcio >= 1.59 raises where older ones returned 0
        bound = 0
    if bound == 0:
        raise BindError(f"cannot bind {host}:{port} (address in use?)")
    return bound


def port_in_use(host: str, port: int) -> bool:
    """Whether binding host:port fails now (as a gRPC server would: SO_REUSEADDR on)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return True
    return False


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


# gRPC's reconnect back-off grows to 120 s by default: a peer that restarted would stay
# unreachable for seconds after it is back. Capped so that a restarted node or
# meta-server is dialled again within half a second.
# (min_reconnect_backoff_ms is left alone: gRPC uses it as the connect timeout.)
RECONNECT_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 500),
]


def channel(address: str, credentials: MeshCredentials | None = None) -> grpc.aio.Channel:
    """A channel to another service of the mesh, carrying this process's identity."""
    return mesh_channel(address, credentials, options=[*CHANNEL_OPTIONS, *RECONNECT_OPTIONS])


def rpc_error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    """The error an RPC would raise with this status (for a call refused before it left)."""
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


class PeerLimits:
    """Counts calls in flight per peer address; acquire() beyond the limit raises
    RESOURCE_EXHAUSTED (grpc.aio.AioRpcError) at once. Event loop only."""

    def __init__(self, limit: int):
        self.limit = limit
        self.in_flight: dict[str, int] = {}

    def acquire(self, peer: str) -> "_Slot":
        n = self.in_flight.get(peer, 0)
        if n >= self.limit:
            raise rpc_error(grpc.StatusCode.RESOURCE_EXHAUSTED,
                            f"{n} calls in flight to one node already (the most this client sends); retry later")
        self.in_flight[peer] = n + 1
        return _Slot(self, peer)


class _Slot:
    def __init__(self, limits: PeerLimits, peer: str):
        self._limits, self._peer = limits, peer
        self._held = True

    def release(self) -> None:
        if self._held:
            self._held = False
            left = self._limits.in_flight[self._peer] - 1
            if left:
                self._limits.in_flight[self._peer] = left
            else:
                del self._limits.in_flight[self._peer]

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.release()


async def refuses_connections(address: str, timeout_s: float) -> bool:
    """True when every address host:port resolves to refuses a TCP connection: no process
    listens there (a stopped one still accepts: its kernel completes the handshake). False
    when one connects, or when that cannot be told (timeout, unreachable, the name does
    not resolve). Used to tell a peer that is gone (no write of it can land any more; a
    prefill node drains its writes before it stops listening) from one that is stopped."""
    host, _, port = address.rpartition(":")
    loop = asyncio.get_running_loop()
    try:
        infos = await asyncio.wait_for(loop.getaddrinfo(host.strip("[]"), int(port), type=socket.SOCK_STREAM),
                                       timeout_s)
    except (OSError, asyncio.TimeoutError, ValueError):
        return False
    for family, _, _, _, sockaddr in infos:
        try:
            _, writer = await asyncio.wait_for(asyncio.open_connection(sockaddr[0], sockaddr[1]), timeout_s)
        except ConnectionRefusedError:
            continue
        except (OSError, asyncio.TimeoutError):
            return False
        writer.close()
        return False
    return bool(infos)
