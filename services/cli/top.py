"""`pdmesh top [--dashboard URL] [--once]`: the meta-server's KV-memory dashboard in the
terminal, a `rich` live table refreshed every second from GET /api/cluster (the same
JSON the page draws: services/meta_server/dashboard/cluster_view.py).

--dashboard: http://HOST:PORT or HOST:PORT of meta_server.dashboard_port; default
$PDMESH_DASHBOARD, else the mesh `pdmesh up` is running (when its config sets a
dashboard_port). The admin token comes from --token-file, $PDMESH_ADMIN_TOKEN(_FILE), or,
for the running mesh's own dashboard, its credentials. --once prints one table and exits.
Under the table, one line per Mixture-of-Experts node: its HOT_EXPERTS most loaded experts,
each as layer, expert and its share of that layer's routed tokens since the node started
(expert_lines). Exit code 0; 1 when the dashboard cannot be read at start (the reason on
stderr). Once running, a failed refresh keeps the last table on screen under a red line
with the reason (and the time it started failing), and it tries again every interval.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import urllib.error
import urllib.request

SEGMENTS = ("used", "quarantined", "cached", "free")
COLORS = {"used": "red", "quarantined": "magenta", "cached": "yellow", "free": "green"}
STATE_STYLE = {"up": "green", "draining": "yellow", "down": "red"}
BAR_WIDTH = 30
HOT_EXPERTS = 3


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("top", help="live KV memory of the mesh (the meta-server's dashboard)",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dashboard", default=os.environ.get("PDMESH_DASHBOARD", ""), metavar="URL",
                   help="the meta-server's dashboard, http://HOST:PORT (meta_server.dashboard_port)")
    p.add_argument("--token-file", default="", help="file holding the admin token")
    p.add_argument("--once", action="store_true", help="print one table and exit")
    p.add_argument("--interval", type=float, default=1.0, help="seconds between refreshes (default 1)")
    return p


def cluster_url(dashboard: str) -> str:
    base = dashboard if "://" in dashboard else f"http://{dashboard}"
    return base.rstrip("/").removesuffix("/dashboard") + "/api/cluster"


def fetch(url: str, token: str | None, timeout_s: float = 5.0) -> dict:
    """The /api/cluster document. RuntimeError with the reason when it cannot be read."""
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as reply:
            return json.loads(reply.read())
    except urllib.error.HTTPError as e:
        detail = e.read().decode(errors="replace")
        try:
            detail = json.loads(detail).get("error", detail)
        except ValueError:
            pass
        raise RuntimeError(f"{url}: HTTP {e.code}: {detail}") from None
    except (urllib.error.URLError, OSError, ValueError) as e:
        raise RuntimeError(f"{url}: {getattr(e, 'reason', e)}") from None


def _bar(blocks: dict):
    from rich.text import Text
    total = blocks["total"] or 1
    widths = [round(BAR_WIDTH * blocks[k] / total) for k in SEGMENTS]
    widths[-1] = max(BAR_WIDTH - sum(widths[:-1]), 0)
    bar = Text()
    for key, width in zip(SEGMENTS, widths):
        bar.append("█" * width, style=COLORS[key])
    return bar


def _rate(b: float) -> str:
    for unit, scale in (("GB/s", 1e9), ("MB/s", 1e6), ("kB/s", 1e3)):
        if b >= scale:
            return f"{b / scale:.2f} {unit}"
    return f"{b:.0f} B/s"


def hot_experts(experts: dict, n: int = HOT_EXPERTS) -> list[tuple[int, int, float]]:
    """A node's "experts" entry -> its n most loaded (layer, expert, share of the layer's
    tokens), the highest share first (ties: lower layer, then lower expert); layers that
    routed nothing are left out."""
    ranked = []
    for layer, row in zip(experts["layers"], experts["num_tokens"]):
        total = sum(row)
        ranked += [(layer, expert, count / total) for expert, count in enumerate(row) if total]
    ranked.sort(key=lambda t: (-t[2], t[0], t[1]))
    return ranked[:n]


def expert_lines(doc: dict, n: int = HOT_EXPERTS) -> list[str]:
    """One line per MoE node (the nodes' order), e.g.
    `decode-0 hot experts: L2 E5 31.2% · L0 E3 28.1% · L1 E7 25.0%` (share of the layer's tokens)."""
    lines = []
    for node in doc["nodes"]:
        if "experts" not in node:
            continue
        hot = hot_experts(node["experts"], n)
        shown = " · ".join(f"L{layer} E{expert} {100 * share:.1f}%" for layer, expert, share in hot)
        lines.append(f"{node['node_id']} hot experts: {shown or 'no token routed yet'}")
    return lines


def render(doc: dict):
    """A rich Table of the /api/cluster document (one row per node, a summary caption),
    followed by the expert_lines when a node serves a MoE model."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text
    r = doc["router"]
    kv = doc.get("kv_store")
    if kv is None:
        store = "kv-store: none"
    elif not kv.get("reachable"):
        store = f"kv-store {kv['address']}: unreachable"
    else:
        redis = ("off" if not kv["redis_configured"] else
                 f"{'up' if kv['redis_up'] else 'DOWN'}, {kv['redis_spilled']} spilled")
        store = f"kv-store: {kv['blocks_used']}/{kv['blocks_total']} blocks, {kv['hits']} hits; Redis {redis}"
    t = doc["totals"]
    table = Table(title=f"pdmesh · policy {doc['policy']} · {'routing' if doc['leader'] else 'standby'}",
                  caption=(f"blocks used {t['used']} · quarantined {t['quarantined']} · cached {t['cached']} · "
                           f"free {t['free']} of {t['total']} · prefix hit rate {100 * r['prefix_hit_rate']:.1f}% · "
                           f"transfer {_rate(doc['transfer_bytes_per_s'])} · {store}"))
    for column in ("node", "role", "state", "address", "run", "wait"):
        table.add_column(column)
    table.add_column("KV blocks (used/quar./cached/free)", no_wrap=True)
    for column in ("used", "quar.", "cached", "free", "xfer"):
        table.add_column(column, justify="right")
    for n in doc["nodes"]:
        b = n["blocks"]
        state = n["state"] + (" (stalled)" if n["load"]["stalled"] else "")
        table.add_row(n["node_id"], n["role"], Text(state, style=STATE_STYLE.get(n["state"], "")), n["address"],
                      str(n["load"]["running"]), str(n["load"]["waiting"]), _bar(b),
                      *(str(b[k]) for k in SEGMENTS), _rate(n["transfer_bytes_per_s"]))
    lines = expert_lines(doc)
    return Group(table, *(Text(line) for line in lines)) if lines else table


def stale(table, why: str):
    """The last table, under a line saying why it is not being refreshed."""
    from rich.console import Group
    from rich.text import Text
    return Group(Text(why, style="bold red"), table)


def run(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.live import Live
    from services.security.client_creds import admin_token, mesh_address
    dashboard, recorded = args.dashboard, False
    if not dashboard:
        dashboard, recorded = mesh_address("dashboard"), True
    if not dashboard:
        print("pdmesh top: no dashboard: pass --dashboard http://HOST:PORT (meta_server.dashboard_port)",
              file=sys.stderr)
        return 1
    url = cluster_url(dashboard)
    token = admin_token(args.token_file, address="" if recorded else url)
    console = Console()
    try:
        if args.once:
            console.print(render(fetch(url, token)))
            return 0
        last = fetch(url, token)
        with Live(render(last), console=console, refresh_per_second=4) as live:
            failing_since = None
            while True:
                time.sleep(args.interval)
                try:
                    last, failing_since = fetch(url, token), None
                    live.update(render(last))
                except RuntimeError as e:   # e.g. the meta-server restarting: keep the last table
                    failing_since = failing_since or time.strftime("%H:%M:%S")
                    live.update(stale(render(last), f"unreachable since {failing_since}: {e}; retrying"))
    except RuntimeError as e:
        print(f"pdmesh top: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0
