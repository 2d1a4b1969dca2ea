"""bfloat16 end to end on CPU, as a GPU runs it: bfloat16 weights and KV pools (the pools take
the weights' dtype), every method greedy-identical to bfloat16 vanilla decoding, and the tree
methods also with the Pallas kernel (interpret mode) reading bfloat16 pools."""

from __future__ import annotations

import sys
from pathlib import Path

import jax.numpy as jnp
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import gpu_check

from specjax import Engine
from specjax.attention import use_attention_backend


@pytest.fixture(scope="module")
def target():
    return gpu_check.tiny_target(dtype=jnp.bfloat16)


VANILLA: dict = {}


def run(target, backend, method):
    with use_attention_backend(backend):
        engine = Engine(target.params, gpu_check.TINY, num_pages=96, page_size=16)
        assert engine.k_pages[0].dtype == jnp.bfloat16
        proposer, pparams = gpu_check.method_proposer(method, target)
        return engine.generate(
            gpu_check.PROMPTS, 12, eos_token_ids=(), proposer=proposer, proposer_params=pparams
        ).token_ids


@pytest.mark.slow
@pytest.mark.parametrize(
    "backend,method",
    [
        *[("xla", m) for m in gpu_check.METHODS if m != "vanilla"],
        ("pallas-interpret", "eagle2"),
    ],
)
def test_greedy_equals_bfloat16_vanilla(target, backend, method):
    """Against vanilla decoding on the same attention backend (the kernel's bfloat16 sums run
    in another order than the reference's, which may part the two on a near-tie)."""
    if backend not in VANILLA:
        VANILLA[backend] = run(target, backend, "vanilla")
    assert run(target, backend, method) == VANILLA[backend]
