"""GGUF as a model format (common/model/formats/gguf*.py) on tiny files written with
gguf.GGUFWriter: the reader against gguf's own, the HF config, every tensor type against
gguf's quantize/dequantize round trip, Q/K rows back in HF order (against the source model
and against transformers' own GGUF loading), the engine's greedy tokens against
transformers, and the errors a bad file gets."""
from __future__ import annotations

import io
import struct

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf import GGUFReader

from common.model.config import load_model_config
from common.model.formats.gguf import SUPPORTED_TYPES, config_dict, dequantized, iter_gguf_tensors
from common.model.formats.gguf_reader import GGUFError, read_gguf
from common.model.formats.checkpoint import iter_checkpoint
from tests.gguf_files import ROPE_THETA, TOKENS, expected_weight, hf_tiny_llama, write_tiny_llama

TYPES = [T.F32, T.F16, T.BF16, T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1]


@pytest.fixture(scope="module")
def source_model():
    return hf_tiny_llama(seed=0)


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory, source_model):
    made = {}

    def get(kind=T.F32, **kwargs):
        key = (kind, tuple(sorted(kwargs.items())))
        if key not in made:
            made[key] = write_tiny_llama(tmp_path_factory.mktemp("gguf") / f"tiny-{kind.name}.gguf",
                                         source_model, kind, **kwargs)
        return made[key]
    return get


def test_reader_matches_gguf_reader(tiny_gguf):
    path = tiny_gguf(T.Q4_1)
    ours, ref = read_gguf(path), GGUFReader(path)
    assert {k: v for k, v in ours.metadata.items()} == {
        k: f.contents() for k, f in ref.fields.items() if not k.startswith("GGUF.")}
    assert list(ours.tensors) == [t.name for t in ref.tensors]
    for t in ref.tensors:
        info = ours.tensors[t.name]
        assert info.ggml_type == t.tensor_type and info.shape == tuple(int(d) for d in reversed(t.shape))
        assert np.array_equal(ours.tensor_bytes(info).reshape(-1).view(np.uint8), t.data.reshape(-1).view(np.uint8))


def test_config_from_metadata(tiny_gguf, source_model):
    cfg = load_model_config(tiny_gguf())
    hf = source_model.config
    assert (cfg.architecture, cfg.model_type) == ("LlamaForCausalLM", "llama")
    assert (cfg.hidden_size, cfg.intermediate_size, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (
        hf.hidden_size, hf.intermediate_size, hf.num_hidden_layers, hf.num_attention_heads,
        hf.num_key_value_heads, hf.hidden_size // hf.num_attention_heads)
    assert (cfg.vocab_size, cfg.rope_theta, cfg.max_position_embeddings) == (len(TOKENS), ROPE_THETA, 512)
    assert cfg.rms_norm_eps == pytest.approx(1e-5) and not cfg.tie_word_embeddings
    assert (cfg.bos_token_id, cfg.eos_token_ids) == (1, (2, 0))   # eos, then the other end-of-turn texts


def test_tied_embeddings_when_there_is_no_output_tensor(tmp_path):
    model = hf_tiny_llama(seed=1, tie=True)
    path = write_tiny_llama(tmp_path / "tied.gguf", model)
    assert config_dict(read_gguf(path))["tie_word_embeddings"] is True
    assert "lm_head.weight" not in {name for name, _, _ in iter_gguf_tensors(path)}


@pytest.mark.parametrize("kind", TYPES, ids=lambda k: k.name)
def test_tensors_dequantized_under_hf_names(kind, tiny_gguf, source_model):
    """Every tensor equals gguf's quantize -> dequantize round trip of the source weight
    (so the Q/K row order is HF's again); norms stay F32, exact."""
    expected = source_model.state_dict()
    got = {name: t for name, t, _ in iter_checkpoint(tiny_gguf(kind))}
    assert set(got) == set(expected)
    for name, tensor in got.items():
        ref = expected[name].numpy()
        want = expected_weight(ref, kind if ref.ndim == 2 else T.F32)
        assert tensor.dtype == torch.float32 and np.array_equal(tensor.numpy(), want), name


def test_permutation_agrees_with_transformers_gguf_loading(tiny_gguf):
    import transformers
    path = tiny_gguf(T.Q4_1)
    ref = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                            dtype=torch.float32).state_dict()
    for name, tensor, _ in iter_gguf_tensors(path):
        assert torch.equal(tensor, ref[name]), name


def test_slices_dtype_and_full_shape(tiny_gguf, source_model):
    """A tensor-parallel rank's slice is cut after dequantizing and un-permuting."""
    q_name = "model.layers.1.self_attn.q_proj.weight"
    rows = (slice(16, 48),)
    out = {name: (t, shape) for name, t, _, shape in
           iter_checkpoint(tiny_gguf(T.Q8_0), slices={q_name: rows}, with_shape=True, dtype=torch.bfloat16)}
    tensor, shape = out[q_name]
    full = expected_weight(source_model.state_dict()[q_name].numpy(), T.Q8_0)
    assert shape == full.shape and tensor.shape == (32, 64) and tensor.dtype == torch.bfloat16
    assert torch.equal(tensor, torch.from_numpy(full[16:48]).to(torch.bfloat16))
    assert tensor.untyped_storage().nbytes() == tensor.numel() * 2     # not a view of the whole


def test_progress_bar_counts_the_file(tiny_gguf):
    out = io.StringIO()
    names = [name for name, _, _ in iter_checkpoint(tiny_gguf(T.Q8_0), progress=out)]
    assert "dequantizing weights" in out.getvalue() and f"tensors {len(names)}/{len(names)}" in out.getvalue()


@pytest.mark.parametrize("kind", [T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K, T.Q4_0, T.Q4_1, T.Q8_0],
                         ids=lambda k: k.name)
def test_dequantize_agrees_with_transformers(kind, tmp_path, source_model):
    """Types gguf cannot quantize (K-quants): random blocks with sane fp16 scales, read
    back through a file, equal transformers' independent torch dequantizer."""
    from gguf import GGML_QUANT_SIZES
    from transformers.integrations.gguf.dequant import dequantize as hf_dequantize
    block, size = GGML_QUANT_SIZES[kind]
    rows, cols = 4, 512
    rng = np.random.default_rng(int(kind))
    raw = rng.integers(0, 256, size=(rows * cols // block, size), dtype=np.uint8)
    half_at = {T.Q2_K: (80, 82), T.Q3_K: (108,), T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,),
               T.Q4_0: (0,), T.Q4_1: (0, 2), T.Q8_0: (0,)}[kind]
    for at in half_at:
        raw[:, at:at + 2] = rng.uniform(-0.1, 0.1, size=(len(raw), 1)).astype(np.float16).view(np.uint8)
    raw = raw.reshape(rows, -1)
    path = write_tiny_llama(tmp_path / "k.gguf", source_model, extra_tensors={"blk.9.ffn_up.weight": (raw, kind)})
    file = read_gguf(path)
    ours = dequantized(file, file.tensors["blk.9.ffn_up.weight"])
    ref = hf_dequantize(torch.from_numpy(raw.reshape(-1).copy()), int(kind)).reshape(rows, cols)
    assert kind in SUPPORTED_TYPES and ours.shape == (rows, cols)
    torch.testing.assert_close(ours, ref, rtol=1e-6, atol=1e-7)


def test_engine_greedy_tokens_match_transformers(tiny_gguf, source_model, llm_factory):
    """LLM("x.gguf"): config, weights and tokenizer from the file; greedy tokens are
    transformers' (the source model, F32; the near-tie rule of test_hf_equality)."""
    from common.engine import SamplingParams
    from tests.unit.test_hf_equality import count_near_tie_divergences, hf_next_token_logits, mixed_prompts
    llm = llm_factory(tiny_gguf(T.F32), num_blocks=256, max_num_seqs=8)
    prompts = mixed_prompts(len(TOKENS))[:8]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))
    ties = sum(count_near_tie_divergences(out.outputs[0].token_ids,
                                          hf_next_token_logits(source_model, prompt, out.outputs[0].token_ids),
                                          f"prompt {i}")
               for i, (prompt, out) in enumerate(zip(prompts, outs)))
    assert ties <= 1
    assert llm.tokenizer.encode(" the world") == [TOKENS.index("Ġthe"), TOKENS.index("Ġworld")]


# ---- errors -----------------------------------------------------------------------


@pytest.mark.parametrize("keep", [0, 3, 12, 200, 2000, -1], ids=lambda k: f"keep{k}")
def test_truncated_file_is_named(keep, tiny_gguf, tmp_path):
    data = tiny_gguf().read_bytes()
    bad = tmp_path / "cut.gguf"
    bad.write_bytes(data[:keep] if keep >= 0 else data[:-100])
    with pytest.raises(GGUFError, match="truncated GGUF file") as e:
        load_model_config(bad)
    assert str(bad) in str(e.value)


def test_not_a_gguf_file(tmp_path):
    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"PK\x03\x04" + bytes(100))
    with pytest.raises(GGUFError, match=r"not a GGUF file \(starts with b'PK"):
        read_gguf(bad)
    with pytest.raises(FileNotFoundError, match="no such GGUF file"):
        load_model_config(tmp_path / "missing.gguf")


def test_unsupported_tensor_type_names_tensor_and_allowed(tmp_path, source_model):
    raw = np.zeros((64, 64 // 32 * 18), dtype=np.uint8)      # IQ4_NL: ggml has it, we do not
    path = write_tiny_llama(tmp_path / "iq.gguf", source_model,
                            extra_tensors={"blk.0.ffn_up.weight": (raw, T.IQ4_NL)})
    with pytest.raises(ValueError, match=r"tensor 'blk.0.ffn_up.weight' has type IQ4_NL, which is not "
                                         r"supported; allowed: \['F32', 'F16', 'BF16', 'Q8_0'"):
        load_model_config(path)


def test_undefined_tensor_type_id(tiny_gguf, tmp_path):
    data = bytearray(tiny_gguf().read_bytes())
    name = b"output_norm.weight"
    at = data.index(struct.pack("<Q", len(name)) + name) + 8 + len(name) + 4 + 8   # past n_dims and 1 dim
    data[at:at + 4] = struct.pack("<I", 250)
    bad = tmp_path / "type250.gguf"
    bad.write_bytes(bytes(data))
    with pytest.raises(GGUFError, match=r"tensor 'output_norm.weight' has ggml type id 250, which ggml does not define"):
        read_gguf(bad)


def test_unsupported_architecture(tmp_path, source_model):
    path = write_tiny_llama(tmp_path / "gpt2.gguf", source_model, arch="gpt2")
    with pytest.raises(ValueError, match=r"general.architecture='gpt2' is not supported; allowed: \['llama'\]"):
        load_model_config(path)


def test_unknown_tensor_and_rope_freqs(tmp_path, source_model):
    extra = {"blk.0.attn_q.bias": (np.zeros(64, np.float32), T.F32)}
    path = write_tiny_llama(tmp_path / "bias.gguf", source_model, extra_tensors=extra)
    with pytest.raises(ValueError, match=r"tensor 'blk.0.attn_q.bias' is not a llama tensor; allowed:"):
        list(iter_checkpoint(path))
    path = write_tiny_llama(tmp_path / "rope.gguf", source_model,
                            extra_tensors={"rope_freqs.weight": (np.ones(8, np.float32), T.F32)})
    with pytest.raises(ValueError, match="rope_freqs.weight"):
        load_model_config(path)
