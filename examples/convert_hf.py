"""Convert a Hugging Face Llama checkpoint and public EAGLE / Medusa heads, then generate.

The commands this runs are the ones you would type:

    specjax convert HF_MODEL_DIR --out OUT/model        # config.json + *.safetensors or .bin
    specjax convert EAGLE_DIR    --out OUT/eagle        # SafeAILab EAGLE-1/2 heads
    specjax convert MEDUSA_DIR   --out OUT/medusa       # FasterDecoding Medusa heads
    specjax generate --model OUT/model --method eagle2 --heads OUT/eagle --prompt ... --json

Give your own directories (--model, --eagle, --medusa); whatever is missing is built here as a
tiny random checkpoint in the public layout, so the example runs with no model hub. Random heads
guess badly (about 1 token per step): the point is the conversion, and that speculative
decoding stays lossless (greedy text equal to vanilla) whatever the heads.

    python examples/convert_hf.py [--model DIR] [--eagle DIR] [--medusa DIR] [--out DIR]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import shlex
import tempfile
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

from specjax import settings
from specjax.cli import main as specjax

RNG = np.random.default_rng(0)


def randn(*shape, scale=0.2):
    return (scale * RNG.standard_normal(shape)).astype(np.float32)


def tiny_tokenizer(out: Path):
    """A byte-level BPE tokenizer (~300 tokens) trained on a few sentences, saved to `out`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    text = [
        "The quick brown fox jumps over the lazy dog.",
        "def add(a, b):\n    return a + b",
        "Speculative decoding drafts tokens and verifies them in one pass.",
    ] * 10
    tok.train_from_iterator(
        text,
        trainers.BpeTrainer(
            vocab_size=300,
            show_progress=False,
            special_tokens=["<unk>", "<s>", "</s>"],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        ),
    )
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>").save_pretrained(
        str(out)
    )


def llama_layer(prefix: str, cfg: dict, input_norm: bool = True) -> dict:
    """Random tensors of one Llama decoder layer, Hugging Face names, [out, in] weights."""
    d, f = cfg["hidden_size"], cfg["intermediate_size"]
    hd = d // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    t = {
        "self_attn.q_proj.weight": randn(q, d),
        "self_attn.k_proj.weight": randn(kv, d),
        "self_attn.v_proj.weight": randn(kv, d),
        "self_attn.o_proj.weight": randn(d, q),
        "post_attention_layernorm.weight": np.ones(d, np.float32),
        "mlp.gate_proj.weight": randn(f, d),
        "mlp.up_proj.weight": randn(f, d),
        "mlp.down_proj.weight": randn(d, f),
    }
    if input_norm:
        t["input_layernorm.weight"] = np.ones(d, np.float32)
    return {prefix + k: v for k, v in t.items()}


def tiny_llama(out: Path) -> Path:
    """A Hugging Face LlamaForCausalLM directory: config.json, model.safetensors, tokenizer."""
    out.mkdir(parents=True, exist_ok=True)
    cfg = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": 320,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 512,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": True,
        "hidden_act": "silu",
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    tensors = {
        "model.embed_tokens.weight": randn(cfg["vocab_size"], cfg["hidden_size"], scale=1.0),
        "model.norm.weight": np.ones(cfg["hidden_size"], np.float32),
    }
    for i in range(cfg["num_hidden_layers"]):
        tensors.update(llama_layer(f"model.layers.{i}.", cfg))
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    tiny_tokenizer(out)
    return out


def eagle_heads(out: Path, cfg: dict) -> Path:
    """SafeAILab EAGLE-1/2 layout: a one-layer Llama config, `fc` over [embedding; feature] and
    `layers.0.*` (no input norm: the fc output goes straight into attention)."""
    out.mkdir(parents=True, exist_ok=True)
    d = cfg["hidden_size"]
    tensors = {"fc.weight": randn(d, 2 * d), "fc.bias": randn(d)}
    tensors.update(llama_layer("layers.0.", cfg, input_norm=False))
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps({**cfg, "num_hidden_layers": 1}, indent=2))
    return out


def medusa_heads(out: Path, cfg: dict, num_heads: int = 4) -> Path:
    """FasterDecoding Medusa layout: head h = ResBlock (`{h}.0.linear`) then a vocabulary
    projection (`{h}.1.weight`); config.json names the head and ResBlock counts."""
    out.mkdir(parents=True, exist_ok=True)
    d, v = cfg["hidden_size"], cfg["vocab_size"]
    tensors = {}
    for h in range(num_heads):
        tensors.update(
            {f"{h}.0.linear.weight": randn(d, d), f"{h}.0.linear.bias": randn(d), f"{h}.1.weight": randn(v, d)}
        )
    save_file(tensors, str(out / "medusa_lm_head.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps({"medusa_num_heads": num_heads, "medusa_num_layers": 1}))
    return out


def run(*argv) -> str:
    """Run `specjax ARGV` in this process (as typed in a shell); returns what it printed."""
    print("$ specjax " + shlex.join(argv), flush=True)
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        code = specjax(list(argv))
    if code:
        raise SystemExit(f"specjax {argv[0]} failed with exit code {code}")
    return buf.getvalue()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="Hugging Face Llama-family directory (default: a tiny one)")
    ap.add_argument("--eagle", help="SafeAILab EAGLE-1/2 head directory (default: random heads)")
    ap.add_argument("--medusa", help="FasterDecoding Medusa head directory (default: random)")
    ap.add_argument("--out", help="output folder (default: a temporary one)")
    ap.add_argument("--prompt", default="The quick brown fox")
    ap.add_argument("--max-new-tokens", type=int, default=None)
    ap.add_argument("--smoke", action="store_true", help="few tokens (CI)")
    args = ap.parse_args()
    smoke = args.smoke or settings.examples_smoke()
    max_new = str(args.max_new_tokens or (16 if smoke else 64))
    out = Path(args.out or tempfile.mkdtemp(prefix="specjax-convert-"))

    src = Path(args.model) if args.model else tiny_llama(out / "hf-tiny-llama")
    cfg = json.loads((src / "config.json").read_text())
    eagle = Path(args.eagle) if args.eagle else eagle_heads(out / "safailab-eagle", cfg)
    medusa = Path(args.medusa) if args.medusa else medusa_heads(out / "fasterdecoding-medusa", cfg)

    run("convert", str(src), "--out", str(out / "model"))
    run("convert", str(eagle), "--out", str(out / "eagle"))
    run("convert", str(medusa), "--out", str(out / "medusa"))

    common = ["--model", str(out / "model"), "--raw", "--prompt", args.prompt, "--max-new-tokens", max_new, "--json"]
    methods = {
        "vanilla": [],
        # EAGLE-2's dynamic tree, sized for a CPU (the paper's GPU setting: 60 / 6 / 10).
        "eagle2": [
            "--heads",
            str(out / "eagle"),
            "--eagle-total-tokens",
            "8",
            "--eagle-depth",
            "3",
            "--eagle-top-k",
            "3",
        ],
        "medusa": ["--heads", str(out / "medusa"), "--medusa-choices", "[[0], [1], [0, 0], [0, 0, 0], [0, 0, 0, 0]]"],
    }
    vanilla = None
    for name, extra in methods.items():
        rec = json.loads(run("generate", "--method", name, *common, *extra).splitlines()[0])
        if vanilla is None:  # the first run is vanilla decoding: the reference text
            vanilla = rec["token_ids"]
            note = "" if args.model else "  (random weights: noise is expected)"
            print(f"text={rec['text']!r}{note}")
        same = rec["token_ids"] == vanilla  # lossless: any heads give vanilla's greedy text
        print(
            f"method={name} mean_accepted={rec['mean_accepted']:.2f} "
            f"tokens_per_s={rec['tokens_per_s']:.1f} same_as_vanilla={same}",
            flush=True,
        )
    print(f"converted checkpoints in {out}")


if __name__ == "__main__":
    main()
