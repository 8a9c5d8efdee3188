"""gRPC metadata keys that are part of a contract between two services (besides the
protos): both sides import them from here, never from each other's package."""

# Trailing metadata of a Prefill call's status that the prefill node itself answered after
# every KV write of the call had ended (or could no longer start): the decode node may
# then reuse the destination blocks at once (services/decode/remote_prefill.py).
WRITES_SETTLED_KEY = "pdmesh-writes-settled"
