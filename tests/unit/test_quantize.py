"""`pdmesh quantize`: every scheme and format it writes loads in the engine with the
scheme's method; its files match the layouts the test helpers write independently (and
compressed-tensors reads them back); smoothing keeps the float function and lowers what
W8A8 costs on a model with an outlier channel; GPTQ beats round-to-nearest on its own
objective; bad requests exit 2 naming the problem."""
from __future__ import annotations

import json
import random
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from common.engine import LLM
from common.model.tiny import make_tiny_model
from services.cli import main as pdmesh_main
from services.quantize.calibration import calibrate
from services.quantize.gptq import gptq_int4
from services.quantize.quantizer import QuantizeOptions, quantize_model
from services.quantize.schemes import int4_per_group
from services.quantize.smoothing import smooth
from tests.quant_checkpoints import write_compressed_tensors_w8a8

SMALL = dict(hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2, vocab_size=512)
IDS = list(range(3, 40))


def prompts(n: int = 4, length: int = 48, seed: int = 11) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, SMALL["vocab_size"]) for _ in range(length)] for _ in range(n)]


@pytest.fixture(scope="module")
def float_model(tmp_path_factory):
    return make_tiny_model("qwen2", tmp_path_factory.mktemp("quantize") / "float", seed=3, **SMALL)


@pytest.fixture(scope="module")
def unrelated_model(float_model):
    return make_tiny_model("qwen2", float_model.parent / "unrelated", seed=4, **SMALL)


def logprobs(model_dir, **kwargs) -> torch.Tensor:
    with LLM(str(model_dir), kernel_backend="ref", num_blocks=64, **kwargs) as llm:
        return llm.prompt_logprobs_full(IDS).double()


def kl(p_log: torch.Tensor, q_log: torch.Tensor) -> float:
    return (p_log.exp() * (p_log - q_log)).sum(-1).mean().item()


@pytest.mark.parametrize("scheme, fmt, method, want", [
    ("w8a8", "modelslim", "rtn", "W8A8"),
    ("w8a8-dynamic", "modelslim", "rtn", "W8A8_DYNAMIC"),
    ("w8a8-mix", "modelslim", "rtn", "W8A8_MIX"),
    ("w8a8-dynamic", "compressed-tensors", "rtn", "W8A8_DYNAMIC"),
    ("w4a16", "compressed-tensors", "rtn", "W4A16"),
    ("w4a16", "compressed-tensors", "gptq", "W4A16"),
])
def test_every_scheme_loads_with_its_method_and_stays_near_the_float_model(float_model, unrelated_model, tmp_path,
                                                                          scheme, fmt, method, want):
    """Near: a quarter of the distance to a model of other random weights (int4 on a tiny
    random model costs a lot; a misread checkpoint costs all of it)."""
    out = quantize_model(float_model, tmp_path / "q", prompts(),
                         QuantizeOptions(scheme, fmt, method=method, group_size=32))
    assert not (tmp_path / "q.partial").exists()
    with LLM(str(out), kernel_backend="ref", num_blocks=64) as llm:
        assert {linear.method.scheme for _, linear in llm.engine.model.linears()} == {want}
        quantized = llm.prompt_logprobs_full(IDS).double()
    assert kl(logprobs(float_model), quantized) < 0.25 * kl(logprobs(float_model), logprobs(unrelated_model))


def test_compressed_tensors_w8a8_without_smoothing_is_the_reference_layout(float_model, tmp_path):
    ours = quantize_model(float_model, tmp_path / "q", prompts(),
                          QuantizeOptions("w8a8-dynamic", "compressed-tensors", smooth_alpha=None))
    reference = write_compressed_tensors_w8a8(float_model, tmp_path / "ref")
    got, want = load_file(ours / "model.safetensors"), load_file(reference / "model.safetensors")
    assert sorted(got) == sorted(want)
    assert all(torch.equal(got[k], want[k]) for k in want)
    config = json.loads((ours / "config.json").read_text())["quantization_config"]
    from compressed_tensors.quantization import QuantizationConfig, preset_name_to_scheme
    parsed = QuantizationConfig.model_validate(config).config_groups["group_0"]
    preset = preset_name_to_scheme("W8A8", ["Linear"])
    exclude = {"observer", "observer_kwargs"}
    assert parsed.weights.model_dump(exclude=exclude) == preset.weights.model_dump(exclude=exclude)
    assert parsed.input_activations.model_dump(exclude=exclude) == preset.input_activations.model_dump(exclude=exclude)


def test_w4a16_files_decompress_with_compressed_tensors(float_model, tmp_path):
    from compressed_tensors.compressors import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationConfig
    out = quantize_model(float_model, tmp_path / "q", prompts(), QuantizeOptions("w4a16", "compressed-tensors",
                                                                                 smooth_alpha=None, group_size=32))
    config = QuantizationConfig.model_validate(json.loads((out / "config.json").read_text())["quantization_config"])
    tensors, floats = load_file(out / "model.safetensors"), load_file(float_model / "model.safetensors")
    name = "model.layers.1.mlp.down_proj."
    got = PackedQuantizationCompressor.decompress(
        {k: tensors[name + k] for k in ("weight_packed", "weight_scale", "weight_shape")},
        config.config_groups["group_0"])["weight"]
    codes, scale = int4_per_group(floats[name + "weight"], 32, clip=False)
    assert torch.equal(got, codes.float() * scale.float().repeat_interleave(32, 1))   # the file's float32 scale


def test_msmodelslim_description_names_every_tensor(float_model, tmp_path):
    out = quantize_model(float_model, tmp_path / "q", prompts(), QuantizeOptions("w8a8-mix", "modelslim"))
    description = json.loads((out / "quant_model_description.json").read_text())
    tensors = load_file(out / "quant_model_weights.safetensors")
    types = {k: v for k, v in description.items() if "." in k}
    assert set(types) == set(tensors)
    prefix = "model.layers.0.self_attn.q_proj."
    assert {k[len(prefix):]: v for k, v in types.items() if k.startswith(prefix)} == {
        "weight": "W8A8_MIX", "input_scale": "W8A8_MIX", "input_offset": "W8A8_MIX", "quant_bias": "W8A8_MIX",
        "deq_scale": "W8A8_MIX", "weight_scale": "W8A8_MIX", "weight_offset": "W8A8_MIX", "bias": "FLOAT"}
    assert types["model.layers.0.input_layernorm.weight"] == "FLOAT"
    assert description["model_quant_type"] == "W8A8_MIX"


@pytest.fixture(scope="module")
def outlier_model(float_model):
    """The float model with input channel 7 of every layer norm 40x: the outliers W8A8
    per-token activations suffer from (SmolLM2's reach ~190x the median)."""
    out = shutil.copytree(float_model, float_model.parent / "outlier")
    tensors = load_file(out / "model.safetensors")
    for name in tensors:
        if name.endswith("layernorm.weight"):
            tensors[name][7] *= 40
    save_file(tensors, out / "model.safetensors")
    return out


def test_smoothing_keeps_the_float_function(outlier_model):
    tensors = {k: v.clone() for k, v in load_file(outlier_model / "model.safetensors").items()}
    stats = calibrate(outlier_model, prompts())
    assert len(smooth(tensors, stats, 0.5)) == 3 * SMALL["num_layers"]     # q/k/v, gate/up, down
    moved = outlier_model.parent / "smoothed-float"
    shutil.copytree(outlier_model, moved, dirs_exist_ok=True)
    save_file(tensors, moved / "model.safetensors")
    assert kl(logprobs(outlier_model), logprobs(moved)) < 1e-6     # float32 rounding (W8A8 costs ~1e-2)


def test_smoothing_lowers_the_quantized_output_error_of_a_layer_with_outlier_inputs(outlier_model):
    """Layer 0's q/k/v on the inputs the outlier model feeds it: the W8A8 (per-token int8
    activations, per-channel int8 weights) output error, relative to the float output,
    without and with SmoothQuant's alpha 0.5."""
    from services.quantize.schemes import int8_per_channel
    from services.quantize.smoothing import smoothing_factors
    captured = []
    with LLM(str(outlier_model), kernel_backend="ref", num_blocks=64) as llm:
        qkv = dict(llm.engine.model.linears())["layers.0.self_attn.qkv"]
        qkv.register_forward_pre_hook(lambda _m, args: captured.append(args[0].double().clone()))
        llm.prompt_logprobs_full(IDS)
    x = torch.cat(captured)
    tensors = load_file(outlier_model / "model.safetensors")
    w = torch.cat([tensors[f"model.layers.0.self_attn.{p}_proj.weight"].double() for p in "qkv"])
    exact = x @ w.t()

    def quantized_output_error(x: torch.Tensor, w: torch.Tensor) -> float:
        codes, scale = int8_per_channel(w, 127.5)
        amax = x.abs().amax(-1, keepdim=True)
        s = amax / 127.5
        y = (torch.round(x / s).clamp(-128, 127) * s) @ (codes.double() * scale).t()
        return float((y - exact).norm() / exact.norm())

    s = smoothing_factors(x.abs().amax(0), w.abs().amax(0), 0.5)
    plain, smoothed = quantized_output_error(x, w), quantized_output_error(x / s, w * s)
    assert smoothed < 0.5 * plain, (plain, smoothed)


def test_gptq_beats_round_to_nearest_on_its_objective(float_model):
    """||X (W - Q)^T||^2 over the calibration inputs, summed over every projection."""
    stats = calibrate(float_model, prompts(8, 64), hessian=True)
    tensors = load_file(float_model / "model.safetensors")
    totals = {"rtn": 0.0, "gptq": 0.0}
    for st in stats.values():
        for name in st.projections:
            w = tensors[name + ".weight"].double()
            for method in totals:
                codes, scale = (gptq_int4(w, st.xtx, st.num_tokens, 32) if method == "gptq"
                                else int4_per_group(w, 32, clip=False))
                d = w - codes.double() * scale.repeat_interleave(32, 1)
                totals[method] += float(torch.einsum("ni,ij,nj->", d, st.xtx, d))
    assert totals["gptq"] < 0.8 * totals["rtn"], totals


@pytest.mark.parametrize("args, message", [
    (["--scheme", "w8a8", "--format", "compressed-tensors"], "--scheme w8a8 cannot be written as compressed-tensors"),
    (["--scheme", "w4a16", "--format", "modelslim"], "--scheme w4a16 cannot be written as msModelSlim"),
    (["--scheme", "w8a8", "--format", "modelslim", "--method", "gptq"], "--method gptq applies to --scheme w4a16"),
    (["--scheme", "int3", "--format", "modelslim"], "--scheme must be one of"),
    (["--scheme", "w4a16", "--format", "compressed-tensors", "--group-size", "12"], "--group-size must be"),
    (["--scheme", "w8a8", "--format", "modelslim", "--smooth-alpha", "strong"],
     "--smooth-alpha must be 'auto' or a number in [0, 1], got 'strong'"),
    (["--scheme", "w8a8", "--format", "modelslim", "--smooth-alpha", "1.5"], "--smooth-alpha must be 'auto'"),
    (["--scheme", "c8", "--format", "compressed-tensors"], "--scheme c8 cannot be written as compressed-tensors"),
    (["--scheme", "w4a16+c8", "--format", "modelslim"], "--scheme must be one of"),
])
def test_bad_requests_exit_2_naming_the_problem(float_model, tmp_path, capsys, args, message):
    code = pdmesh_main(["quantize", str(float_model), "--calib", "gpl-3", "--out", str(tmp_path / "q"),
                        "--num-prompts", "1", "--prompt-len", "16", *args])
    assert code == 2 and message in capsys.readouterr().err
    assert not (tmp_path / "q").exists()


def test_a_quantized_model_is_not_quantized_again(float_model, tmp_path, capsys):
    once = write_compressed_tensors_w8a8(float_model, tmp_path / "once")
    code = pdmesh_main(["quantize", str(once), "--scheme", "w8a8", "--format", "modelslim", "--calib", "gpl-3",
                        "--out", str(tmp_path / "twice"), "--num-prompts", "1", "--prompt-len", "16"])
    assert code == 2 and "already quantized (compressed-tensors); give a float model" in capsys.readouterr().err


def test_out_never_replaces_the_model_or_a_folder_of_other_files(float_model, tmp_path, capsys):
    other = tmp_path / "notes"
    other.mkdir()
    (other / "keep.txt").write_text("mine")
    for out, message in ((float_model, "is the model or a folder holding it"),
                         (float_model.parent, "is the model or a folder holding it"),
                         (other, "exists and is not a quantized model")):
        code = pdmesh_main(["quantize", str(float_model), "--scheme", "w8a8", "--format", "modelslim", "--calib",
                            "gpl-3", "--out", str(out), "--num-prompts", "1", "--prompt-len", "16"])
        assert code == 2 and message in capsys.readouterr().err
    assert (float_model / "model.safetensors").exists() and (other / "keep.txt").read_text() == "mine"


def test_a_group_size_that_does_not_divide_the_inputs_is_refused_before_calibrating(float_model, tmp_path, capsys):
    code = pdmesh_main(["quantize", str(float_model), "--scheme", "w4a16", "--format", "compressed-tensors",
                        "--calib", "gpl-3", "--out", str(tmp_path / "q"), "--group-size", "256"])
    err = capsys.readouterr().err
    assert code == 2 and "--group-size 256 must divide every projection's inputs; it does not divide " \
                         "hidden_size = 128, num_attention_heads * head_dim = 128, intermediate_size = 384; 128 fits" in err, err


def test_auto_smoothing_picks_each_layers_least_error_strength(outlier_model):
    """"auto": per layer, the strength whose W8A8 output error on the calibration sample is
    least (every candidate computed here), and the sample is the same on every run."""
    from services.quantize.smoothing import ALPHAS, choose_alpha, smoothing_factors, quantized_output_error
    stats = calibrate(outlier_model, prompts(), samples=64)
    again = calibrate(outlier_model, prompts(), samples=64)
    tensors = load_file(outlier_model / "model.safetensors")
    for name in ("layers.0.self_attn.qkv", "layers.1.mlp.down"):
        st = stats[name]
        assert st.samples.shape == (64, st.min.shape[0]) and torch.equal(st.samples, again[name].samples)
        w = torch.cat([tensors[p + ".weight"].double() for p in st.projections])
        w_absmax = w.abs().amax(0)
        errors = {}
        for alpha in ALPHAS:
            s = smoothing_factors(st.absmax, w_absmax, alpha)
            errors[alpha] = quantized_output_error(st.samples.float(), w.float(), s.float(), float((st.min / s).min()),
                                       float((st.max / s).max()), ("static",))
        ones = torch.ones_like(st.absmax).float()
        errors[None] = quantized_output_error(st.samples.float(), w.float(), ones, float(st.min.min()), float(st.max.max()),
                                  ("static",))
        assert choose_alpha(st, w, w_absmax, ("static",)) == min(errors, key=errors.get)
        assert len(set(errors.values())) > 1


def test_c8_scales_come_from_what_each_layer_writes_into_its_cache(float_model, tmp_path):
    """--scheme c8: float weights, per-channel symmetric scales = max |key after rotary| / 127
    (and |value|) over the calibration, offset 0; the description says C8."""
    from services.quantize.calibration import calibration_prompts
    ps = calibration_prompts(float_model, "/usr/share/common-licenses/GPL-3", 2, 64)
    out = quantize_model(float_model, tmp_path / "c8", ps, QuantizeOptions("c8", "modelslim"))
    kv: dict = {}
    calibrate(float_model, ps, kv=kv)
    tensors = load_file(out / "quant_model_weights.safetensors")
    floats = load_file(float_model / "model.safetensors")
    for i in range(SMALL["num_layers"]):
        p = f"model.layers.{i}.self_attn."
        assert torch.equal(tensors[p + "k_proj.weight"], floats[p + "k_proj.weight"])
        torch.testing.assert_close(tensors[p + "k_proj.kv_cache_scale"].double(), kv[i]["k"] / 127)
        torch.testing.assert_close(tensors[p + "v_proj.kv_cache_scale"].double(), kv[i]["v"] / 127)
        assert not tensors[p + "v_proj.kv_cache_offset"].any()
    description = json.loads((out / "quant_model_description.json").read_text())
    assert description["kv_cache_type"] == "C8" and description["model.layers.0.self_attn.k_proj.kv_cache_scale"] == "C8"
    with LLM(str(out), kernel_backend="cpu", num_blocks=64) as llm, \
            LLM(str(float_model), kernel_backend="cpu", num_blocks=64) as fp:
        assert llm.engine.kv_cache.dtype == torch.int8
        # on text in the calibration's range (a calibration prompt) int8 KV costs little (0.14 on unrelated ids)
        assert kl(fp.prompt_logprobs_full(ps[0]).double(), llm.prompt_logprobs_full(ps[0]).double()) < 1e-2


def test_int4_clip_search_never_reproduces_a_group_worse_than_the_full_range():
    from services.quantize.schemes import int4_scale
    g = torch.Generator().manual_seed(0)
    groups = torch.randn(64, 8, 32, generator=g, dtype=torch.float64)
    groups[:, :, 0] *= 6        # one large weight per group stretches the full-range grid

    def error(scale):
        return (groups - torch.round(groups / scale.unsqueeze(-1)).clamp(-8, 7) * scale.unsqueeze(-1)).square().sum(-1)
    full, clipped = error(int4_scale(groups, torch.float32, clip=False)), error(int4_scale(groups, torch.float32))
    assert bool((clipped <= full).all()) and float(clipped.sum()) < 0.9 * float(full.sum())


def test_c8_calibration_leaves_the_shared_backend_as_it_was(float_model, tmp_path):
    """Recording the KV ranges must not patch the backend instance every later engine of
    the process shares (it once replaced its write_kv for good)."""
    from kernels import get_backend
    from services.quantize.calibration import calibration_prompts
    shared = get_backend("ref", "cpu")
    ps = calibration_prompts(float_model, "/usr/share/common-licenses/GPL-3", 1, 32)
    quantize_model(float_model, tmp_path / "c8", ps, QuantizeOptions("c8", "modelslim"))
    assert "write_kv" not in vars(shared) and get_backend("ref", "cpu") is shared


def test_static_ranges_are_the_clip_of_min_max_with_the_least_sample_error(outlier_model):
    """--static-range search: per layer, the ratio of the calibration's [min, max] whose
    static W8A8 output error on the sample is least (every candidate computed here)."""
    from services.quantize.static_ranges import RANGE_RATIOS, choose_static_ranges, static_output_error
    stats = calibrate(outlier_model, prompts(), samples=64)
    tensors = load_file(outlier_model / "model.safetensors")
    chosen = choose_static_ranges(tensors, stats)
    assert set(chosen) == set(stats)
    for name, st in stats.items():
        w = torch.cat([tensors[p + ".weight"].float() for p in st.projections])
        lo, hi = float(st.min.min()), float(st.max.max())
        errors = {r: static_output_error(st.samples.float(), w, r * lo, r * hi) for r in RANGE_RATIOS}
        assert chosen[name] == min(errors, key=errors.get), name
        assert st.static_range == (chosen[name] * lo, chosen[name] * hi) and st.input_range == st.static_range
    assert any(r < 1 for r in chosen.values())      # the outlier channel stretches min/max past the best grid


def test_a_range_stretched_by_two_outlier_values_is_clipped():
    """By hand, the error computed here in float64: 256 tokens of 1,024 unit-scale inputs
    and two single values at +-30, which stretch min/max's step to ~0.24 for every other
    input; clipping to 0.6 of it costs those two values less than the coarse grid cost the
    rest. Without them the range stays near min/max (0.9: a normal sample's own extremes)."""
    from services.quantize.calibration import InputStats
    from services.quantize.static_ranges import choose_static_ranges

    def error(x, w, lo, hi):     # float64, independent of static_ranges.py
        s = (hi - lo) / 255
        off = round(-128 - lo / s)
        xq = ((x / s + off).round().clamp(-128, 127) - off) * s
        ws = w.abs().amax(1, keepdim=True) / 127
        return float((xq @ ((w / ws).round() * ws).t() - x @ w.t()).norm() / (x @ w.t()).norm())

    g = torch.Generator().manual_seed(0)
    w = torch.randn(32, 1024, generator=g, dtype=torch.float64)
    x = torch.randn(256, 1024, generator=g)
    for outliers, want in ((True, 0.6), (False, 0.9)):
        rows = x.clone()
        if outliers:
            rows[3, 10], rows[100, 500] = 30.0, -30.0
        st = InputStats(["p"], rows.double().amin(0), rows.double().amax(0), samples=rows)
        assert choose_static_ranges({"p.weight": w}, {"l": st}) == {"l": want}
        lo, hi = float(st.min.min()), float(st.max.max())
        assert error(rows.double(), w, want * lo, want * hi) < error(rows.double(), w, lo, hi)


@pytest.mark.parametrize("static_range", ["minmax", "search"])
def test_a_static_checkpoint_is_quantized_over_the_range_chosen(outlier_model, tmp_path, static_range):
    """What the file holds: input_scale and input_offset of min/max, or of the searched clip."""
    from services.quantize.schemes import static_activation
    from services.quantize.static_ranges import choose_static_ranges
    out = quantize_model(outlier_model, tmp_path / "q", prompts(),
                         QuantizeOptions("w8a8", "modelslim", smooth_alpha=None, static_range=static_range))
    stats = calibrate(outlier_model, prompts(), samples=256)
    if static_range == "search":
        choose_static_ranges(load_file(outlier_model / "model.safetensors"), stats)
    written = load_file(out / "quant_model_weights.safetensors")
    for name, st in stats.items():
        s_x, offset = static_activation(*st.input_range)
        for p in st.projections:
            assert float(written[p + ".input_scale"]) == pytest.approx(s_x, rel=1e-6), p
            assert float(written[p + ".input_offset"]) == offset, p


def test_an_unknown_static_range_is_refused_naming_the_flag():
    with pytest.raises(ValueError, match=r"--static-range must be one of \['minmax', 'search'\], got 'percentile'"):
        QuantizeOptions("w8a8", "modelslim", static_range="percentile")
