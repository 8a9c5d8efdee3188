"""The cpu backend against float64 dense attention and F.linear: its C++ decode over block
tables (every dtype, block sizes, head groupings, sequences split over threads) and its
oneDNN-packed linears; the model's weights are packed once, without a dense copy."""
from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from kernels.cpu import CpuBackend, onednn_packs
from kernels.ref import RefBackend
from tests.kernels.paged_case import TOLERANCE, dense_attention, make_paged

SCALE = 32 ** -0.5
TOLERANCE_FP16 = dict(atol=2e-3, rtol=2e-3)


@pytest.fixture(scope="module")
def backend() -> CpuBackend:
    backend = CpuBackend("cpu")
    if os.environ.get("PDMESH_CPU_EXTENSION") != "0":
        # the suite must exercise the C++ path where `make` built it, not silently the fallback
        assert backend.extension is not None, "kernels/cpu_extension.py could not build the C++ decode"
    return backend


def _decode(backend, paged):
    backend.write_kv(paged.key, paged.value, paged.k_cache, paged.v_cache, paged.slot_mapping)
    return backend.decode(paged.query, paged.k_cache, paged.v_cache, paged.decode_meta(), SCALE)


@pytest.mark.parametrize("block_size", [16, 128])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_decode_matches_dense(backend, block_size, dtype):
    seq_lens = [1, 5, block_size, block_size + 1, 3 * block_size + 7, 300]
    paged = make_paged([1] * len(seq_lens), seq_lens, block_size=block_size, dtype=dtype, seed=7)
    out = _decode(backend, paged)
    assert out.dtype == dtype and out.shape == paged.query.shape
    tolerance = TOLERANCE_FP16 if dtype == torch.float16 else TOLERANCE[dtype]
    torch.testing.assert_close(out.double(), dense_attention(paged, SCALE), **tolerance)


@pytest.mark.parametrize("num_heads,num_kv_heads", [(8, 2), (4, 4), (6, 1), (16, 8)])
@pytest.mark.parametrize("threads", [1, 4])
def test_decode_head_groupings_and_thread_split(backend, num_heads, num_kv_heads, threads):
    """threads=4 with 1 or 3 sequences splits a sequence's kv heads over several tasks."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for seq_lens in ([77], [1, 16, 17], [1, 16, 17, 100, 33]):
            paged = make_paged([1] * len(seq_lens), seq_lens, block_size=16, num_heads=num_heads,
                               num_kv_heads=num_kv_heads, seed=len(seq_lens))
            torch.testing.assert_close(_decode(backend, paged).double(),
                                       dense_attention(paged, SCALE), **TOLERANCE[torch.float32])
    finally:
        torch.set_num_threads(before)


def test_decode_agrees_with_ref_on_the_same_cache(backend):
    paged = make_paged([1] * 4, [40, 3, 129, 64], block_size=16, seed=11)
    expected = _decode(RefBackend(), paged)
    torch.testing.assert_close(_decode(backend, paged), expected, atol=1e-5, rtol=1e-5)


def test_decode_of_no_sequence(backend):
    paged = make_paged([1], [5], block_size=16)
    meta = paged.decode_meta()
    meta.seq_lens, meta.block_tables, meta.seq_lens_list = meta.seq_lens[:0], meta.block_tables[:0], []
    assert backend.decode(paged.query[:0], paged.k_cache, paged.v_cache, meta, SCALE).shape == (0, 8, 32)


def test_decode_refuses_a_length_past_its_blocks(backend):
    if backend.extension is None:
        pytest.skip("the C++ decode is off")
    paged = make_paged([1], [20], block_size=16, pad_blocks=0)
    meta = paged.decode_meta()
    meta.seq_lens = torch.tensor([33], dtype=torch.int32)
    with pytest.raises(RuntimeError, match="seq_lens must be in"):
        backend.decode(paged.query, paged.k_cache, paged.v_cache, meta, SCALE)


@pytest.mark.parametrize("rows", [1, 3, 8, 200])
@pytest.mark.parametrize("with_bias", [False, True])
def test_packed_linear_matches_f_linear(backend, rows, with_bias):
    gen = torch.Generator().manual_seed(rows)
    weight = torch.randn(96, 64, generator=gen)
    bias = torch.randn(96, generator=gen) if with_bias else None
    x = torch.randn(rows, 64, generator=gen)
    packed = backend.prepare_linear(weight)
    assert packed is not weight and packed.is_mkldnn
    torch.testing.assert_close(backend.linear(x, packed, bias), F.linear(x, weight, bias),
                               atol=1e-4, rtol=1e-4)
    assert backend.linear(x[None], packed, bias).shape == (1, rows, 96)


def test_weights_oneDNN_cannot_pack_stay_dense(backend, monkeypatch):
    monkeypatch.setattr("kernels.cpu.onednn_packs", lambda dtype: False)
    weight = torch.randn(8, 4)
    assert backend.prepare_linear(weight) is weight
    x = torch.randn(2, 4)
    assert torch.equal(backend.linear(x, weight, None), F.linear(x, weight))
    assert onednn_packs(torch.float32)


def test_the_model_keeps_no_dense_copy_of_packed_weights(tiny_model):
    from common.config import EngineConfig
    from common.engine.llm_engine import LLMEngine
    engine = LLMEngine(EngineConfig.from_kwargs(str(tiny_model("llama")), kernel_backend="cpu"))
    linears = dict(engine.model.linears())
    assert engine.backend.name == "cpu"
    assert sorted(linears) == sorted(f"layers.{i}.{name}" for i in range(engine.model.cfg.num_layers)
                                     for name in ("self_attn.qkv", "self_attn.o", "mlp.gate_up", "mlp.down"))
    assert all(linear.prepared.is_mkldnn for linear in linears.values())
    assert all(linear.weight.numel() == 0 for linear in linears.values())
    with pytest.raises(RuntimeError, match="already called"):
        engine.model.prepare_linears()


def test_ref_keeps_its_dense_parameters(tiny_model):
    from common.config import EngineConfig
    from common.engine.llm_engine import LLMEngine
    engine = LLMEngine(EngineConfig.from_kwargs(str(tiny_model("llama")), kernel_backend="ref"))
    linears = [linear for _, linear in engine.model.linears()]
    assert len(linears) == 4 * engine.model.cfg.num_layers
    assert all(linear.prepared is not None and linear.weight.numel() > 0
               and linear.prepared.data_ptr() == linear.weight.data_ptr() for linear in linears)


def test_decode_refuses_a_block_id_outside_the_cache(backend):
    if backend.extension is None:
        pytest.skip("the C++ decode is off")
    paged = make_paged([1, 1], [20, 5], block_size=16)
    meta = paged.decode_meta()
    meta.block_tables = meta.block_tables.clone()
    meta.block_tables[0, 1] = paged.k_cache.shape[0] + 10**6
    with pytest.raises(RuntimeError, match="outside the cache's"):
        backend.decode(paged.query, paged.k_cache, paged.v_cache, meta, SCALE)


def test_decode_lets_other_python_threads_run(backend):
    """The extension drops the GIL as torch's ops do: the node's event loop keeps going.
    A thread stamps the clock while a long call runs; with the GIL held it could not run
    at all inside the call's middle 80%. A loaded host may give the thread no core during
    one call, so up to 20 calls: with the GIL held, none would have a stamp inside."""
    import threading
    import time
    if backend.extension is None:
        pytest.skip("the C++ decode is off")
    paged = make_paged([1] * 16, [4000] * 16, block_size=16)
    meta = paged.decode_meta()
    q = (paged.query * SCALE).contiguous()
    running, stamps = threading.Event(), []

    def stamp():
        running.set()
        while running.is_set():
            stamps.append(time.perf_counter())
            time.sleep(0)

    thread = threading.Thread(target=stamp)
    thread.start()
    running.wait()
    calls = []     # (seconds, stamps inside the middle 80%) of each call
    for _ in range(20):
        t0 = time.perf_counter()
        backend.extension.paged_decode(q, paged.k_cache, paged.v_cache, meta.block_tables, meta.seq_lens)
        t1 = time.perf_counter()
        calls.append((t1 - t0, sum(t0 + 0.1 * (t1 - t0) < t < t0 + 0.9 * (t1 - t0) for t in list(stamps))))
        if calls[-1][1]:
            break
    running.clear()
    thread.join()
    assert calls[-1][1] > 0, calls


def test_an_unbuilt_library_falls_back_to_ref_decode(monkeypatch, caplog):
    import kernels.cpu_extension as ext
    monkeypatch.setattr(ext, "_LOADED", [])
    monkeypatch.setattr(ext, "module_name", lambda: "pdmesh_cpu_kernels_never_built")
    with caplog.at_level("WARNING", logger="pdmesh.kernels"):
        backend = CpuBackend("cpu")
    assert backend.extension is None and "not built" in caplog.text
    paged = make_paged([1, 1], [20, 5], block_size=16)
    torch.testing.assert_close(_decode(backend, paged).double(), dense_attention(paged, SCALE),
                               **TOLERANCE[torch.float32])
