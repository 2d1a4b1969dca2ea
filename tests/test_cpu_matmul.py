"""The native few-row CPU product (specjax.cpu_matmul) against numpy and XLA."""

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax import cpu_matmul
from specjax.cpu_matmul import TARGET, rows_matmul, unsupported_reason, use_cpu_matmul
from specjax.model import head_logits, linear

needs_kernel = pytest.mark.skipif(unsupported_reason() is not None,
                                  reason=f"kernel unavailable: {unsupported_reason()}")


def _hlo(fn, *args) -> str:
    return jax.jit(fn).lower(*args).as_text()


@needs_kernel
@pytest.mark.parametrize("k", [7, 45, 576])
def test_kernel_matches_numpy_for_every_row_count(k):
    """1-30 rows (one, two and three passes over the weight), columns and k not multiples of the
    register blocks."""
    rng = np.random.default_rng(k)
    w = rng.standard_normal((203, k)).astype(np.float32)
    with use_cpu_matmul("kernel"):
        f = jax.jit(linear)
        assert TARGET in _hlo(linear, jnp.zeros((3, k)), jnp.asarray(w))
        for m in range(1, 31):
            x = rng.standard_normal((m, k)).astype(np.float32)
            np.testing.assert_allclose(np.asarray(f(x, w)), x @ w.T, rtol=2e-5, atol=2e-4)


@needs_kernel
def test_a_row_does_not_depend_on_how_many_rows_share_the_pass():
    """Bit-identical rows whatever the row count: a verify pass reproduces decoding exactly."""
    rng = np.random.default_rng(1)
    w = jnp.asarray(rng.standard_normal((1000, 576)).astype(np.float32))
    x = jnp.asarray(rng.standard_normal((64, 576)).astype(np.float32))
    with use_cpu_matmul("kernel"):
        f = jax.jit(linear)
        alone = np.stack([np.asarray(f(x[i:i + 1], w))[0] for i in range(64)])
        for m in (2, 4, 5, 8, 9, 10, 14, 15, 16, 23, 29, 64):
            np.testing.assert_array_equal(np.asarray(f(x[:m], w)), alone[:m])


@needs_kernel
def test_rms_norm_rows_do_not_depend_on_how_many_rows_share_the_pass():
    """XLA:CPU sums a few rows and one row in different orders; `row_sums` must not."""
    from specjax.model import rms_norm

    rng = np.random.default_rng(2)
    g = jnp.asarray(rng.standard_normal(576).astype(np.float32))
    x = jnp.asarray(3 * rng.standard_normal((1, 24, 576)).astype(np.float32))
    with use_cpu_matmul("kernel"):
        f = jax.jit(lambda x: rms_norm(x, g, 1e-5))
        alone = np.concatenate([np.asarray(f(x[:, i:i + 1])) for i in range(24)], axis=1)
        for t in (2, 4, 8, 12, 24):
            np.testing.assert_array_equal(np.asarray(f(x[:, :t])), alone[:, :t])


@needs_kernel
def test_verify_rows_equal_one_token_decodes_bit_for_bit():
    """A T-token pass over the cache gives each row the logits decoding it alone gives, bit for
    bit (both CPU kernels): what makes greedy speculation reproduce vanilla decoding exactly."""
    from specjax.cache import PagedKVCache, init_pages
    from specjax.config import ModelConfig
    from specjax.model import causal_mask, forward, init_params

    config = ModelConfig(vocab_size=300, hidden_size=576, intermediate_size=1536, num_layers=2,
                         num_heads=9, num_kv_heads=3, head_dim=64)  # SmolLM2-135M's widths
    params = init_params(config, jax.random.PRNGKey(3), scale=0.1)
    k, v = init_pages(config, 8, 16)
    start = PagedKVCache(k, v, jnp.arange(8, dtype=jnp.int32)[None], jnp.zeros((1,), jnp.int32))
    tokens = jnp.asarray(np.random.default_rng(4).integers(0, 300, (1, 20)), jnp.int32)
    step = jax.jit(lambda c, tok, pos, mask: forward(params, config, tok, pos, c, mask))
    with use_cpu_matmul("kernel"):
        out = step(start, tokens[:, :8], jnp.arange(8)[None], causal_mask(1, 8))
        prompt = out.cache.replace(lengths=out.cache.lengths + 8)
        cache, decoded = prompt, []
        for i in range(8, 20):
            out = step(cache, tokens[:, i:i + 1], jnp.full((1, 1), i), causal_mask(1, 1))
            cache = out.cache.replace(lengths=out.cache.lengths + 1)
            decoded.append(np.asarray(out.logits[0, 0]))
        for t in (2, 5, 12):
            out = step(prompt, tokens[:, 8:8 + t], jnp.arange(8, 8 + t)[None], causal_mask(1, t))
            np.testing.assert_array_equal(np.asarray(out.logits[0]), np.stack(decoded[:t]))


@needs_kernel
@pytest.mark.parametrize("k", [7, 45, 576])
def test_float16_weights_give_the_float32_kernel_result_of_the_widened_weight(k):
    """A float16 weight (half the bytes to stream) is widened exactly: bit-identical to the
    float32 kernel on w.astype(float32) for 1-16 rows, and XLA's product without the kernel."""
    rng = np.random.default_rng(k + 1)
    w16 = jnp.asarray(rng.standard_normal((203, k)).astype(np.float16))
    w32 = w16.astype(jnp.float32)
    with use_cpu_matmul("kernel"):
        f = jax.jit(linear)
        assert TARGET + "_f16" in _hlo(linear, jnp.zeros((3, k)), w16)
        for m in range(1, 17):
            x = jnp.asarray(rng.standard_normal((m, k)).astype(np.float32))
            got = np.asarray(f(x, w16))
            assert got.dtype == np.float32
            np.testing.assert_array_equal(got, np.asarray(f(x, w32)))
    x = jnp.asarray(rng.standard_normal((5, k)).astype(np.float32))
    with use_cpu_matmul("xla"):
        assert TARGET not in _hlo(linear, x, w16)
        np.testing.assert_allclose(np.asarray(jax.jit(linear)(x, w16)),
                                   np.asarray(x) @ np.asarray(w32).T, rtol=2e-5, atol=2e-4)


@needs_kernel
def test_leading_axes_head_and_gradients():
    """[B, T, D] inputs, the float32 output head, and gradients (XLA's products backward)."""
    rng = np.random.default_rng(2)
    x = jnp.asarray(rng.standard_normal((2, 3, 40)).astype(np.float32))
    w = jnp.asarray(rng.standard_normal((33, 40)).astype(np.float32))

    def loss(x, w):
        return jnp.sum(jnp.sin(linear(x, w)))

    with use_cpu_matmul("xla"):
        ref_y, ref_head = linear(x, w), head_logits(x, w)
        ref_g = jax.grad(loss, argnums=(0, 1))(x, w)
        assert TARGET not in _hlo(linear, x, w)
    with use_cpu_matmul("kernel"):
        assert TARGET in _hlo(linear, x, w)
        np.testing.assert_allclose(linear(x, w), ref_y, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(head_logits(x, w), ref_head, rtol=1e-5, atol=1e-5)
        for got, ref in zip(jax.grad(loss, argnums=(0, 1))(x, w), ref_g):
            np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-4)


@needs_kernel
def test_xla_takes_what_the_kernel_does_not():
    """More rows than MAX_ROWS (prefill, training batches), bfloat16 weights: XLA's product, even
    when the kernel is forced."""
    with use_cpu_matmul("kernel"):
        many = jnp.zeros((cpu_matmul.MAX_ROWS + 1, 16))
        assert TARGET not in _hlo(linear, many, jnp.zeros((8, 16)))
        assert TARGET not in _hlo(linear, jnp.zeros((2, 16), jnp.bfloat16),
                                  jnp.zeros((8, 16), jnp.bfloat16))


@needs_kernel
def test_lowering_for_a_gpu_takes_xla_product():
    """An export for CUDA made on this CPU holds no CPU custom call."""
    from jax import export

    with use_cpu_matmul("kernel"):
        exp = export.export(jax.jit(rows_matmul), platforms=["cuda"])(
            jax.ShapeDtypeStruct((4, 64), jnp.float32), jax.ShapeDtypeStruct((96, 64), jnp.float32))
    assert TARGET not in exp.mlir_module()


def test_bad_setting_is_one_line_error(monkeypatch):
    monkeypatch.setenv(cpu_matmul.ENV_VAR, "fast")
    with pytest.raises(ValueError, match=r"CPU matmul setting 'fast': expected one of auto"):
        cpu_matmul.cpu_matmul_setting()


def test_auto_leaves_meshes_to_xla():
    """With several devices `auto` keeps XLA's product (XLA cannot partition a custom call)."""
    code = ("import jax, jax.numpy as jnp\n"
            "from specjax.model import linear\n"
            "print(jax.device_count(), 'specjax_rows_matmul' in "
            "jax.jit(linear).lower(jnp.zeros((2, 8)), jnp.zeros((4, 8))).as_text())\n")
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2",
               SPECJAX_CPU_MATMUL="auto")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         check=True)
    assert out.stdout.split() == ["2", "False"]
