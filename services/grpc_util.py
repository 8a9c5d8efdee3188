"""What every pdmesh gRPC server shares: message-size options, health and reflection."""
from __future__ import annotations

import socket

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

MAX_MESSAGE_BYTES = 64 * 1024 * 1024
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]


def new_server() -> grpc.aio.Server:
    """SO_REUSEPORT off (gRPC turns it on by default): a second server on a taken port
    must fail to bind, not silently share the port with the first."""
    return grpc.aio.server(options=[*CHANNEL_OPTIONS, ("grpc.so_reuseport", 0)])


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


def bind(server: grpc.aio.Server, host: str, port: int) -> int:
    """Bind host:port (0 = a free port); returns the port. RuntimeError if taken."""
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise RuntimeError(f"cannot bind {host}:{port} (address in use?)")
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


def channel(address: str) -> grpc.aio.Channel:
    return grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
