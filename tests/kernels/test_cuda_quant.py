"""CudaBackend's quantized paths: the W8A8 int8 GEMM (torch._int_mm where cuBLASLt's shape
rules hold: rows padded to 17; exact float64 elsewhere) against exact integer products,
and whole quantized models on a GPU against the float64 references of their schemes
(the same references and bounds as the CPU tests). The fallback runs anywhere; the rest
needs a CUDA device (skipped without one)."""
from __future__ import annotations

import contextlib

import pytest
import torch

from common.engine import LLM
from common.model.tiny import make_tiny_model
from kernels.cuda import CudaBackend
from tests.c8_checkpoints import c8_reference, patched, write_c8
from tests.msmodelslim_checkpoints import reference_model, write_msmodelslim
from tests.quant_checkpoints import (
    kl,
    w4a16_reference_model,
    w8a8_reference_model,
    write_compressed_tensors_w4a16,
    write_compressed_tensors_w8a8,
)

GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
IDS = [1, 17, 400, 9, 23, 610, 5, 77, 301, 12, 990, 45, 3, 8, 250, 640, 71, 19, 2, 33, 500, 6, 88, 141]


def exact(x_q: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return (x_q.long() @ w.long().t()).to(torch.int32)


def int8(*shape: int, seed: int) -> torch.Tensor:
    return torch.randint(-128, 128, shape, generator=torch.Generator().manual_seed(seed), dtype=torch.int8)


def test_a_shape_cublaslt_refuses_takes_the_exact_float64_product():
    backend = CudaBackend(flash=None)
    x_q, w = int8(3, 12, seed=1), int8(20, 12, seed=2)          # 12 inputs: no multiple of 8
    assert torch.equal(backend.int8_matmul(x_q, backend.prepare_int8_weight(w)), exact(x_q, w))


@GPU
@pytest.mark.parametrize("rows,k,n", [(1, 64, 96), (16, 576, 1536), (17, 64, 96), (300, 1536, 576), (5, 12, 96)])
def test_int8_matmul_on_the_gpu_is_exact(rows, k, n):
    backend = CudaBackend(device="cuda", flash=None)
    x_q, w = int8(rows, k, seed=rows), int8(n, k, seed=k)
    got = backend.int8_matmul(x_q.cuda(), backend.prepare_int8_weight(w.cuda()))
    assert got.dtype == torch.int32 and got.shape == (rows, n)
    assert torch.equal(got.cpu(), exact(x_q, w))


# ---- whole models on the GPU ---------------------------------------------------------------
def on_gpu(model_dir, **kwargs) -> torch.Tensor:
    with LLM(str(model_dir), device="cuda", kernel_backend="cuda", dtype="float32", num_blocks=64, **kwargs) as llm:
        return llm.prompt_logprobs_full(IDS).double().cpu()


def close_to(reference, ours: torch.Tensor, context=None) -> None:
    with torch.no_grad(), (context or contextlib.nullcontext()):
        ref64 = torch.log_softmax(reference(torch.tensor([IDS])).logits[0, :-1], -1)
        ref32 = torch.log_softmax(reference.float()(torch.tensor([IDS])).logits[0, :-1].double(), -1)
    ours_kl, fp32_kl = kl(ref64, ours).mean().item(), kl(ref64, ref32).mean().item()
    assert ours_kl <= 1.5 * fp32_kl + 2e-5, (ours_kl, fp32_kl)


@pytest.fixture(scope="module")
def float_dir(tmp_path_factory):
    return make_tiny_model("llama", tmp_path_factory.mktemp("cuda-quant") / "float")


@GPU
def test_w8a8_compressed_tensors_on_the_gpu(float_dir, tmp_path):
    q = write_compressed_tensors_w8a8(float_dir, tmp_path / "w8a8")
    close_to(w8a8_reference_model(q), on_gpu(q))


@GPU
@pytest.mark.parametrize("kind,path", [("W8A8", "static"), ("W8A8_DYNAMIC", "dynamic")])
def test_msmodelslim_w8a8_on_the_gpu(float_dir, tmp_path, kind, path):
    prompts = [IDS[i:] + IDS[:i] for i in range(0, 24, 6)]
    q = write_msmodelslim(float_dir, tmp_path / kind, kind, prompts)
    close_to(reference_model(q, path), on_gpu(q))


@GPU
def test_w4a16_on_the_gpu(float_dir, tmp_path):
    q = write_compressed_tensors_w4a16(float_dir, tmp_path / "w4a16", 32)
    close_to(w4a16_reference_model(q, 32), on_gpu(q))


@GPU
def test_c8_on_the_gpu(float_dir, tmp_path):
    q = write_c8(float_dir, tmp_path / "c8", [IDS])
    ref = c8_reference(q)
    close_to(ref, on_gpu(q), patched(ref))


@GPU
def test_an_int8_head_on_the_gpu(hf_saved_model):
    from tests.unit.test_int8_vocab import reference as int8_head_reference
    model_dir = hf_saved_model("qwen2-tied")
    close_to(int8_head_reference(model_dir), on_gpu(model_dir, lm_head_quantization="int8"))
