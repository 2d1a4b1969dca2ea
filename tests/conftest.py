"""Shared fixtures: tiny random Hugging Face models (with a tiny tokenizer) saved to disk."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# XLA:CPU flags for the tests: most of the suite's time is compiling, and the tests check what
# programs compute, not how fast. Without LLVM's optimisation an EAGLE-2 decoding loop compiled
# ~1.9x faster (docs/design.md, "Test suite time"). Users' programs keep XLA's defaults;
# SPECJAX_TEST_XLA_DEFAULTS=1 runs the tests under them too.
TEST_XLA_FLAGS = ("--xla_backend_optimization_level=0",)


def xla_flags(devices: int | None = None) -> str:
    """XLA_FLAGS for a test's subprocess: the parent's flags (less any host device count), and
    `devices` host devices when given."""
    flags = [
        f for f in os.environ.get("XLA_FLAGS", "").split() if not f.startswith("--xla_force_host_platform_device_count")
    ]
    if devices is not None:
        flags.append(f"--xla_force_host_platform_device_count={devices}")
    return " ".join(flags)


def pytest_configure(config):
    """Compiled programs persist across runs in specjax's compile cache, as for the `specjax`
    command, also for the subprocesses tests start (through the environment they inherit).
    A cold cache changes nothing but the time; SPECJAX_COMPILE_CACHE=0 turns it off.
    TEST_XLA_FLAGS go into the environment before JAX starts its backend, so they hold here and
    in every subprocess."""
    if os.environ.get("SPECJAX_TEST_XLA_DEFAULTS", "") not in ("1", "true", "yes"):
        present = os.environ.get("XLA_FLAGS", "").split()
        names = {f.split("=")[0] for f in present}
        os.environ["XLA_FLAGS"] = " ".join(present + [f for f in TEST_XLA_FLAGS if f.split("=")[0] not in names])
    from specjax.compile_cache import MIN_COMPILE_SECONDS, enable_compile_cache

    path = enable_compile_cache()
    if path is not None:
        os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", str(path))
        os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", str(MIN_COMPILE_SECONDS))


# The skips a CI run (`CI=true`) accepts: test node id -> the words its reason must contain.
# Any other skip there fails the run, so a test that quietly stops running is seen.
CI_ALLOWED_SKIPS = {
    # on a machine with a GPU the command would start the whole GPU run instead
    "tests/test_gpu_check.py::test_without_gpu_says_so_in_one_line": "a CUDA GPU is present",
}
_unexpected_skips: list[str] = []

# What one test worker needs at most: the default tier's largest resident size was 6.2 GB.
WORKER_MEMORY_GIB = 8


def pytest_xdist_auto_num_workers(config):
    """`-n auto` (pyproject's addopts): one worker per core, as many as memory holds. Each
    worker is a JAX process whose compiled programs and real-model weights stay resident."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    try:
        memory_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError, AttributeError):
        return cores
    return max(1, min(cores, int(memory_gib // WORKER_MEMORY_GIB)))


def _in_ci() -> bool:
    return os.environ.get("CI", "").lower() in ("1", "true", "yes")


def _skip_reason(report) -> str:
    longrepr = report.longrepr
    return longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)


def _check_skip(report) -> None:
    if not (report.skipped and _in_ci()) or hasattr(report, "wasxfail"):
        return
    reason = _skip_reason(report)
    allowed = CI_ALLOWED_SKIPS.get(report.nodeid)
    if allowed is None or allowed not in reason:
        _unexpected_skips.append(f"{report.nodeid}: {reason}")


def pytest_runtest_logreport(report):
    _check_skip(report)


def pytest_collectreport(report):
    _check_skip(report)


def pytest_sessionfinish(session, exitstatus):
    if _unexpected_skips and exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter):
    if _unexpected_skips:
        terminalreporter.section("skips not on tests/conftest.py's CI_ALLOWED_SKIPS (CI=true)")
        for line in _unexpected_skips:
            terminalreporter.write_line(line)


def _memory_mappings() -> int:
    """The number of this process's memory mappings (0 where /proc is missing)."""
    try:
        with open("/proc/self/maps", "rb") as maps:
            return sum(1 for _ in maps)
    except OSError:
        return 0


# Linux refuses a process more than vm.max_map_count (65530 by default) memory mappings.
MAPPINGS_BUDGET = 20_000


@pytest.fixture(autouse=True)
def _drop_compiled_programs():
    """JAX keeps every compiled program alive, and on XLA:CPU each one holds its machine code in
    memory mappings of its own (hundreds for the real model's). Run whole, the suite's one
    process reached Linux's limit of 65530 mappings and XLA crashed loading code (a segfault or
    an abort, at ~80% of the suite). After a test that leaves more than MAPPINGS_BUDGET,
    JAX's caches are dropped (the persistent compile cache reloads what later tests need)."""
    yield
    if _memory_mappings() > MAPPINGS_BUDGET:
        import gc

        import jax

        jax.clear_caches()
        gc.collect()


def random_eagle2(cfg, target):
    """EAGLE-2 (5 nodes, depth 2, top-k 2) with a random one-layer draft over `target`, a random
    model of config `cfg`: (proposer, proposer_params)."""
    import dataclasses

    import jax

    from specjax import init_params
    from specjax.model import lm_head_weight
    from specjax.proposers.eagle import EagleDynamicProposer

    draft_cfg = dataclasses.replace(cfg, num_layers=1)
    key = jax.random.PRNGKey(3)
    layer = init_params(draft_cfg, key, scale=0.3)["layers"][0]
    del layer["attn_norm"]  # EAGLE's first layer has no input norm
    fc = {"kernel": 0.3 * jax.random.normal(key, (2 * cfg.hidden_size, cfg.hidden_size))}
    return (
        EagleDynamicProposer(draft_cfg, total_tokens=5, depth=2, top_k=2),
        {"net": {"fc": fc, "layers": [layer]}, "embed": target["embed"], "lm_head": lm_head_weight(target)},
    )


CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content']"
    " + '<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "What is the capital of France? Paris.",
    "def add(a, b):\n    return a + b\n",
    "Summarize the following text in one sentence.",
    "1 + 1 = 2, 2 + 2 = 4, 3 * 3 = 9",
    "Hello! How are you today? I am fine, thank you.",
] * 20


def build_tokenizer(out_dir: Path, vocab_size: int = 300):
    """A byte-level BPE tokenizer with ChatML specials and a chat template, saved to out_dir."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(CORPUS, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        unk_token="<|endoftext|>",
        pad_token="<|endoftext|>",
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(out_dir))
    return fast


def make_tiny_hf_model(
    out_dir: Path, kind: str = "llama", seed: int = 0, tokenizer: bool = True, perturb: float = 0.0, **overrides
):
    """Save a tiny random transformers model (llama, qwen2, qwen3 or mistral) with save_pretrained.

    perturb: the scale of Gaussian noise added to every tensor (norms and biases too, which
    transformers initialises to ones and zeros) before saving. Qwen3's head_dim defaults to 32,
    not hidden / heads (16)."""
    import torch
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        MistralConfig,
        MistralForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
    )

    torch.manual_seed(seed)
    common = dict(
        vocab_size=320,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    if kind == "qwen3":
        common["head_dim"] = 32
    common.update(overrides)
    cls = {
        "llama": (LlamaConfig, LlamaForCausalLM),
        "qwen2": (Qwen2Config, Qwen2ForCausalLM),
        "qwen3": (Qwen3Config, Qwen3ForCausalLM),
        "mistral": (MistralConfig, MistralForCausalLM),
    }[kind]
    model = cls[1](cls[0](**common)).eval()
    if perturb:
        g = torch.Generator().manual_seed(seed + 100)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(perturb * torch.randn(p.shape, generator=g))
    model.save_pretrained(str(out_dir))
    if tokenizer:
        build_tokenizer(out_dir)
    return model


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory):
    """(directory, torch model) of a tiny random Llama with llama3 RoPE scaling and a tokenizer."""
    d = tmp_path_factory.mktemp("tiny_llama")
    rope = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32,
    }
    model = make_tiny_hf_model(d, "llama", rope_scaling=rope, tie_word_embeddings=True)
    return d, model
