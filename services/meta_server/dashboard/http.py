"""The dashboard's HTTP server: a minimal HTTP/1.1 GET server on the meta-server's event
loop (asyncio.start_server; one request per connection, no keep-alive).

    server = await serve_dashboard(view, admin_token, host, port)   # None when port is 0
    server.port                                                     # the bound port
    await server.close()

Routes:
    GET /dashboard      the page (dashboard.html: inline CSS and JS, no external resource,
                        no data); it polls /api/cluster every second with the token
    GET /api/cluster    ClusterView.snapshot() as JSON
    anything else       404; a method other than GET/HEAD 405

Auth: the JSON shows cluster internals, so it needs the admin token (the one `pdmesh
admin` sends) as `Authorization: Bearer TOKEN`, never in the URL (where logs, history
and Referer headers keep it). The page holds no data and is served without one; it is
opened as /dashboard#token=TOKEN (a fragment: the browser never sends it) or asks for
the token, and sends it as that header. No admin token configured -> /api/cluster is
refused (403), as the admin API is off then. It binds on
meta_server.host only; it is plain HTTP, so keep that host on a trusted network (TLS on
the gRPC ports does not cover it).
"""
from __future__ import annotations

import asyncio
import hmac
import json
import logging
from importlib import resources
from urllib.parse import urlsplit

log = logging.getLogger("pdmesh.meta")
MAX_REQUEST_BYTES = 16 * 1024
READ_TIMEOUT_S = 10.0
REASONS = {200: "OK", 400: "Bad Request", 401: "Unauthorized", 403: "Forbidden", 404: "Not Found",
           405: "Method Not Allowed", 500: "Internal Server Error"}


def page_html() -> bytes:
    return resources.files("services.meta_server.dashboard").joinpath("dashboard.html").read_bytes()


def _response(status: int, body: bytes, content_type: str, head_only: bool = False,
              extra: tuple[tuple[str, str], ...] = ()) -> bytes:
    lines = [f"HTTP/1.1 {status} {REASONS[status]}", f"Content-Type: {content_type}",
             f"Content-Length: {len(body)}", "Cache-Control: no-store", "Connection: close",
             "X-Content-Type-Options: nosniff", "Referrer-Policy: no-referrer", *(f"{k}: {v}" for k, v in extra)]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + (b"" if head_only else body)


def _error(status: int, message: str, head_only: bool = False) -> bytes:
    extra = (("WWW-Authenticate", 'Bearer realm="pdmesh-admin"'),) if status == 401 else ()
    return _response(status, json.dumps({"error": message}).encode(), "application/json", head_only, extra)


class DashboardServer:
    def __init__(self, view, admin_token: bytes | None):
        self.view, self.admin_token = view, admin_token
        self._server: asyncio.AbstractServer | None = None
        self.port = 0
        self._page = page_html()

    def authorized(self, headers: dict[str, str]) -> int:
        """0 when allowed, else the status to answer (401 no/wrong token, 403 none configured)."""
        if self.admin_token is None:
            return 403
        auth = headers.get("authorization", "")
        token = auth[7:].strip() if auth[:7].lower() == "bearer " else ""
        return 0 if token and hmac.compare_digest(token.encode(), self.admin_token) else 401

    async def answer(self, method: str, target: str, headers: dict[str, str]) -> bytes:
        head = method == "HEAD"
        if method not in ("GET", "HEAD"):
            return _error(405, "only GET is served", head)
        url = urlsplit(target)
        if url.path not in ("/dashboard", "/dashboard/", "/api/cluster"):
            return _error(404, "not found: GET /dashboard or /api/cluster", head)
        if url.path != "/api/cluster":
            return _response(200, self._page, "text/html; charset=utf-8", head)
        refused = self.authorized(headers)
        if refused == 403:
            return _error(403, "the dashboard is off: this meta-server has no admin token configured", head)
        if refused:
            return _error(401, "missing or wrong admin token: send `Authorization: Bearer TOKEN`", head)
        body = json.dumps(await self.view.snapshot()).encode()
        return _response(200, body, "application/json", head)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            try:
                raw = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), READ_TIMEOUT_S)
            except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, asyncio.TimeoutError):
                return
            lines = raw.decode("latin-1").split("\r\n")
            parts = lines[0].split(" ")
            if len(parts) != 3 or not parts[2].startswith("HTTP/"):
                writer.write(_error(400, "bad request line"))
            else:
                headers = {}
                for line in lines[1:]:
                    name, sep, value = line.partition(":")
                    if sep:
                        headers[name.strip().lower()] = value.strip()
                try:
                    writer.write(await self.answer(parts[0], parts[1], headers))
                except Exception:      # a bug in building the view must not kill the server
                    log.exception("dashboard: %s %s failed", parts[0], parts[1])
                    writer.write(_error(500, "internal error"))
            await writer.drain()
        except ConnectionError:
            pass
        finally:
            writer.close()

    async def start(self, host: str, port: int) -> None:
        self._server = await asyncio.start_server(self._handle, host, port, limit=MAX_REQUEST_BYTES)
        self.port = self._server.sockets[0].getsockname()[1]

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
        await self.view.close()


async def serve_dashboard(view, admin_token: bytes | None, host: str, port: int) -> DashboardServer | None:
    """Serve on host:port; None (and the view closed) when port is 0 or already taken (a
    standby meta-server on the same host as the leader: the leader's page shows it all)."""
    if not port:
        await view.close()
        return None
    server = DashboardServer(view, admin_token)
    try:
        await server.start(host, port)
    except OSError as e:
        log.warning("dashboard: cannot listen on %s:%d (%s); serving without it", host, port, e)
        await view.close()
        return None
    log.info("dashboard at http://%s:%d/dashboard#token=ADMIN_TOKEN", host, server.port)
    return server
