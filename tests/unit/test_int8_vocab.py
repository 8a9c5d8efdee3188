"""`engine.lm_head_quantization: int8` (common/model/layers/int8_vocab.py): the head runs
W8A8 dynamic on per-row int8 codes of the vocabulary matrix, a tied embedding looks up the
same codes. The layer against float64 on its own codes per backend; the whole model
against transformers computing the same math in float64 (the matrix dequantized, the
head's input quantized per token), tied and untied, at ref, cpu, cpu TP 2 and npu."""
from __future__ import annotations

import pytest
import torch

from common.engine import LLM, SamplingParams
from common.model.layers.int8_vocab import Int8Vocab
from kernels import get_backend
from tests.conftest import assert_no_blocks_in_use
from tests.quant_checkpoints import ENGINE_CASE_IDS, ENGINE_CASES, kl

IDS = [1, 17, 400, 9, 23, 610, 5, 77, 301, 12, 990, 45, 3, 8, 250, 640, 71, 19, 2, 33]


@pytest.mark.parametrize("backend_name", ["ref", "cpu", "npu"])
def test_the_layer_computes_w8a8_dynamic_on_the_rows_codes(backend_name, request):
    calls = request.getfixturevalue("npu_op_calls") if backend_name == "npu" else None
    backend = get_backend(backend_name, "cpu")
    g = torch.Generator().manual_seed(3)
    weight = torch.randn(300, 64, generator=g) * 0.05
    weight[7] = 0                                            # a padding row: scale 1, codes 0
    weight[11, 5] = 2.0                                      # an outlier owns its row's scale
    vocab = Int8Vocab(weight, backend)
    codes, scale = vocab.codes.cpu(), vocab.scale.cpu()
    w64 = weight.double()
    s64 = w64.abs().amax(1, keepdim=True) / 127
    s64[7] = 1
    assert torch.allclose(scale.double(), s64, rtol=1e-6) and scale[7].item() == 1.0
    assert (codes.double() - torch.round(w64 / s64)).abs().max().item() <= 1
    assert codes[7].abs().max().item() == 0 and codes[11, 5].item() == 127

    hidden = torch.randn(5, 64, generator=g)
    hidden[2, 9] = 40.0                                      # a per-token outlier
    got = vocab.logits(hidden, backend).cpu().double()
    sx = hidden.double().abs().amax(1, keepdim=True) / 127
    x_q = torch.round(hidden.double() / sx).clamp(-128, 127)
    want = (x_q @ codes.double().t()) * sx * scale.double().t()
    assert got.shape == (5, 300) and torch.allclose(got, want, rtol=1e-5, atol=1e-6)

    ids = torch.tensor([[0, 7, 11], [299, 11, 3]])
    looked = vocab.lookup(ids, torch.float32).cpu()
    assert torch.equal(looked, codes[ids].float() * scale[ids])
    if calls is not None:
        assert calls["npu_dynamic_quant"] == 1 and calls["npu_quant_matmul"] == 1


def test_a_vocabulary_wider_than_npu_quant_matmul_takes_goes_in_slices(npu_op_calls):
    backend = get_backend("npu", "cpu")
    g = torch.Generator().manual_seed(5)
    weight = torch.randn(151_936, 32, generator=g)            # Qwen's vocabulary; the op stops at 65535
    vocab = Int8Vocab(weight, backend)
    assert [p.shape for p in vocab.prepared] == [(32, 65535), (32, 65535), (32, 20866)]
    hidden = torch.randn(3, 32, generator=g)
    got = vocab.logits(hidden, backend).double()
    sx = hidden.double().abs().amax(1, keepdim=True) / 127
    x_q = torch.round(hidden.double() / sx).clamp(-128, 127)
    want = (x_q @ vocab.codes.double().t()) * sx * vocab.scale.double().t()
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-6)
    assert npu_op_calls["npu_quant_matmul"] == 3


# ---- the model ----------------------------------------------------------------------------
def reference(model_dir):
    """transformers in float64 with the vocabulary matrix dequantized from its int8 rows and
    the head's input quantized per token (the hook); `.float()` runs it in float32."""
    import transformers
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float64).eval()
    w = model.lm_head.weight.data
    s = w.abs().amax(1, keepdim=True) / 127
    s = torch.where(s > 0, s, torch.ones_like(s))
    model.lm_head.weight.data = torch.round(w / s).clamp(-128, 127) * s    # tied: the embedding's too

    def per_token(_module, args):
        x = args[0]
        sx = x.abs().amax(-1, keepdim=True) / 127
        return (torch.round(x / sx).clamp(-128, 127) * sx,)

    model.lm_head.register_forward_pre_hook(per_token)
    return model


def logprobs(model_dir, **kwargs) -> torch.Tensor:
    with LLM(str(model_dir), num_blocks=64, **kwargs) as llm:
        return llm.prompt_logprobs_full(IDS).double()


@pytest.mark.parametrize("kind", ["qwen2-tied", "llama-gqa"])
@pytest.mark.parametrize("kwargs", ENGINE_CASES, ids=ENGINE_CASE_IDS)
def test_an_int8_head_is_as_close_to_its_float64_math_as_float32_gets(hf_saved_model, kind, kwargs, request):
    if kwargs["kernel_backend"] == "npu":
        request.getfixturevalue("npu_emulator")
    model_dir = hf_saved_model(kind)
    ref = reference(model_dir)
    with torch.no_grad():
        ref64 = torch.log_softmax(ref(torch.tensor([IDS])).logits[0, :-1], -1)
        ref32 = torch.log_softmax(ref.float()(torch.tensor([IDS])).logits[0, :-1].double(), -1)
    ours = logprobs(model_dir, lm_head_quantization="int8", **kwargs)
    ours_kl, fp32_kl = kl(ref64, ours).mean().item(), kl(ref64, ref32).mean().item()
    assert ours_kl <= 1.5 * fp32_kl + 2e-5, (ours_kl, fp32_kl)
    # and the quantization is there: the float head is measurably further from this math
    assert kl(ref64, logprobs(model_dir, kernel_backend="ref")).mean().item() > 10 * max(ours_kl, 1e-7)


def test_a_tied_model_holds_one_int8_matrix_for_both_ends(hf_saved_model):
    model_dir = hf_saved_model("qwen2-tied")
    with LLM(str(model_dir), kernel_backend="cpu", num_blocks=64, lm_head_quantization="int8") as llm, \
            LLM(str(model_dir), kernel_backend="cpu", num_blocks=64) as floats:
        model = llm.engine.model
        vocab, hidden = model.cfg.vocab_size, model.cfg.hidden_size
        assert model.embed.weight.numel() == 0 and model.embed.int8 is model.lm_head.int8
        assert model.lm_head.int8.codes.dtype == torch.int8 and model.lm_head.int8.codes.shape == (vocab, hidden)
        assert model.dense_bytes["embed.weight"] == vocab * hidden + 4 * vocab
        assert floats.engine.model.dense_bytes["embed.weight"] == 4 * vocab * hidden
        out = llm.generate([{"prompt_token_ids": IDS}], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
        assert len(out[0].outputs[0].token_ids) == 6
        assert_no_blocks_in_use(llm.engine)


def test_an_unknown_head_quantization_is_refused_naming_the_choices(hf_saved_model):
    with pytest.raises(ValueError, match=r"lm_head_quantization must be one of \('none', 'int8'\), got 'int4'"):
        LLM(str(hf_saved_model("qwen2-tied")), lm_head_quantization="int4")
