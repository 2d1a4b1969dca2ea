"""The `specjax` command (its output, options and one-line errors), on tiny random models from
conftest."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import make_tiny_hf_model

from specjax.cli import main

JSON_FIELDS = {"prompt", "text", "token_ids", "new_tokens", "steps", "mean_accepted", "seconds", "tokens_per_s"}
PROMPTS = [
    "Hello! How are you today?",
    "What is the capital of France?",
    "def add(a, b):\n    return a + b\n\nSummarize the following text in one sentence.",
]


# --------------------------------------------------------------------------- helpers / fixtures


def run(capsys, *args):
    """(exit code, stdout, stderr) of `specjax ARGS` run in-process."""
    capsys.readouterr()
    rc = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return rc, out, err


def run_json(capsys, *args):
    rc, out, err = run(capsys, "generate", *args, "--json")
    assert rc == 0, err
    return [json.loads(line) for line in out.splitlines()]


def assert_error(capsys, *args, words=()):
    """The command fails with exactly one stderr line, no traceback, naming every word."""
    rc, out, err = run(capsys, *args)
    assert rc != 0
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert "Traceback" not in err
    assert lines[0].startswith("specjax: error:"), err
    for w in words:
        assert w.lower() in lines[0].lower(), (w, lines[0])
    return lines[0]


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path_factory, monkeypatch):
    """GGUF conversions and embedded models must never touch the user's cache."""
    monkeypatch.setenv("SPECJAX_CACHE", str(tmp_path_factory.getbasetemp() / "specjax-cache"))
    monkeypatch.delenv("SPECJAX_DEBUG", raising=False)


@pytest.fixture(scope="session")
def model_dir(tiny_llama):
    return str(tiny_llama[0])


@pytest.fixture(scope="session")
def loaded(model_dir):
    """(Model, Engine) of the tiny Llama, to compare the CLI against the library."""
    from specjax import Engine, load_model

    model = load_model(model_dir)
    return model, Engine(model.params, model.config, num_pages=64, page_size=16)


def engine_greedy(loaded, ids, n=8):
    from specjax import SamplingConfig

    _, engine = loaded
    return engine.generate([ids], n, sampling=SamplingConfig()).token_ids[0]


# --------------------------------------------------------------------------- JSON contract


def test_json_contract(capsys, model_dir, loaded):
    recs = run_json(capsys, "--model", model_dir, "--prompt", PROMPTS[0], "--prompt", PROMPTS[1], "--max-new-tokens", 8)
    assert [r["prompt"] for r in recs] == PROMPTS[:2]
    tok = loaded[0].tokenizer
    for r in recs:
        assert set(r) == JSON_FIELDS
        ids = r["token_ids"]
        assert isinstance(ids, list) and all(isinstance(t, int) for t in ids)
        assert r["new_tokens"] == len(ids)
        assert 1 <= len(ids) <= 8
        assert r["steps"] == r["new_tokens"]  # vanilla: one target forward per token
        assert r["mean_accepted"] == pytest.approx(r["new_tokens"] / r["steps"])
        assert r["seconds"] > 0
        assert r["tokens_per_s"] == pytest.approx(r["new_tokens"] / r["seconds"], rel=1e-6)
        assert r["text"] == tok.decode(ids, skip_special_tokens=True)


def test_plain_output_prints_text(capsys, model_dir, loaded):
    [rec] = run_json(capsys, "--model", model_dir, "--prompt", PROMPTS[0], "--max-new-tokens", 6)
    rc, out, err = run(capsys, "generate", "--model", model_dir, "--prompt", PROMPTS[0], "--max-new-tokens", 6)
    assert rc == 0
    assert out == rec["text"] + "\n"
    assert f"{rec['new_tokens']} tokens" in err


def test_raw_and_chat_template_tokenization(capsys, model_dir, loaded):
    text = PROMPTS[0]
    tok = loaded[0].tokenizer
    raw_ids = list(tok(text).input_ids)
    chat = f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"
    chat_ids = list(tok(chat, add_special_tokens=False).input_ids)
    assert raw_ids != chat_ids
    want_raw, want_chat = engine_greedy(loaded, raw_ids), engine_greedy(loaded, chat_ids)
    assert want_raw != want_chat  # otherwise the comparison below could not tell them apart

    [raw] = run_json(capsys, "--model", model_dir, "--prompt", text, "--raw", "--max-new-tokens", 8)
    [templ] = run_json(capsys, "--model", model_dir, "--prompt", text, "--max-new-tokens", 8)
    assert raw["token_ids"] == want_raw
    assert templ["token_ids"] == want_chat


def test_prompts_file_turns_prompt_and_limit(capsys, tmp_path, model_dir):
    f = tmp_path / "prompts.jsonl"
    f.write_text(
        "\n".join(
            [
                json.dumps({"turns": [PROMPTS[0], "a second turn, ignored"], "id": 7}),
                "",
                json.dumps({"prompt": PROMPTS[1]}),
                json.dumps({"turns": [PROMPTS[2]]}),
            ]
        )
        + "\n"
    )
    common = ("--model", model_dir, "--max-new-tokens", 4, "--raw")
    recs = run_json(capsys, *common, "--prompts-file", f)
    assert [r["prompt"] for r in recs] == PROMPTS
    limited = run_json(capsys, *common, "--prompts-file", f, "--limit", 2)
    assert [r["prompt"] for r in limited] == PROMPTS[:2]
    assert [r["token_ids"] for r in limited] == [r["token_ids"] for r in recs[:2]]
    # A file prompt generates exactly what the same --prompt does.
    [direct] = run_json(capsys, *common, "--prompt", PROMPTS[1])
    assert direct["token_ids"] == recs[1]["token_ids"]


def test_prompts_file_bad_record(capsys, tmp_path, model_dir):
    f = tmp_path / "bad.jsonl"
    f.write_text(json.dumps({"question": "x"}) + "\n")
    assert_error(capsys, "generate", "--model", model_dir, "--prompts-file", f, words=("turns", "prompt", ":1"))
    f.write_text("{not json\n")
    assert_error(capsys, "generate", "--model", model_dir, "--prompts-file", f, words=("JSON",))


# --------------------------------------------------------------------------- determinism, batching


def test_greedy_is_deterministic(capsys, model_dir):
    args = ("--model", model_dir, "--prompt", PROMPTS[1], "--max-new-tokens", 8)
    a, b = run_json(capsys, *args), run_json(capsys, *args)
    assert a[0]["token_ids"] == b[0]["token_ids"]
    # The seed does not matter when greedy.
    c = run_json(capsys, *args, "--seed", 123)
    assert c[0]["token_ids"] == a[0]["token_ids"]


def test_sampling_seeds(capsys, model_dir):
    args = ("--model", model_dir, "--prompt", PROMPTS[0], "--max-new-tokens", 16, "--temperature", 1.0, "--raw")
    s1 = run_json(capsys, *args, "--seed", 1)[0]["token_ids"]
    s1_again = run_json(capsys, *args, "--seed", 1)[0]["token_ids"]
    s2 = run_json(capsys, *args, "--seed", 2)[0]["token_ids"]
    assert s1 == s1_again
    assert s1 != s2


def test_batch_size_matches_single(capsys, model_dir):
    args = ["--model", model_dir, "--max-new-tokens", 8, "--raw"]
    for p in PROMPTS:
        args += ["--prompt", p]
    single = run_json(capsys, *args)
    batched = run_json(capsys, *args, "--batch-size", 2)
    assert len({len(r["prompt"]) for r in single}) == 3  # different prompt lengths
    assert [r["prompt"] for r in batched] == PROMPTS
    assert [r["token_ids"] for r in batched] == [r["token_ids"] for r in single]


# --------------------------------------------------------------------------- bad input


@pytest.fixture(scope="session")
def broken_dirs(tiny_llama, tmp_path_factory):
    """Directories that are not loadable checkpoints, each for one reason."""
    src = Path(tiny_llama[0])
    root = tmp_path_factory.mktemp("broken")
    empty = root / "empty"
    empty.mkdir()
    (empty / "README.md").write_text("not a model")

    truncated = root / "truncated"
    shutil.copytree(src, truncated)
    w = truncated / "model.safetensors"
    data = w.read_bytes()
    w.write_bytes(data[: len(data) // 2])

    gpt2 = root / "gpt2"
    shutil.copytree(src, gpt2)
    cfg = json.loads((gpt2 / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (gpt2 / "config.json").write_text(json.dumps(cfg))

    gguf_file = root / "x.gguf"
    gguf_file.write_bytes(b"this is not a gguf file \x00\x01\x02" * 64)

    ctx = root / "ctx64"
    make_tiny_hf_model(ctx, "llama", max_position_embeddings=64)
    return {"empty": empty, "truncated": truncated, "gpt2": gpt2, "gguf": gguf_file, "ctx64": ctx}


def test_error_unknown_model_name(capsys):
    assert_error(
        capsys,
        "generate",
        "--model",
        "no-such-model-xyz",
        "--prompt",
        "hi",
        words=("unknown model", "no-such-model-xyz"),
    )


def test_error_missing_path(capsys, tmp_path):
    missing = tmp_path / "nowhere" / "model"
    assert_error(capsys, "generate", "--model", missing, "--prompt", "hi", words=(str(missing),))


def test_error_not_a_checkpoint(capsys, broken_dirs):
    assert_error(
        capsys, "generate", "--model", broken_dirs["empty"], "--prompt", "hi", words=("config.json", "not a checkpoint")
    )


def test_error_truncated_weights(capsys, broken_dirs):
    assert_error(
        capsys,
        "generate",
        "--model",
        broken_dirs["truncated"],
        "--prompt",
        "hi",
        words=("truncated", "model.safetensors"),
    )


def test_error_unsupported_architecture(capsys, broken_dirs):
    assert_error(
        capsys, "generate", "--model", broken_dirs["gpt2"], "--prompt", "hi", words=("unsupported", "GPT2LMHeadModel")
    )


def test_error_corrupt_gguf(capsys, broken_dirs):
    assert_error(capsys, "generate", "--model", broken_dirs["gguf"], "--prompt", "hi", words=("gguf", "x.gguf"))


def test_error_prompt_longer_than_context(capsys, broken_dirs):
    long = " ".join(PROMPTS) * 5
    assert_error(
        capsys,
        "generate",
        "--model",
        broken_dirs["ctx64"],
        "--prompt",
        long,
        "--raw",
        "--max-new-tokens",
        8,
        words=("context", "64"),
    )


@pytest.mark.parametrize(
    "flag,value,word",
    [
        ("--max-new-tokens", "-1", "--max-new-tokens"),
        ("--temperature", "-0.5", "--temperature"),
        ("--top-p", "0", "--top-p"),
        ("--top-p", "1.5", "--top-p"),
        ("--top-k", "-2", "--top-k"),
        ("--method", "telepathy", "telepathy"),
    ],
)
def test_error_bad_option(capsys, model_dir, flag, value, word):
    msg = assert_error(capsys, "generate", "--model", model_dir, "--prompt", "hi", flag, value, words=(word,))
    if flag == "--method":
        assert "unknown method" in msg and "vanilla" in msg
    else:
        assert value in msg


@pytest.mark.parametrize(
    "method,value,words",
    [
        ("pld", "0.5", ("--min-draft-prob", "medusa", "pld")),
        ("eagle2", "1.5", ("--min-draft-prob", "[0, 1]", "1.5")),
    ],
)
def test_error_min_draft_prob(capsys, model_dir, method, value, words):
    assert_error(
        capsys,
        "generate",
        "--model",
        model_dir,
        "--prompt",
        "hi",
        "--method",
        method,
        "--min-draft-prob",
        value,
        words=words,
    )


@pytest.mark.parametrize(
    "method,value,words",
    [
        ("pld", "4", ("--lookup-tokens", "pld")),
        ("eagle2", "0", ("--lookup-tokens", ">= 1", "0")),
    ],
)
def test_error_lookup_tokens(capsys, model_dir, method, value, words):
    assert_error(
        capsys,
        "generate",
        "--model",
        model_dir,
        "--prompt",
        "hi",
        "--method",
        method,
        "--lookup-tokens",
        value,
        words=words,
    )


def test_error_missing_prompts_file(capsys, tmp_path, model_dir):
    missing = tmp_path / "nope.jsonl"
    assert_error(capsys, "generate", "--model", model_dir, "--prompts-file", missing, words=("not found", "nope.jsonl"))


def test_error_no_prompt(capsys, model_dir):
    assert_error(capsys, "generate", "--model", model_dir, words=("no prompt",))


def test_debug_shows_the_exception(capsys, broken_dirs):
    with pytest.raises(Exception, match="GPT2LMHeadModel"):
        main(["generate", "--model", str(broken_dirs["gpt2"]), "--prompt", "hi", "--debug"])


# --------------------------------------------------------------------------- real subprocesses


def _subprocess(*args, cache):
    env = dict(os.environ, SPECJAX_CACHE=str(cache), JAX_PLATFORMS="cpu")
    for name in ("SPECJAX_DEBUG", "SPECJAX_COMPILE_CACHE", "JAX_COMPILATION_CACHE_DIR"):
        env.pop(name, None)  # the command's own defaults, under this test's cache
    return subprocess.run(
        [sys.executable, "-m", "specjax.cli", *map(str, args)], capture_output=True, text=True, env=env, timeout=300
    )


def test_subprocess_error_is_one_line(broken_dirs, tmp_path):
    p = _subprocess("generate", "--model", broken_dirs["truncated"], "--prompt", "hi", cache=tmp_path)
    assert p.returncode != 0
    assert p.stdout == ""
    assert "Traceback" not in p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1, p.stderr
    assert "truncated" in lines[0] and "model.safetensors" in lines[0]
    # Found before the CPU kernels are built: the error comes without that wait.
    assert not (tmp_path / "kernels").exists()


def test_subprocess_generate_json(model_dir, tmp_path, capsys):
    p = _subprocess(
        "generate", "--model", model_dir, "--prompt", PROMPTS[1], "--max-new-tokens", 5, "--json", cache=tmp_path
    )
    assert p.returncode == 0, p.stderr
    assert "Traceback" not in p.stderr
    [line] = p.stdout.splitlines()
    rec = json.loads(line)
    assert set(rec) == JSON_FIELDS
    # Same tokens as the in-process run (a fresh process compiles on its own).
    [inproc] = run_json(capsys, "--model", model_dir, "--prompt", PROMPTS[1], "--max-new-tokens", 5)
    assert rec["token_ids"] == inproc["token_ids"]
    # The command keeps its compiled programs under the specjax cache; a second run loads them
    # and gives the same tokens.
    cached = list((tmp_path / "jax-compile").iterdir())
    assert cached, "no compiled program was cached"
    again = _subprocess(
        "generate", "--model", model_dir, "--prompt", PROMPTS[1], "--max-new-tokens", 5, "--json", cache=tmp_path
    )
    assert again.returncode == 0, again.stderr
    assert json.loads(again.stdout.splitlines()[0])["token_ids"] == rec["token_ids"]


# --- speculative methods through the CLI -------------------------------------------------------


def _json_lines(capsys):
    return [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.strip()]


@pytest.mark.parametrize(
    "extra",
    [
        ["--method", "pld"],
        ["--method", "pld", "--prompt-lookup-num-tokens", "3", "--min-matching-ngram-size", "2"],
        ["--method", "draft", "--draft-layers", "1", "--max-draft-len", "2"],
        ["--method", "draft", "--draft-layers", "2", "--use-logits"],
    ],
)
def test_speculative_methods_match_vanilla_greedy(tiny_llama, capsys, extra):
    d, _ = tiny_llama
    base = [
        "generate",
        "--model",
        str(d),
        "--raw",
        "--json",
        "--max-new-tokens",
        "12",
        "--prompt",
        "1 + 1 = 2, 2 + 2 = 4, 1 + 1 = 2, 2 + 2 =",
        "--prompt",
        "hello",
    ]
    assert main(base) == 0
    vanilla = _json_lines(capsys)
    assert main(base + extra) == 0
    spec = _json_lines(capsys)
    for v, s in zip(vanilla, spec):
        assert s["token_ids"] == v["token_ids"]
        assert 1 <= s["steps"] <= s["new_tokens"]
        assert s["mean_accepted"] == pytest.approx(s["new_tokens"] / s["steps"])


@pytest.mark.parametrize(
    "extra,words",
    [
        (["--method", "draft", "--draft-layers", "9"], ["draft layers"]),
        (["--method", "draft", "--draft-layers", "0"], ["draft layers"]),
        (["--method", "draft", "--max-draft-len", "0"], ["max-draft-len"]),
        (["--method", "pld", "--prompt-lookup-num-tokens", "0"], ["prompt-lookup-num-tokens"]),
        (["--method", "pld", "--min-matching-ngram-size", "4"], ["n-gram"]),
    ],
)
def test_speculative_bad_options(tiny_llama, capsys, extra, words):
    d, _ = tiny_llama
    rc = main(["generate", "--model", str(d), "--prompt", "hi", "--max-new-tokens", "2"] + extra)
    err = capsys.readouterr().err.strip()
    assert rc != 0 and len(err.splitlines()) == 1
    for w in words:
        assert w in err


def test_draft_model_with_other_vocabulary_is_refused(tiny_llama, tmp_path, capsys):
    from conftest import make_tiny_hf_model

    d, _ = tiny_llama
    other = tmp_path / "other"
    make_tiny_hf_model(other, "llama", vocab_size=400)
    rc = main(["generate", "--model", str(d), "--prompt", "hi", "--method", "draft", "--draft-model", str(other)])
    err = capsys.readouterr().err.strip()
    assert rc != 0 and "vocabulary" in err and "400" in err
