"""Lean loading: weights stream from memory-mapped safetensors (bfloat16 without torch), each piece
placed as it is read, so the host never holds a float32 copy of the model."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from specjax.checkpoint import CheckpointError
from specjax.loading import load_model

# ~1.5 GB of bfloat16: embedding and head 32000 x 2048, 13 layers of 2048 hidden, 5632 MLP, GQA.
BIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 2048,
    "intermediate_size": 5632,
    "num_hidden_layers": 13,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "vocab_size": 32000,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}
CHECKED = (
    "model.layers.5.self_attn.q_proj.weight",
    "model.layers.5.self_attn.k_proj.weight",
    "model.layers.12.mlp.up_proj.weight",
    "lm_head.weight",
)


def _hf_shapes(cfg: dict) -> dict[str, tuple]:
    d, f, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    hd = d // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    shapes = {"model.embed_tokens.weight": (v, d), "model.norm.weight": (d,), "lm_head.weight": (v, d)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes.update(
            {
                p + "input_layernorm.weight": (d,),
                p + "self_attn.q_proj.weight": (q, d),
                p + "self_attn.k_proj.weight": (kv, d),
                p + "self_attn.v_proj.weight": (kv, d),
                p + "self_attn.o_proj.weight": (d, q),
                p + "post_attention_layernorm.weight": (d,),
                p + "mlp.gate_proj.weight": (f, d),
                p + "mlp.up_proj.weight": (f, d),
                p + "mlp.down_proj.weight": (d, f),
            }
        )
    return shapes


def _bf16_tensor(name: str, shape: tuple) -> np.ndarray:
    """A reproducible bfloat16 tensor for `name`: random finite values in +-[1/2, 2)."""
    seed = sum(name.encode()) * 7919 + len(name)
    bits = np.random.default_rng(seed).integers(0, 1 << 16, size=shape, dtype=np.uint16)
    return ((bits & 0x80FF) | 0x3F00).view(ml_dtypes.bfloat16)


def _write_safetensors_by_hand(path: Path, shapes: dict[str, tuple]) -> int:
    """Write the file tensor by tensor (8-byte header length, JSON header, raw bytes) without
    the code under test; returns its size."""
    header, offset = {}, 0
    for name, shape in shapes.items():
        nbytes = int(np.prod(shape)) * 2
        header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(len(text).to_bytes(8, "little") + text)
        for name, shape in shapes.items():
            f.write(_bf16_tensor(name, shape).view(np.uint16).tobytes())
    return path.stat().st_size


def _run(script: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(script)], capture_output=True, text=True, timeout=300)


def test_bfloat16_model_loads_within_its_size_and_bit_exact(tmp_path):
    model_dir = tmp_path / "big"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps(BIG))
    shapes = _hf_shapes(BIG)
    size = _write_safetensors_by_hand(model_dir / "model.safetensors", shapes)
    out = tmp_path / "out"
    out.mkdir()
    q = BIG["hidden_size"]
    kv = BIG["num_key_value_heads"] * (q // BIG["num_attention_heads"])
    f = BIG["intermediate_size"]
    # The peak is the process's VmHWM, not ru_maxrss: Linux carries the parent's peak (pytest's,
    # gigabytes after other tests) into a child's ru_maxrss across exec. "5" resets it.
    p = _run(f"""
        import jax, jax.numpy as jnp, numpy as np
        from specjax.loading import load_model
        jax.devices()
        def status(key):
            line = next(l for l in open("/proc/self/status") if l.startswith(key + ":"))
            return int(line.split()[1]) * 1024
        base = status("VmRSS")
        try:
            open("/proc/self/clear_refs", "w").write("5")
        except OSError:
            pass
        model = load_model({str(model_dir)!r}, dtype=jnp.bfloat16, pack=False)
        jax.block_until_ready(model.params)
        print(status("VmHWM") - base)
        params = model.params
        assert all(a.dtype == jnp.bfloat16 for a in jax.tree_util.tree_leaves(params))
        wqkv, wgu = np.asarray(params["layers"][5]["wqkv"]), np.asarray(params["layers"][12]["w_gate_up"])
        got = {{"{CHECKED[0]}": wqkv[:{q}], "{CHECKED[1]}": wqkv[{q}:{q + kv}],
               "{CHECKED[2]}": wgu[{f}:], "{CHECKED[3]}": np.asarray(params["lm_head"])}}
        for i, name in enumerate(got):
            np.save({str(out)!r} + f"/{{i}}.npy", got[name].view(np.uint16))
    """)
    assert p.returncode == 0, p.stderr
    delta = int(p.stdout.split()[-1])
    figures = f"checkpoint {size / 2**30:.2f} GiB, peak RSS delta {delta / 2**30:.2f} GiB, ratio {delta / size:.2f}"
    print(figures)
    assert size > 1.4e9
    assert delta < 1.3 * size, figures
    for i, name in enumerate(CHECKED):
        want = _bf16_tensor(name, shapes[name]).view(np.uint16)
        np.testing.assert_array_equal(np.load(out / f"{i}.npy"), want, err_msg=name)


def _bf16_copy(src: Path, dst: Path) -> Path:
    """A copy of the HF directory `src` with its weights rounded to bfloat16."""
    from safetensors.numpy import load_file, save_file

    shutil.copytree(src, dst)
    tensors = {k: v.astype(ml_dtypes.bfloat16) for k, v in load_file(str(src / "model.safetensors")).items()}
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def test_bfloat16_safetensors_without_torch(tiny_llama, tmp_path):
    """bfloat16 weights load (as float32, and as bfloat16) and convert with torch unimportable,
    to the values torch read before."""
    from safetensors.torch import load_file

    src = _bf16_copy(Path(tiny_llama[0]), tmp_path / "bf16")
    before = {k: v.float().numpy() for k, v in load_file(str(src / "model.safetensors")).items()}
    p = _run(f"""
        import sys
        sys.modules["torch"] = None
        import jax, jax.numpy as jnp, numpy as np
        from specjax.convert.hf import convert_checkpoint
        from specjax.checkpoint import params_to_hf
        from specjax.loading import load_model
        model = load_model({str(src)!r}, dtype=jnp.float32, pack=False)
        np.savez({str(tmp_path / "f32.npz")!r}, **params_to_hf(model.params, model.config))
        out = convert_checkpoint({str(src)!r}, {str(tmp_path / "sj")!r})
        bf = load_model(str(out), dtype=jnp.bfloat16, pack=False)
        assert all(a.dtype == jnp.bfloat16 for a in jax.tree_util.tree_leaves(bf.params))
        np.savez({str(tmp_path / "bf16.npz")!r},
                 **{{k: np.asarray(v, np.float32) for k, v in params_to_hf(bf.params, bf.config).items()}})
    """)
    assert p.returncode == 0, p.stderr
    for file in ("f32.npz", "bf16.npz"):
        got = np.load(tmp_path / file)
        assert set(got.files) == set(before)
        for name, want in before.items():
            np.testing.assert_array_equal(got[name], want, err_msg=f"{file}: {name}")
    data = (tmp_path / "sj" / "model.safetensors").read_bytes()
    header = json.loads(data[8 : 8 + int.from_bytes(data[:8], "little")])
    assert header["layers.0.wqkv"]["dtype"] == "BF16"  # converted as stored, not widened


def _edited(src: Path, dst: Path, name: str, value: np.ndarray) -> Path:
    from safetensors.numpy import load_file, save_file

    shutil.copytree(src, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    tensors[name] = value
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def test_wrong_dtype_is_named_in_one_line(tiny_llama, tmp_path):
    name = "model.layers.1.self_attn.k_proj.weight"
    src = Path(tiny_llama[0])
    d = _edited(src, tmp_path / "ints", name, np.zeros((32, 64), np.int32))
    with pytest.raises(CheckpointError, match=name.replace(".", r"\.")) as e:
        load_model(str(d))
    assert "dtype int32" in str(e.value) and "\n" not in str(e.value)


def test_specjax_checkpoint_shape_is_checked(tiny_llama, tmp_path):
    from safetensors.numpy import load_file, save_file

    from specjax.convert.hf import convert_checkpoint

    d = convert_checkpoint(tiny_llama[0], tmp_path / "sj")
    tensors = load_file(str(d / "model.safetensors"))
    tensors["layers.1.w_down"] = tensors["layers.1.w_down"][:, :-1].copy()
    save_file(tensors, str(d / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"layers\.1\.w_down.*shape") as e:
        load_model(str(d))
    assert "\n" not in str(e.value)


def test_offsets_that_disagree_with_the_shape_are_corrupt(tiny_llama, tmp_path):
    d = shutil.copytree(tiny_llama[0], tmp_path / "bad")
    w = d / "model.safetensors"
    data = w.read_bytes()
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + n])
    name = "model.norm.weight"
    header[name]["data_offsets"][1] += 4
    text = json.dumps(header, separators=(",", ":")).encode()
    assert len(text) <= n
    w.write_bytes(data[:8] + text.ljust(n) + data[8 + n :])
    with pytest.raises(CheckpointError, match="corrupt or truncated.*" + name.replace(".", r"\.")):
        load_model(str(d))
