"""KV data plane: register the KV cache once, push blocks with batched one-sided writes, pull
them with batched one-sided reads. Backends are imported lazily through `create_transfer`."""
from common.transfer.base import Region, TransferEngine, TransferError
from common.transfer.kv_writes import KVSender, block_runs, plan_block_reads, plan_block_writes, plan_head_slice_writes
from common.transfer.factory import BACKENDS, create_transfer

__all__ = ["BACKENDS", "KVSender", "Region", "TransferEngine", "TransferError",
           "block_runs", "create_transfer", "plan_block_reads", "plan_block_writes",
           "plan_head_slice_writes"]
