"""The node runtime: what an engine node (prefill, decode, both) runs besides its
servicer (engine_node), its start-up (node_server), its membership (node_registration),
and the gRPC server and channel settings every pdmesh process shares (grpc_util)."""
