"""Test doubles for kernel backends. `fake_torch_npu` emulates the torch_npu ops that
kernels.npu uses, so the NPU backend runs (and has its argument contracts checked) on CPU."""
