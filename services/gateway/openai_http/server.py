"""uvicorn serving the HTTP API as a task of the running event loop (the gateway's, the
one its gRPC server and every RequestStream run on).

start() binds host:port itself (RuntimeError when taken, as the gRPC bind does, instead
of uvicorn's sys.exit) and returns once uvicorn accepts connections. With the mesh's TLS
credentials it serves HTTPS with the gateway's certificate. uvicorn installs no signal
handlers here: the gateway process owns SIGINT/SIGTERM and calls stop(grace), which
stops accepting, lets running responses finish for `grace` seconds and then cancels
them (a cancelled stream cancels its requests: app.py). Event loop only.
"""
from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import ssl
import tempfile

import uvicorn

from services.gateway.openai_http.body_limit import MAX_BODY_BYTES, MAX_CONCURRENCY, BodyLimit
from common.bind_error import BindError


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self):
        yield   # the gateway process handles its signals


class HttpServer:
    def __init__(self, app, host: str, port: int, tls=None, max_body_bytes: int = MAX_BODY_BYTES):
        """tls: services.security.credentials.TLSFiles with the gateway's certificate, or None;
        bodies past max_body_bytes get 413 (body_limit.py)."""
        self.app, self.host, self.port, self.tls = app, host, port, tls
        self.max_body_bytes = max_body_bytes
        self._server: _Server | None = None
        self._task: asyncio.Task | None = None

    @property
    def url(self) -> str:
        scheme = "https" if self.tls is not None else "http"
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{scheme}://{host}:{self.port}"

    async def start(self) -> int:
        """Serve; returns the bound port. BindError if host:port cannot be bound."""
        sock = _bind(self.host, self.port)
        self.port = sock.getsockname()[1]
        config = uvicorn.Config(BodyLimit(self.app, self.max_body_bytes), log_config=None, access_log=False, lifespan="off",
                                timeout_graceful_shutdown=1, server_header=False,
                                limit_concurrency=MAX_CONCURRENCY)
        config.load()
        if self.tls is not None:
            config.ssl = _ssl_context(self.tls)
        self._server = _Server(config)
        self._task = asyncio.ensure_future(self._server.serve(sockets=[sock]))
        while not self._server.started:
            if self._task.done():
                sock.close()
                self._task.result()   # its error
                raise RuntimeError(f"the HTTP server on {self.host}:{self.port} stopped at start")
            await asyncio.sleep(0.01)
        return self.port

    async def stop(self, grace: float | None = 1.0) -> None:
        if self._server is None or self._task is None:
            return
        self._server.config.timeout_graceful_shutdown = max(grace or 0.0, 0.0)
        self._server.should_exit = True
        with contextlib.suppress(asyncio.CancelledError, SystemExit):
            await self._task


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise BindError(f"cannot bind the HTTP API to {host}:{port} ({e.strerror})") from None
    return sock


def _ssl_context(tls) -> ssl.SSLContext:
    """A server context from PEM bytes (ssl loads a chain from files only: written to a
    private temporary folder and removed at once)."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    with tempfile.TemporaryDirectory(prefix="pdmesh-http-tls-") as folder:
        cert, key = os.path.join(folder, "cert.pem"), os.path.join(folder, "key.pem")
        for path, data in ((cert, tls.cert), (key, tls.key)):
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(data)
        ctx.load_cert_chain(cert, key)
    return ctx
