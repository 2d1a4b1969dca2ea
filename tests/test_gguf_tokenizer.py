"""The torch-free GGUF tokenizer (specjax.convert.gguf_tokenizer) against transformers' own GGUF tokenizer.

transformers' GGUF path needs torch, which specjax does not depend on; ours must give the same
token ids, the same decoded text and the same rendered chat template, for the embedded SmolLM2
file (byte-level BPE) and for hand-built files of the other kinds (SentencePiece BPE with and
without merges, a Llama-3 text split).
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

gguf = pytest.importorskip("gguf")

from specjax.convert.gguf import _field, _open_reader  # noqa: E402
from specjax.convert.gguf_tokenizer import byte_alphabet, gguf_tokenizer  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]

FRAGMENTS = [
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    "  leading spaces",
    "trailing  ",
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n",
    "for (int i = 0; i < 10; ++i) { x[i] = 0; }",
    "import numpy as np\nnp.zeros((3, 4), dtype=np.float32)",
    "SELECT * FROM users WHERE id = 42;",
    "12345 + 678 = 13023",
    "3.14159265358979",
    "1,000,000 people",
    "x**2 - 4*x + 4 == 0",
    "Ünïcödé façade naïve café",
    "日本語のテキストです。",
    "中文字符和标点，测试。",
    "한국어 문장입니다",
    "Ελληνικά και русский текст",
    "עברית ועربية",
    "emoji 😀🎉👍🏽 and flags 🇫🇷",
    "tabs\tand\nnewlines\r\nmixed",
    "\n\n\n",
    "    ",
    "",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|>",
    "text<|im_end|>more text",
    "I'm sure you're right, they'll see it's done.",
    "don't DON'T Don't",
    "https://example.com/path?query=1&b=2#frag",
    "email@example.org",
    "C:\\Windows\\System32",
    "   \n  \t indented\n\tblock",
    "a" * 40,
    "ab" * 25,
    "The the THE tHe",
    "\u00a0non-breaking\u2009thin",
    "zero\u200bwidth",
    "combining e\u0301 accent",
    "math ∑ ∫ √ ∞ ≠ ≤",
    "<think>reasoning</think>",
]


def varied_strings(n: int = 300, seed: int = 0) -> list[str]:
    """The fragments alone, then random joins of two to four of them (spaces, newlines, none)."""
    rng = random.Random(seed)
    out = list(FRAGMENTS)
    while len(out) < n:
        parts = rng.sample(FRAGMENTS, rng.randint(2, 4))
        out.append(rng.choice(["", " ", "\n", "\n\n", "  "]).join(parts))
    return out


def read_meta(path: Path) -> dict:
    reader = _open_reader(path)
    return {k: _field(reader, k) for k in reader.fields if k.startswith("tokenizer.")}


def transformers_gguf_tokenizer(path: Path):
    pytest.importorskip("torch")  # transformers' GGUF reader imports it
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name, local_files_only=True)


def assert_same_tokenizer(ours, ref, strings: list[str]) -> None:
    for s in strings:
        ids = ours(s)["input_ids"]
        assert ids == ref(s)["input_ids"], repr(s)
        assert ours(s, add_special_tokens=False)["input_ids"] == ref(s, add_special_tokens=False)["input_ids"]
        assert ours.decode(ids) == ref.decode(ids), repr(s)
        assert ours.decode(ids, skip_special_tokens=True) == ref.decode(ids, skip_special_tokens=True), repr(s)
    assert ours.convert_ids_to_tokens(list(range(len(ref)))) == ref.convert_ids_to_tokens(list(range(len(ref))))


# --------------------------------------------------------------------------- hand-built files


def write_tokenizer_gguf(
    path: Path,
    kind: str,
    tokens: list[str],
    types: list[int],
    *,
    pre: str | None = None,
    merges: list[str] | None = None,
    scores: list[float] | None = None,
    add_bos: bool | None = None,
    template: str | None = None,
) -> Path:
    """A GGUF holding tokenizer metadata only (enough for both tokenizer builders)."""
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tokenizer_model(kind)
    if pre is not None:
        w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    if merges is not None:
        w.add_token_merges(merges)
    if scores is not None:
        w.add_token_scores(scores)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    if add_bos is not None:
        w.add_add_bos_token(add_bos)
    if template is not None:
        w.add_chat_template(template)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def sentencepiece_vocab(strings: list[str], n_pieces: int = 300) -> tuple[list[str], list[float], list[int]]:
    """<unk> <s> </s>, the 256 byte tokens, then frequent `▁`-spelled substrings, scored by rank."""
    counts: dict[str, int] = {}
    for s in strings:
        text = "▁" + s.replace(" ", "▁")
        for n in range(1, 6):
            for i in range(len(text) - n + 1):
                piece = text[i : i + n]
                if "\n" not in piece and "\t" not in piece:
                    counts[piece] = counts.get(piece, 0) + 1
    singles = sorted({p for p in counts if len(p) == 1})
    longer = sorted((p for p in counts if len(p) > 1), key=lambda p: (-counts[p] * len(p), p))[:n_pieces]
    pieces = singles + longer
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + pieces
    types = [2, 3, 3] + [6] * 256 + [1] * len(pieces)
    scores = [0.0] * 259 + [-float(i) for i in range(len(pieces))]
    return tokens, scores, types


@pytest.mark.parametrize("with_merges", [False, True])
def test_sentencepiece_matches_transformers(tmp_path, with_merges):
    strings = varied_strings(200, seed=1)
    tokens, scores, types = sentencepiece_vocab(strings)
    merges = None
    if with_merges:
        from specjax.convert.gguf_tokenizer import merges_from_scores

        merges = [f"{a} {b}" for a, b in merges_from_scores(tokens, scores)]
    path = write_tokenizer_gguf(tmp_path / "spm.gguf", "llama", tokens, types, scores=scores, merges=merges)
    ours, ref = gguf_tokenizer(read_meta(path)), transformers_gguf_tokenizer(path)
    assert ours("hi")["input_ids"][0] == 1  # SentencePiece files add BOS unless they say otherwise
    assert_same_tokenizer(ours, ref, strings)


@pytest.mark.parametrize("pre", ["llama-bpe", "qwen2", "default"])
def test_byte_level_splits_match_transformers(tmp_path, pre):
    """Byte-level BPE with each family's text split, a control token and a user-defined one."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    strings = varied_strings(200, seed=2)
    trainer = trainers.BpeTrainer(
        vocab_size=700,
        special_tokens=["<|endoftext|>", "<|begin|>", "<|end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.train_from_iterator(strings, trainer)
    model = json.loads(bpe.to_str())["model"]
    tokens = [t for t, _ in sorted(model["vocab"].items(), key=lambda kv: kv[1])] + ["<think>"]
    types = [3, 3, 3] + [1] * (len(tokens) - 4) + [4]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    path = write_tokenizer_gguf(
        tmp_path / "bpe.gguf", "gpt2", tokens, types, pre=pre, merges=merges, add_bos=pre == "llama-bpe"
    )
    ours, ref = gguf_tokenizer(read_meta(path)), transformers_gguf_tokenizer(path)
    assert ours("<think>x")["input_ids"][int(pre == "llama-bpe")] == len(tokens) - 1  # kept whole
    assert_same_tokenizer(ours, ref, strings)


def test_unsupported_kind_is_one_line_error(tmp_path):
    path = write_tokenizer_gguf(tmp_path / "t5.gguf", "t5", ["<pad>", "</s>", "<unk>"], [3, 3, 2], scores=[0.0] * 3)
    with pytest.raises(ValueError, match="GGUF tokenizer model 't5' not supported") as e:
        gguf_tokenizer(read_meta(path))
    assert "\n" not in str(e.value)


def test_byte_alphabet_is_gpt2s():
    table = byte_alphabet()
    assert len(set(table.values())) == 256 and table[ord("A")] == "A" and table[ord(" ")] == "Ġ"
    assert table[ord("\n")] == "Ċ" and table[0] == "Ā"


def test_conversion_works_without_torch(tmp_path):
    """A whole GGUF -> HF conversion, tokenizer included, in a process where torch cannot load."""
    from tests.test_gguf_convert import write_tiny_gguf

    write_tiny_gguf(tmp_path / "tiny.gguf")
    script = textwrap.dedent(f"""
        import sys
        sys.modules["torch"] = None  # any `import torch` now raises ImportError
        from specjax.convert.gguf import gguf_to_hf
        from specjax.loading import load_tokenizer
        out = gguf_to_hf({str(tmp_path / "tiny.gguf")!r}, {str(tmp_path / "hf")!r})
        tok = load_tokenizer(out)
        assert tok.decode(tok("hello world").input_ids) == "hello world"
        assert "torch" not in {{m.split(".")[0] for m, v in sys.modules.items() if v is not None}}
        print("ok")
    """)
    r = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-2000:]


# --------------------------------------------------------------------------- the embedded model


@pytest.fixture(scope="module")
def smollm_gguf():
    from specjax.convert.registry import cache_dir, resolve_embedded

    resolve_embedded("smollm2-135m", quiet=True)
    return cache_dir() / "gguf" / "SmolLM2-135M-Instruct.Q4_1.gguf"


def test_embedded_smollm2_matches_transformers(smollm_gguf):
    """Ours, and the tokenizer the embedded model's converted directory loads with, against
    transformers' GGUF tokenizer (an independent reader of the same file)."""
    from transformers import AutoTokenizer

    from specjax.convert.registry import resolve_embedded

    ours, ref = gguf_tokenizer(read_meta(smollm_gguf)), transformers_gguf_tokenizer(smollm_gguf)
    assert_same_tokenizer(ours, ref, varied_strings(300))
    converted = AutoTokenizer.from_pretrained(resolve_embedded("smollm2-135m", quiet=True))
    assert_same_tokenizer(converted, ref, varied_strings(60, seed=1))
    assert json.loads(ours.backend_tokenizer.to_str()) == json.loads(ref.backend_tokenizer.to_str())
    chats = [
        [{"role": "user", "content": "Write a haiku about the sea."}],
        [
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": "2+2?"},
            {"role": "assistant", "content": "4"},
            {"role": "user", "content": "日本語で?"},
        ],
    ]
    for chat in chats:
        for gen in (False, True):
            text = ours.apply_chat_template(chat, tokenize=False, add_generation_prompt=gen)
            assert text == ref.apply_chat_template(chat, tokenize=False, add_generation_prompt=gen)
            assert ours(text)["input_ids"] == ref(text)["input_ids"]
