"""A GGUF file's tokenizer, rebuilt from its metadata with `tokenizers` alone (no torch).

A GGUF carries no tokenizer.json: llama.cpp stores the vocabulary, merges, token types, special
token ids and chat template as `tokenizer.*` metadata. transformers can turn those into a fast
tokenizer, but its GGUF reader imports torch, which specjax does not depend on. This module builds
the same `tokenizers` pipeline transformers builds for the two vocabulary kinds Llama-family files
use, so token ids and decoded text are identical (tests/test_gguf_tokenizer.py checks that):

- `gpt2`: byte-level BPE (SmolLM, Llama-3, Qwen2, ...); `tokenizer.ggml.pre` picks the text split.
- `llama`: SentencePiece BPE with byte fallback (Llama-1/2, Mistral, TinyLlama, ...).
"""

from __future__ import annotations

from typing import Any, Mapping

from tokenizers import AddedToken, Regex, Tokenizer, decoders, pre_tokenizers, processors
from tokenizers.models import BPE

# llama.cpp's token types (`tokenizer.ggml.token_type`).
CONTROL, USER_DEFINED = 3, 4

# Text splits of byte-level vocabularies, by `tokenizer.ggml.pre`: the regex each vocabulary's
# merges were learned on. A name not listed keeps GPT-2's own split (ByteLevel's built-in regex).
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
BYTE_LEVEL_SPLITS = {
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "smaug-bpe", "dbrx", "falcon3"), _LLAMA3_SPLIT),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen"), _QWEN2_SPLIT),
}
SUPPORTED_MODELS = ("gpt2", "llama")


def gguf_tokenizer(meta: Mapping[str, Any]):
    """A `PreTrainedTokenizerFast` from a GGUF's metadata (`meta`: key -> Python value).

    Raises `ValueError` naming the problem for a vocabulary kind we cannot build.
    """
    from transformers import PreTrainedTokenizerFast

    kind = meta.get("tokenizer.ggml.model")
    tokens = meta.get("tokenizer.ggml.tokens")
    if kind not in SUPPORTED_MODELS:
        raise ValueError(f"GGUF tokenizer model {kind!r} not supported (supported: {', '.join(SUPPORTED_MODELS)})")
    if not tokens:
        raise ValueError("GGUF metadata has no tokenizer.ggml.tokens")
    add_bos = meta.get("tokenizer.ggml.add_bos_token")
    add_bos = (kind == "llama") if add_bos is None else bool(add_bos)  # llama.cpp's default for SPM
    add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False))
    tok = _byte_level(meta) if kind == "gpt2" else _sentencepiece(meta)
    _add_typed_tokens(tok, meta, byte_level=kind == "gpt2")
    special = special_token_strings(meta)
    tok.post_processor = _post_processor(special, tok, add_bos, add_eos)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        chat_template=meta.get("tokenizer.chat_template"),
        **special,
        clean_up_tokenization_spaces=False,
    )
    fast.add_bos_token, fast.add_eos_token = add_bos, add_eos  # kept in tokenizer_config.json
    return fast


def special_token_strings(meta: Mapping[str, Any]) -> dict[str, str]:
    """bos/eos/unk/pad token strings, looked up from the GGUF's special token ids."""
    tokens = meta.get("tokenizer.ggml.tokens") or []
    ids = {
        "bos_token": "bos_token_id",
        "eos_token": "eos_token_id",
        "unk_token": "unknown_token_id",
        "pad_token": "padding_token_id",
    }
    out = {}
    for name, key in ids.items():
        i = meta.get(f"tokenizer.ggml.{key}")
        if i is not None and 0 <= i < len(tokens):
            out[name] = tokens[i]
    return out


# --------------------------------------------------------------------------- the two kinds


def byte_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable character table: printable Latin-1 bytes stand for themselves,
    the other 68 bytes take the code points from 256 upwards, in byte order."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {b: chr(b) for b in keep}, 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return dict(sorted(table.items()))


def _byte_level(meta: Mapping[str, Any]) -> Tokenizer:
    """Byte-level BPE. Tokens the file spells outside the byte alphabet (a control token with a
    space, say) are respelled byte by byte, as the merges refer to them."""
    table = byte_alphabet()
    alphabet = set(table.values())

    def spelled(t: str) -> str:
        return t if set(t) <= alphabet else "".join(table[b] for b in t.encode("utf-8"))

    vocab = {spelled(t): i for i, t in enumerate(meta["tokenizer.ggml.tokens"])}
    tok = Tokenizer(
        BPE(
            vocab=vocab,
            merges=_merges(meta),
            dropout=None,
            continuing_subword_prefix="",
            end_of_word_suffix="",
            fuse_unk=False,
        )
    )
    split = BYTE_LEVEL_SPLITS.get(meta.get("tokenizer.ggml.pre"))
    if split is None:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(split), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    tok.decoder = decoders.ByteLevel()
    return tok


def _sentencepiece(meta: Mapping[str, Any]) -> Tokenizer:
    """SentencePiece BPE over `▁`-spelled pieces, unknown bytes falling back to `<0xXX>` tokens."""
    prefix_space = meta.get("tokenizer.ggml.add_space_prefix")
    prefix_space = True if prefix_space is None else bool(prefix_space)
    vocab = {t: i for i, t in enumerate(meta["tokenizer.ggml.tokens"])}
    tok = Tokenizer(BPE(vocab=vocab, merges=_merges(meta), fuse_unk=True, byte_fallback=True, dropout=None))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="▁", prepend_scheme="first" if prefix_space else "never", split=False
    )
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if prefix_space:
        steps.append(decoders.Strip(content=" ", left=1, right=0))
    tok.decoder = decoders.Sequence(steps)
    return tok


def _merges(meta: Mapping[str, Any]) -> list[tuple[str, str]]:
    """The file's merges, or (SentencePiece files without them) the merges its scores imply."""
    merges = meta.get("tokenizer.ggml.merges")
    if merges is not None:
        return [tuple(m.split(" ")) for m in merges]
    tokens, scores = meta["tokenizer.ggml.tokens"], meta.get("tokenizer.ggml.scores")
    if scores is None or len(scores) != len(tokens):
        raise ValueError("GGUF tokenizer has neither merges nor one score per token")
    return merges_from_scores(tokens, scores)


def merges_from_scores(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """Every split of a piece into two pieces of the vocabulary, best-scored piece first.

    A SentencePiece BPE model merges in order of the resulting piece's score; ties go to the
    shorter left part, then the shorter right part, then vocabulary order (the order transformers'
    converter produces, which these tokenizers must reproduce id for id).
    """
    vocab = {t: i for i, t in enumerate(tokens)}
    score = {t: s for t, s in zip(tokens, scores)}  # a repeated token keeps its last score
    found = []
    for piece, s in score.items():
        pairs = [(piece[:k], piece[k:]) for k in range(1, len(piece)) if piece[:k] in vocab and piece[k:] in vocab]
        pairs.sort(key=lambda p: (vocab[p[0]], vocab[p[1]]))
        found += [(left, right, s) for left, right in pairs]
    found.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)  # stable: ties keep the order above
    return [(left, right) for left, right, _ in found]


# --------------------------------------------------------------------------- special tokens


def _add_typed_tokens(tok: Tokenizer, meta: Mapping[str, Any], byte_level: bool) -> None:
    """Control tokens (`<|im_end|>`) become special added tokens and user-defined ones (`<think>`)
    plain added tokens, so the text's occurrences stay whole instead of being cut into pieces.

    In a byte-level vocabulary a control token spelled outside the byte alphabet is a llama.cpp
    mislabel and is left alone (adding it would grow the vocabulary past the model's)."""
    tokens, types = meta["tokenizer.ggml.tokens"], meta.get("tokenizer.ggml.token_type") or ()
    alphabet = set(byte_alphabet().values()) if byte_level else None
    control = [
        AddedToken(t, normalized=False, special=True)
        for t, k in zip(tokens, types)
        if k == CONTROL and (alphabet is None or set(t) <= alphabet)
    ]
    if control:
        tok.add_special_tokens(control)
    vocab = tok.get_vocab()
    user = [
        AddedToken(t, normalized=False, special=False)
        for t, k in zip(tokens, types)
        if k == USER_DEFINED and t in vocab
    ]
    if user:
        tok.add_tokens(user)


def _post_processor(special: dict[str, str], tok: Tokenizer, add_bos: bool, add_eos: bool):
    """BOS/EOS around each sequence as the file asks (`tokenizer.ggml.add_bos_token` etc.)."""
    bos = special.get("bos_token") if add_bos else None
    eos = special.get("eos_token") if add_eos else None
    single = [s for s in (bos and f"{bos}:0", "$A:0", eos and f"{eos}:0") if s]
    pair = single + [s for s in (bos and f"{bos}:1", "$B:1", eos and f"{eos}:1") if s]
    ids = [(t, tok.token_to_id(t)) for t in (bos, eos) if t]
    return processors.TemplateProcessing(single=single, pair=pair, special_tokens=ids)
