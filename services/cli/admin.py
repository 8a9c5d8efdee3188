"""`pdmesh admin ACTION --meta HOST:PORT [--json]`: see and steer a running mesh through
the meta-server's pdmesh.v1.MetaAdmin API.

    nodes            every node: role, state (up|draining|down), load, blocks, model, and
                     where its transfer engine listens (0.0.0.0 / [::]: every interface)
    drain NODE       no new requests to NODE; its in-flight ones finish
    undrain NODE     route to NODE again
    remove NODE      forget NODE (a live node comes back by registering again; drain it
                     to keep it out of service)
    policy [NAME]    show, or set to round_robin | least_load | cache_aware
    stats            requests routed (total, per node), cluster free/total blocks
    planner          the planner's last decision: per role the nodes now, the formula's
                     count, the count to run and why, and the load it read (docs/planner.md)

A readable table by default, JSON with --json. --meta defaults to $PDMESH_META, else the
mesh `pdmesh up` is running, else 127.0.0.1:50051. The admin token comes from
--token-file, $PDMESH_ADMIN_TOKEN(_FILE) or the running mesh's credentials; with TLS
(--tls-dir, $PDMESH_TLS_DIR or the running mesh's) the CA and admin.crt/admin.key of that
folder are used. Exit code 0; on an RPC error the status and message go to stderr and
the code is 2 for INVALID_ARGUMENT, 1 otherwise.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

ACTIONS = ("nodes", "drain", "undrain", "remove", "policy", "stats", "planner")


def add_parser(subparsers) -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--meta", default=os.environ.get("PDMESH_META", ""), metavar="HOST:PORT",
                        help="meta-server address (default: the running mesh's, else 127.0.0.1:50051)")
    common.add_argument("--token-file", default="", help="file holding the admin token")
    common.add_argument("--tls-dir", default="", help="folder of `pdmesh certs init` (TLS on)")
    common.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p = subparsers.add_parser("admin", help="inspect and steer a running mesh", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    actions = p.add_subparsers(dest="action", metavar="ACTION", required=True)
    actions.add_parser("nodes", parents=[common], help="list nodes")
    for name, text in (("drain", "stop routing new requests to a node"),
                       ("undrain", "route to a drained node again"), ("remove", "forget a node")):
        actions.add_parser(name, parents=[common], help=text).add_argument("node_id", metavar="NODE")
    actions.add_parser("policy", parents=[common], help="show or set the routing policy").add_argument(
        "name", nargs="?", default="", metavar="NAME")
    actions.add_parser("stats", parents=[common], help="routing counts and cluster blocks")
    actions.add_parser("planner", parents=[common], help="the planner's last decision and why")
    return p


def node_dict(s) -> dict:
    load = s.info.load
    return {"node_id": s.info.node_id, "role": s.info.role, "address": s.info.address,
            "state": s.state, "running": load.running, "waiting": load.waiting,
            "free_blocks": load.free_blocks, "total_blocks": load.total_blocks,
            "model": s.info.model_id, "num_routed": s.num_routed,
            "transfer_listen": list(s.info.transfer_listen_addresses),
            "seconds_since_heartbeat": round(s.seconds_since_heartbeat, 3)}


def stats_dict(s) -> dict:
    return {"policy": s.policy, "num_routed": s.num_routed, "num_local_prefill": s.num_local_prefill,
            "free_blocks": s.free_blocks, "total_blocks": s.total_blocks,
            "nodes": [{"node_id": n.node_id, "role": n.role, "num_routed": n.num_routed} for n in s.nodes]}


def table(headers: list[str], rows: list[list]) -> str:
    cells = [headers, *[[str(c) for c in r] for r in rows]]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in cells)


def nodes_table(nodes: list[dict]) -> str:
    rows = [[n["node_id"], n["role"], n["state"], n["address"], n["running"], n["waiting"],
             f'{n["free_blocks"]}/{n["total_blocks"]}', n["num_routed"],
             f'{n["seconds_since_heartbeat"]:.1f}s', n["model"], ",".join(n["transfer_listen"]) or "-"]
            for n in nodes]
    return table(["NODE", "ROLE", "STATE", "ADDRESS", "RUNNING", "WAITING", "FREE/TOTAL",
                  "ROUTED", "LAST SEEN", "MODEL", "TRANSFER LISTENS ON"], rows)


def stats_text(s: dict) -> str:
    head = (f'policy: {s["policy"]}\nrequests routed: {s["num_routed"]} '
            f'({s["num_local_prefill"]} prefilled locally)\n'
            f'cluster blocks: {s["free_blocks"]} free / {s["total_blocks"]} total')
    rows = [[n["node_id"], n["role"], n["num_routed"]] for n in s["nodes"]]
    return head + "\n\n" + table(["NODE", "ROLE", "ROUTED"], rows)


def _call(stub, args) -> tuple[object, str]:
    """Run the action; returns (JSON-able result, its readable text)."""
    from protos.pdmesh.v1 import meta_pb2 as pb
    if args.action == "nodes":
        nodes = [node_dict(s) for s in stub.ListNodes(pb.ListNodesRequest(), timeout=5).nodes]
        return nodes, nodes_table(nodes) if nodes else "no nodes"
    if args.action in ("drain", "undrain"):
        rpc, req = ((stub.DrainNode, pb.DrainNodeRequest) if args.action == "drain"
                    else (stub.UndrainNode, pb.UndrainNodeRequest))
        reply = rpc(req(node_id=args.node_id), timeout=5)
        if not reply.HasField("node"):
            return {"node_id": args.node_id, "state": ""}, f"{args.node_id}: undrained (not registered now)"
        node = node_dict(reply.node)
        return node, (f'{node["node_id"]}: {node["state"]} ({node["running"]} running, '
                      f'{node["waiting"]} waiting)')
    if args.action == "remove":
        stub.RemoveNode(pb.RemoveNodeRequest(node_id=args.node_id), timeout=5)
        return {"removed": args.node_id}, f"{args.node_id}: removed"
    if args.action == "policy":
        if args.name:
            reply = stub.SetPolicy(pb.SetPolicyRequest(policy=args.name), timeout=5)
        else:
            reply = stub.GetPolicy(pb.GetPolicyRequest(), timeout=5)
        result = {"policy": reply.policy, "allowed": list(reply.allowed)}
        return result, f'policy: {reply.policy} (allowed: {", ".join(reply.allowed)})'
    if args.action == "planner":
        from services.cli.planner_view import planner_dict, planner_text
        planner = planner_dict(stub.GetPlanner(pb.GetPlannerRequest(), timeout=5))
        return planner, planner_text(planner)
    s = stats_dict(stub.GetStats(pb.GetStatsRequest(), timeout=5))
    return s, stats_text(s)


def run(args: argparse.Namespace) -> int:
    import grpc

    from protos.pdmesh.v1 import meta_pb2_grpc
    from services.security.client_creds import mesh_address, operator_channel
    from services.security.credentials import MissingCredentialsError
    args.meta = args.meta or mesh_address("meta") or "127.0.0.1:50051"
    try:
        channel = operator_channel(args.meta, args.token_file, args.tls_dir)
    except MissingCredentialsError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        with channel:
            result, text = _call(meta_pb2_grpc.MetaAdminStub(channel), args)
    except grpc.RpcError as e:
        print(f"error: {args.meta}: {e.code().name}: {e.details()}", file=sys.stderr)
        return 2 if e.code() == grpc.StatusCode.INVALID_ARGUMENT else 1
    print(json.dumps(result, indent=2) if args.json else text)
    return 0
