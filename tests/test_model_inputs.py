"""Bad input gets a typed error before anything is computed; configs parse from real HF config.json files;
weights are checked tensor by tensor; the fingerprint and cache schema are deterministic and meaningful."""

from __future__ import annotations

import pytest
import torch
from kvpool.model.cache_schema import CacheSchema
from kvpool.model.config import KDA, MLA
from kvpool.model.decode_state import DecodeState
from kvpool.model.errors import (
    BadBoundaryError,
    BadStartStateError,
    ConfigError,
    EmptyPromptError,
    ModelInputError,
    TokenOutOfRangeError,
    UnsupportedConfigError,
    WeightsError,
)
from kvpool.model.hf_config import config_from_hf, config_to_hf, read_config_json
from kvpool.model.hybrid import HybridModel
from kvpool.model.loader import load_model
from kvpool.model.state import KDACheckpoint, PrefixState
from kvpool.model.tiny import build_tiny, tiny_config
from kvpool.model.tokenizer import ByteTokenizer
from kvpool.model.weights import load_checkpoint, save_checkpoint

pytestmark = pytest.mark.usefixtures("torch_deterministic")


@pytest.fixture(scope="module")
def model():
    return build_tiny()


def test_bad_tokens(model):
    with pytest.raises(EmptyPromptError):
        model.prefill([])
    with pytest.raises(TokenOutOfRangeError, match="1024 at position 2"):
        model.prefill([5, 6, 1024])
    with pytest.raises(TokenOutOfRangeError):
        model.prefill(torch.tensor([3, -1]))
    with pytest.raises(ModelInputError):
        model.prefill([1.5, 2])
    with pytest.raises(ModelInputError):
        model.prefill(torch.ones(2, 3, dtype=torch.long))
    with pytest.raises(ModelInputError):
        model.prefill([3, 4], logits="some")
    st = DecodeState.from_prefill(model.prefill([3, 4, 5]))
    with pytest.raises(TokenOutOfRangeError):
        model.decode_step(99999, st)
    assert st.n_tokens == 3  # the failed step changed nothing
    assert issubclass(TokenOutOfRangeError, ValueError)


def test_bad_start_and_boundaries(model):
    ids = list(range(3, 203))
    full = model.prefill(ids, boundaries=[64, 128])
    with pytest.raises(BadStartStateError, match="multiple of 64"):
        model.prefill(ids[100:], start=PrefixState(100, KDACheckpoint(100, full.final.layers), {}))
    good = full.prefix(128)
    with pytest.raises(BadStartStateError, match="latents"):
        model.prefill(ids[128:], start=PrefixState(128, good.kda, {i: r[:64] for i, r in good.mla.items()}))
    with pytest.raises(BadStartStateError, match="KDA checkpoint is at"):
        model.prefill(ids[128:], start=PrefixState(128, full.checkpoints[64], good.mla))
    with pytest.raises(BadStartStateError):
        model.prefill(ids[128:], start="nope")
    with pytest.raises(BadBoundaryError, match="segment end"):
        model.prefill(ids, boundaries=[100])
    with pytest.raises(BadBoundaryError, match="not in"):
        model.prefill(ids[128:], start=good, boundaries=[64])
    with pytest.raises(BadBoundaryError):
        model.prefill(ids, boundaries=[256])
    with pytest.raises(BadBoundaryError):
        full.prefix(100)


def test_generate_and_eos(model):
    out = model.generate([1, 50, 60, 70], 10, eos_ids=())
    assert len(out) == 10
    first = out[0]
    assert model.generate([1, 50, 60, 70], 10, eos_ids=[first]) == [first]
    assert model.generate([1, 50], 0) == []
    with pytest.raises(ModelInputError):
        model.generate([1, 2], -1)


def test_hf_config_roundtrip(tmp_path):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.KimiLinearConfig(
        vocab_size=512,
        hidden_size=64,
        num_hidden_layers=8,
        linear_num_heads=2,
        linear_head_dim=16,
        num_attention_heads=2,
        kv_lora_rank=32,
        qk_rope_head_dim=8,
        qk_nope_head_dim=16,
        v_head_dim=16,
        layer_types=[KDA, KDA, KDA, MLA] * 2,
        mlp_layer_types=["dense"] + ["sparse"] * 7,
        num_local_experts=4,
        num_experts_per_tok=2,
        q_lora_rank=24,
        tie_word_embeddings=False,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    cfg.save_pretrained(tmp_path)
    ours = read_config_json(tmp_path)
    assert ours.mla_layers == (3, 7) and ours.kda_layers == (0, 1, 2, 4, 5, 6)
    assert ours.mlp_layer_types[0] == "dense" and ours.mlp_layer_types[1] == "sparse"
    assert (ours.num_experts, ours.num_experts_per_tok, ours.q_lora_rank) == (4, 2, 24)
    assert (ours.kda_num_heads, ours.kda_head_dim, ours.kda_conv_kernel) == (2, 16, 4)
    assert config_from_hf(config_to_hf(ours)) == ours
    back = transformers.KimiLinearConfig(**config_to_hf(ours))  # and transformers reads ours the same way
    assert back.layer_types == list(ours.layer_types) and back.num_local_experts == 4
    assert back.linear_num_heads == 2 and back.mlp_layer_types == list(ours.mlp_layer_types)


def test_original_moonshot_config_spelling():
    """Kimi-Linear-48B style: 1-based linear_attn_config lists, first_k_dense_replace, alias names."""
    d = {
        "model_type": "kimi_linear",
        "vocab_size": 163840,
        "hidden_size": 2304,
        "num_hidden_layers": 27,
        "linear_attn_config": {
            "full_attn_layers": [4, 8, 12, 16, 20, 24, 27],
            "head_dim": 128,
            "num_heads": 32,
            "short_conv_kernel_size": 4,
            "kda_layers": [i for i in range(1, 28) if i not in (4, 8, 12, 16, 20, 24, 27)],
        },
        "first_k_dense_replace": 1,
        "num_experts": 256,
        "num_experts_per_token": 8,
        "num_shared_experts": 1,
        "moe_intermediate_size": 1024,
        "moe_renormalize": True,
        "moe_router_activation_func": "sigmoid",
        "num_expert_group": 1,
        "topk_group": 1,
        "mla_use_nope": True,
        "q_lora_rank": None,
        "kv_lora_rank": 512,
        "qk_rope_head_dim": 64,
        "qk_nope_head_dim": 128,
        "v_head_dim": 128,
        "num_attention_heads": 32,
        "eos_token_id": 163586,
        "bos_token_id": 163584,
        "pad_token_id": 163839,
        "rope_theta": 10000.0,
    }
    c = config_from_hf(d)
    assert c.mla_layers == (3, 7, 11, 15, 19, 23, 26) and len(c.kda_layers) == 20
    assert c.mlp_layer_types[0] == "dense" and set(c.mlp_layer_types[1:]) == {"sparse"}
    assert c.latent_dim == 576 and c.num_experts_per_tok == 8 and c.eos_token_id == (163586,)
    assert c.extra == {"rope_theta": 10000.0}


@pytest.mark.parametrize(
    "patch,err",
    [
        ({"mla_use_nope": False}, UnsupportedConfigError),
        ({"model_type": "llama"}, UnsupportedConfigError),
        ({"moe_router_activation_func": "softmax"}, UnsupportedConfigError),
        ({"hidden_act": "gelu"}, UnsupportedConfigError),
        (
            {"layer_types": ["linear_attention", "sliding_attention", "linear_attention", "full_attention"]},
            UnsupportedConfigError,
        ),
        ({"layer_types": ["linear_attention"]}, ConfigError),
        ({"quantization_config": {"quant_method": "fp8"}}, UnsupportedConfigError),
        ({"linear_attn_config": {"full_attn_layers": [0], "kda_layers": [1, 2, 3]}}, ConfigError),
        ({"hidden_size": -4}, ConfigError),
    ],
)
def test_unsupported_and_malformed_configs(patch, err):
    d = config_to_hf(tiny_config())
    if "linear_attn_config" in patch:
        d.pop("layer_types")
    d.update(patch)
    with pytest.raises(err):
        config_from_hf(d)


def test_weights_errors_name_the_tensor(tmp_path, model):
    save_checkpoint(model, tmp_path)
    from safetensors.torch import load_file, save_file

    tensors = load_file(tmp_path / "model.safetensors")
    victim = "model.layers.3.self_attn.kv_b_proj.weight"
    for mutate, kind in [
        (lambda t: t.pop(victim), "lacks"),
        (lambda t: t.__setitem__("model.layers.9.extra.weight", torch.zeros(1)), "unexpected"),
        (lambda t: t.__setitem__(victim, torch.zeros(3, 3)), "shape"),
    ]:
        bad = dict(tensors)
        mutate(bad)
        save_file(bad, tmp_path / "model.safetensors")
        with pytest.raises(WeightsError, match=kind) as info:
            load_checkpoint(tmp_path)
        assert info.value.tensor is not None
    with pytest.raises(WeightsError):
        load_checkpoint(tmp_path / "nowhere")
    with pytest.raises(ModelInputError):
        load_model(str(tmp_path / "nowhere"))


def test_fingerprint_and_schema(model):
    fp = model.fingerprint()
    assert len(fp) == 32 and build_tiny().fingerprint() == fp
    other = build_tiny(seed=1)
    assert other.fingerprint() != fp
    with torch.no_grad():
        other = build_tiny()
        other.model.norm.weight[0] += 1e-6
        other.invalidate_fingerprint()
    assert other.fingerprint() != fp
    s = model.cache_schema(block_size=128)
    assert isinstance(s, CacheSchema)
    assert (s.mla_layers, s.kda_layers, s.latent_dim, s.mla_dtype) == ((3,), (0, 1, 2), 80, "float32")
    assert s.state_shape == (4, 32, 32) and s.conv_shape == (3, 384) and s.block_size == 128
    assert s.kda_checkpoint_bytes() == 3 * (16384 + 1152 * 4)  # overview §7.4 sizes (fp32 conv state)
    res = model.prefill(list(range(3, 200)))
    st = res.final.layers[0]
    assert tuple(st.recurrent.shape) == s.state_shape and tuple(st.conv.shape) == s.conv_shape
    assert res.mla[3].shape == (197, s.latent_dim)
    with pytest.raises(ModelInputError):
        model.cache_schema(block_size=100)


def test_byte_tokenizer_roundtrip():
    tok = ByteTokenizer(1024)
    ids = tok.encode("héllo, KDA")
    assert ids[0] == 1 and max(ids) < 259
    assert tok.decode(ids) == "héllo, KDA"
    with pytest.raises(ModelInputError):
        ByteTokenizer(100)


def test_bf16_model_keeps_fp32_state():
    m = HybridModel(tiny_config(), dtype=torch.bfloat16)
    r = m.prefill(list(range(3, 80)))
    assert r.final.layers[0].recurrent.dtype == torch.float32
    assert r.final.layers[0].conv.dtype == torch.bfloat16 and r.mla[3].dtype == torch.bfloat16
    assert m.cache_schema().mla_dtype == "bfloat16"


def test_tokenizer_json_is_used_when_present(tmp_path):
    from kvpool.model.tokenizer import HFTokenizer, load_tokenizer
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({"[UNK]": 0, "hello": 5, "world": 6}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    loaded = load_tokenizer(tmp_path, tiny_config())
    assert isinstance(loaded, HFTokenizer) and loaded.encode("hello world") == [5, 6]
    assert loaded.decode([5, 6]) == "hello world"
    assert isinstance(load_tokenizer(tmp_path / "empty", tiny_config()), ByteTokenizer)


def test_start_state_dtype_mismatch_is_refused(model):
    ids = list(range(3, 150))
    good = model.prefill(ids[:128]).prefix()
    bf16 = PrefixState(128, good.kda, {i: r.to(torch.bfloat16) for i, r in good.mla.items()})
    with pytest.raises(BadStartStateError, match="bfloat16"):
        model.prefill(ids[128:], start=bf16)
    st = DecodeState.from_prefix(bf16)
    with pytest.raises(BadStartStateError):
        model.decode_step(5, st)
