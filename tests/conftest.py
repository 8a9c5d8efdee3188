"""Shared fixtures: tiny models made on the spot, engines cached per configuration, and a
leak check after each test: every block's ref count zero, nothing quarantined."""
from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch

from common.model.tiny import make_tiny_model

# Every service the tests start (in this process or as a child) holds the same mesh
# identity and admin token, given in the environment as an operator would; the gateway
# has no API keys unless a test gives it some. `pdmesh up` records its mesh under
# PDMESH_STATE_DIR, not in the home folder.
TEST_CLUSTER_SECRET = "test-cluster-secret-" + os.urandom(8).hex()
TEST_ADMIN_TOKEN = "test-admin-token-" + os.urandom(8).hex()
os.environ["PDMESH_CLUSTER_SECRET"] = TEST_CLUSTER_SECRET
os.environ["PDMESH_ADMIN_TOKEN"] = TEST_ADMIN_TOKEN
for _name in ("PDMESH_CLUSTER_SECRET_FILE", "PDMESH_ADMIN_TOKEN_FILE", "PDMESH_API_KEYS_FILE", "PDMESH_TLS_DIR",
              "PDMESH_API_KEY", "PDMESH_API_KEY_FILE"):
    os.environ.pop(_name, None)
import atexit as _atexit  # noqa: E402
import tempfile as _tempfile  # noqa: E402
os.environ["PDMESH_STATE_DIR"] = _tempfile.mkdtemp(prefix="pdmesh-state-")
_atexit.register(shutil.rmtree, os.environ["PDMESH_STATE_DIR"], True)

_ENGINES: dict[tuple, object] = {}

# Under PDMESH_KERNEL_BACKEND=npu the engine suite runs the NPU backend through the
# torch_npu emulator (CPU tensors), whose attention needs blocks of 128 tokens.
FORCED_BACKEND = os.environ.get("PDMESH_KERNEL_BACKEND", "")
BLOCK_SIZE = 128 if FORCED_BACKEND == "npu" else 16


# A hang fails fast and says why: every test gets its tier's timeout (setup and teardown
# included: a module's first test also starts its mesh), about three times the slowest
# test of the tier on a loaded 2-core machine; past it pytest-timeout dumps every thread's
# stack and fails the test, and the report adds the services' last log lines
# (tests/service_logs.py). A test may set its own with @pytest.mark.timeout(s).
TIER_TIMEOUT_S = {"unit": 240, "kernels": 240, "integration": 420, "faults": 420}


def pytest_configure(config):
    if FORCED_BACKEND == "npu":
        from kernels.testing import fake_torch_npu
        fake_torch_npu.install()


def pytest_collection_modifyitems(config, items):
    root = Path(__file__).parent
    for item in items:
        if item.get_closest_marker("timeout") is not None:
            continue
        try:
            tier = Path(item.path).relative_to(root).parts[0]
        except ValueError:
            continue
        if tier in TIER_TIMEOUT_S:
            item.add_marker(pytest.mark.timeout(TIER_TIMEOUT_S[tier]))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    report = (yield).get_result()
    if report.failed:
        from tests import service_logs
        text = service_logs.last_lines()
        if text:
            report.sections.append(("services' last log lines", text))


@pytest.fixture(scope="session")
def npu_emulator():
    """The torch_npu emulator, installed for the rest of the session (a real torch_npu wins)."""
    from kernels.testing import fake_torch_npu
    fake_torch_npu.install()
    return fake_torch_npu


@pytest.fixture()
def npu_op_calls(npu_emulator, monkeypatch):
    """The emulator with every op counted: a Counter of torch_npu op name -> calls (proof
    that a path ran through the NPU ops)."""
    import collections
    import sys
    from kernels import get_backend
    calls: collections.Counter = collections.Counter()
    # the npu backend is cached: it may hold an emulator installed before this session's one
    modules = {id(m): m for m in (sys.modules["torch_npu"], get_backend("npu", "cpu")._npu)}
    for module in modules.values():
        for name in [n for n in vars(module) if n.startswith(("npu_", "_npu_"))]:
            op = getattr(module, name)

            def counted(*args, _op=op, _name=name, **kwargs):
                calls[_name] += 1
                return _op(*args, **kwargs)

            monkeypatch.setattr(module, name, counted)
    return calls


@pytest.fixture(scope="session")
def models_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("models")


@pytest.fixture(scope="session")
def tiny_model(models_dir):
    """tiny_model(arch, **sizes) -> folder made by the tiny maker (cached per arguments)."""
    made: dict[tuple, Path] = {}

    def get(arch: str = "llama", **kwargs) -> Path:
        key = (arch, tuple(sorted(kwargs.items())))
        if key not in made:
            name = f"tiny-{arch}-{len(made)}"
            made[key] = make_tiny_model(arch, models_dir / name, **kwargs)
        return made[key]

    return get


@pytest.fixture(scope="session")
def hf_saved_model(models_dir, tiny_model):
    """hf_saved_model(kind) -> folder written by transformers' save_pretrained on random
    weights (initializer_range raised so logits are not flat), with the tiny tokenizer."""
    made: dict[str, Path] = {}

    def get(kind: str) -> Path:
        if kind in made:
            return made[kind]
        import transformers as tf
        common = dict(vocab_size=1024, hidden_size=128, intermediate_size=352, num_hidden_layers=3,
                      num_attention_heads=8, max_position_embeddings=2048, initializer_range=0.15,
                      bos_token_id=1, eos_token_id=2)
        if kind == "llama-gqa":
            cfg = tf.LlamaConfig(num_key_value_heads=2, rope_theta=50000.0, **common)
            cls = tf.LlamaForCausalLM
        elif kind == "llama3-rope":
            cfg = tf.LlamaConfig(num_key_value_heads=4, rope_scaling={
                "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 256}, **common)
            cls = tf.LlamaForCausalLM
        elif kind == "llama-linear-rope":
            cfg = tf.LlamaConfig(num_key_value_heads=4, rope_scaling={"rope_type": "linear", "factor": 4.0},
                                 **common)
            cls = tf.LlamaForCausalLM
        elif kind == "qwen2-tied":
            cfg = tf.Qwen2Config(num_key_value_heads=2, tie_word_embeddings=True, **common)
            cls = tf.Qwen2ForCausalLM
        elif kind == "qwen3":
            cfg = tf.Qwen3Config(num_key_value_heads=4, head_dim=32, **common)
            cls = tf.Qwen3ForCausalLM
        elif kind == "mistral":
            cfg = tf.MistralConfig(num_key_value_heads=2, sliding_window=None, **common)
            cls = tf.MistralForCausalLM
        else:
            raise ValueError(kind)
        torch.manual_seed(1234)
        model = cls(cfg).eval()
        with torch.no_grad():  # qwen2 q/k/v biases start at zero; make them matter
            for name, p in model.named_parameters():
                if name.endswith("bias"):
                    p.normal_(0, 0.1)
        out = models_dir / f"hf-{kind}"
        model.save_pretrained(out)
        src = tiny_model("llama")
        for f in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(src / f, out / f)
        made[kind] = out
        return out

    return get


@pytest.fixture(scope="session")
def llm_factory():
    """llm_factory(model_dir, **engine_args) -> LLM, cached per arguments for the session."""
    from common.engine import LLM

    def get(model_dir, **kwargs):
        key = (str(model_dir), tuple(sorted(kwargs.items())))
        if key not in _ENGINES:
            _ENGINES[key] = LLM(str(model_dir), **kwargs)
        return _ENGINES[key]

    return get


def assert_no_blocks_in_use(engine) -> None:
    """Every block free: none referenced, none QUARANTINED, no request in any state."""
    bm, sched = engine.block_manager, engine.scheduler
    held = [b.block_id for b in bm.blocks if b.ref_count != 0]
    assert not held, f"blocks still referenced after the test: {held[:10]}"
    assert bm.num_free_blocks == bm.num_blocks
    assert not sched.quarantined and sched.num_quarantined_blocks == 0, "blocks still quarantined"
    assert not (sched.running or sched.waiting or sched.ready or sched.remote or sched.held)


@pytest.fixture(autouse=True, scope="module")
def fresh_prefix_caches():
    """Each module starts with empty prefix caches in the session's shared engines: what
    another module computed (or left with wrong KV, as a fake remote fill does) is never
    a hit here, whatever order the modules run in."""
    for llm in _ENGINES.values():
        llm.engine.block_manager.reset_prefix_cache()


@pytest.fixture(autouse=True)
def no_block_leaks():
    yield
    for llm in _ENGINES.values():
        assert_no_blocks_in_use(llm.engine)
