"""The native few-row CPU product (specjax.cpu.matmul) against numpy and XLA."""

import os
import subprocess
import sys

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import xla_flags

from specjax.cpu import matmul as cpu_matmul
from specjax.cpu.matmul import TARGET, rows_matmul, unsupported_reason, use_cpu_matmul
from specjax.model import head_logits, linear

needs_kernel = pytest.mark.skipif(
    unsupported_reason() is not None, reason=f"kernel unavailable: {unsupported_reason()}"
)


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
        alone = np.stack([np.asarray(f(x[i : i + 1], w))[0] for i in range(64)])
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
        alone = np.concatenate([np.asarray(f(x[:, i : i + 1])) for i in range(24)], axis=1)
        for t in (2, 4, 8, 12, 24):
            np.testing.assert_array_equal(np.asarray(f(x[:, :t])), alone[:, :t])


@needs_kernel
def test_verify_rows_equal_one_token_decodes_bit_for_bit():
    """A T-token pass over the cache gives each row the logits decoding it alone gives, bit for
    bit (both CPU kernels): what makes greedy speculation reproduce vanilla decoding exactly."""
    from specjax.cache import PagedKVCache, init_pages
    from specjax.model import causal_mask, forward, init_params
    from specjax.model_config import ModelConfig

    config = ModelConfig(
        vocab_size=300, hidden_size=576, intermediate_size=1536, num_layers=2, num_heads=9, num_kv_heads=3, head_dim=64
    )  # SmolLM2-135M's widths
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
            out = step(cache, tokens[:, i : i + 1], jnp.full((1, 1), i), causal_mask(1, 1))
            cache = out.cache.replace(lengths=out.cache.lengths + 1)
            decoded.append(np.asarray(out.logits[0, 0]))
        for t in (2, 5, 12):
            out = step(prompt, tokens[:, 8 : 8 + t], jnp.arange(8, 8 + t)[None], causal_mask(1, t))
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
        np.testing.assert_allclose(
            np.asarray(jax.jit(linear)(x, w16)), np.asarray(x) @ np.asarray(w32).T, rtol=2e-5, atol=2e-4
        )


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
@pytest.mark.parametrize("n,k", [(203, 7), (64, 576), (1, 45)])
def test_packed_weight_gives_the_plain_weights_results(n, k):
    """`pack_weight` round-trips; a packed weight's products equal the plain weight's bit for bit
    (a plain one is packed on the way), take_rows picks the same rows, and a packed weight takes
    the kernel for more than MAX_ROWS rows too, each row as it comes alone."""
    from specjax.cpu.matmul import PackedWeight, pack_weight, take_rows

    rng = np.random.default_rng(n + k)
    w = jnp.asarray(rng.standard_normal((n, k)).astype(np.float32))
    p = pack_weight(w)
    assert isinstance(p, PackedWeight) and p.shape == (n, k) and p.panels.shape[2] == 32
    np.testing.assert_array_equal(np.asarray(p.unpack()), np.asarray(w))
    ids = jnp.asarray([0, n - 1, n // 2])
    np.testing.assert_array_equal(np.asarray(take_rows(p, ids)), np.asarray(w)[np.asarray(ids)])
    many = jnp.asarray(rng.standard_normal((100, k)).astype(np.float32))
    with use_cpu_matmul("kernel"):
        f = jax.jit(linear)
        for m in (1, 3, 14, 15, 29):
            np.testing.assert_array_equal(np.asarray(f(many[:m], p)), np.asarray(f(many[:m], w)))
        assert TARGET in _hlo(linear, many, p)
        got = np.asarray(f(many, p))
        np.testing.assert_allclose(got, np.asarray(many) @ np.asarray(w).T, rtol=2e-5, atol=2e-4)
        np.testing.assert_array_equal(got[:29], np.asarray(f(many[:29], w)))
    with use_cpu_matmul("xla"):  # a packed weight without the kernel: XLA's product
        assert TARGET not in _hlo(linear, many[:5], p)
        np.testing.assert_allclose(
            np.asarray(jax.jit(linear)(many[:5], p)), np.asarray(many[:5]) @ np.asarray(w).T, rtol=2e-5, atol=2e-4
        )


@needs_kernel
@pytest.mark.parametrize("tied", [True, False])
def test_packed_model_decodes_bit_for_bit_as_the_plain_one(tied):
    """`pack_params` (what `load_model` does for the kernel) changes no logit: a prompt's
    prefill (more rows than MAX_ROWS: the kernel too once packed, XLA before) is close, a decode
    and a verify over the same cache equal (the verify's first row the decode, as with plain
    weights: head_dim 64 for the attention kernel); `unpack_params` gives the plain weights back,
    and gradients flow through a packed weight."""
    from specjax.cache import PagedKVCache, init_pages
    from specjax.cpu.matmul import PackedWeight, pack_params, unpack_params
    from specjax.model import causal_mask, forward, init_params
    from specjax.model_config import ModelConfig

    config = ModelConfig(
        vocab_size=300,
        hidden_size=128,
        intermediate_size=96,
        num_layers=2,
        num_heads=2,
        num_kv_heads=1,
        head_dim=64,
        tie_word_embeddings=tied,
    )
    plain = init_params(config, jax.random.PRNGKey(5), scale=0.1)
    with use_cpu_matmul("kernel"):
        packed = pack_params(plain)
    assert isinstance(packed["layers"][0]["wqkv"], PackedWeight)
    assert isinstance(packed["lm_head" if not tied else "tied_head"], PackedWeight)
    assert not isinstance(packed["embed"], PackedWeight)  # lookups read plain rows
    assert ("tied_head" in packed) == tied
    back = unpack_params(packed)
    chex.assert_trees_all_equal(back, plain)  # structure, shapes and values
    k, v = init_pages(config, 16, 16)
    start = PagedKVCache(k, v, jnp.arange(16, dtype=jnp.int32)[None], jnp.zeros((1,), jnp.int32))
    tokens = jnp.asarray(np.random.default_rng(6).integers(0, 300, (1, 90)), jnp.int32)
    with use_cpu_matmul("kernel"):
        outs, cache = [], None
        for params in (plain, packed):
            step = jax.jit(lambda c, tok, pos, mask, p=params: forward(p, config, tok, pos, c, mask))
            pre = step(start, tokens[:, :80], jnp.arange(80)[None], causal_mask(1, 80))
            if cache is None:  # both decode over the plain prefill's cache
                cache = pre.cache.replace(lengths=pre.cache.lengths + 80)
            one = step(cache, tokens[:, 80:81], jnp.full((1, 1), 80), causal_mask(1, 1))
            ten = step(cache, tokens[:, 80:90], jnp.arange(80, 90)[None], causal_mask(1, 10))
            outs.append((pre.logits, one.logits, ten.logits))
        np.testing.assert_allclose(outs[0][0], outs[1][0], rtol=1e-4, atol=1e-5)
        for a, b in zip(outs[0][1:], outs[1][1:]):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        np.testing.assert_array_equal(np.asarray(outs[1][1][0, 0]), np.asarray(outs[1][2][0, 0]))
        w = packed["layers"][0]["w_down"]
        x = jnp.asarray(np.random.default_rng(7).standard_normal((3, 96)).astype(np.float32))
        gx, gw = jax.grad(lambda x, w: jnp.sum(jnp.sin(linear(x, w))), argnums=(0, 1))(x, w)
    rx, rw = jax.grad(lambda x, w: jnp.sum(jnp.sin(x @ w.T)), argnums=(0, 1))(x, w.unpack())
    np.testing.assert_allclose(gx, rx, rtol=1e-4, atol=1e-5)
    assert isinstance(gw, PackedWeight)
    np.testing.assert_allclose(gw.unpack(), rw, rtol=1e-4, atol=1e-5)


@needs_kernel
def test_draft_weights_packs_draft_matrices_in_float16():
    """A draft network's matrices, plain or packed, come packed in float16 with
    SPECJAX_DRAFT_WEIGHTS=float16 (float32 with float32); vectors stay; nothing changes without
    the kernel."""
    from specjax.cpu.draft_weights import draft_weights, use_draft_weights
    from specjax.cpu.matmul import PackedWeight, pack_weight

    rng = np.random.default_rng(8)
    tree = {
        "w": jnp.asarray(rng.standard_normal((40, 16)).astype(np.float32)),
        "p": pack_weight(jnp.asarray(rng.standard_normal((33, 16)).astype(np.float32))),
        "b": jnp.zeros((16,)),
    }
    with use_cpu_matmul("kernel"):
        with use_draft_weights("float16"):
            half = draft_weights(tree)
        with use_draft_weights("float32"):
            full = draft_weights(tree)
    for name in ("w", "p"):
        assert isinstance(half[name], PackedWeight) and half[name].dtype == jnp.float16
        assert isinstance(full[name], PackedWeight) and full[name].dtype == jnp.float32
    np.testing.assert_array_equal(half["w"].unpack(), tree["w"].astype(jnp.float16))
    np.testing.assert_array_equal(full["p"].unpack(), tree["p"].unpack())
    assert half["b"] is tree["b"]
    with use_cpu_matmul("xla"):
        assert draft_weights(tree) is tree


@needs_kernel
def test_int8_weights_multiply_as_their_scaled_rows_and_alone():
    """An int8 weight (`int8_weight`, SPECJAX_DRAFT_WEIGHTS=int8): rounded per row within half a
    step of its scale, products equal to the float32 product of the scaled rows (the kernel and
    XLA's fallback), each row bit-identical whatever the row count; rows looked up scaled."""
    from specjax.cpu.draft_weights import draft_weights, use_draft_weights
    from specjax.cpu.matmul import PackedWeight, int8_weight, take_rows

    rng = np.random.default_rng(9)
    w = rng.standard_normal((203, 45)).astype(np.float32)
    w[7] = 0.0  # an all-zero row keeps a finite scale
    q = int8_weight(w)
    assert q.dtype == jnp.int8 and q.scale.shape == (224,)
    deq = np.asarray(q.unpack())
    step = np.abs(w).max(axis=1, keepdims=True) / 127
    assert np.all(np.abs(deq - w) <= step / 2 + 1e-7) and np.all(deq[7] == 0)
    np.testing.assert_array_equal(take_rows(q, jnp.array([[3, 7], [202, 0]])), deq[[[3, 7], [202, 0]]])
    x = rng.standard_normal((20, 45)).astype(np.float32)
    with use_cpu_matmul("kernel"):
        f = jax.jit(linear)
        assert TARGET + "_s8" in _hlo(linear, jnp.zeros((3, 45)), q)
        alone = np.stack([np.asarray(f(x[i : i + 1], q))[0] for i in range(20)])
        for m in (2, 9, 14, 15, 20):
            np.testing.assert_array_equal(np.asarray(f(x[:m], q)), alone[:m])
        with use_draft_weights("int8"):
            packed = draft_weights({"w": jnp.asarray(w)})["w"]
    np.testing.assert_allclose(alone, x @ deq.T, rtol=2e-5, atol=2e-4)
    assert isinstance(packed, PackedWeight) and packed.dtype == jnp.int8
    np.testing.assert_array_equal(packed.unpack(), deq)
    with use_cpu_matmul("xla"):
        np.testing.assert_allclose(np.asarray(jax.jit(linear)(x, q)), x @ deq.T, rtol=2e-5, atol=2e-4)


@needs_kernel
def test_xla_takes_what_the_kernel_does_not():
    """More rows than MAX_ROWS (prefill, training batches), bfloat16 weights: XLA's product, even
    when the kernel is forced."""
    with use_cpu_matmul("kernel"):
        many = jnp.zeros((cpu_matmul.MAX_ROWS + 1, 16))
        assert TARGET not in _hlo(linear, many, jnp.zeros((8, 16)))
        assert TARGET not in _hlo(linear, jnp.zeros((2, 16), jnp.bfloat16), jnp.zeros((8, 16), jnp.bfloat16))


@needs_kernel
def test_lowering_for_a_gpu_takes_xla_product():
    """An export for CUDA made on this CPU holds no CPU custom call."""
    from jax import export

    with use_cpu_matmul("kernel"):
        exp = export.export(jax.jit(rows_matmul), platforms=["cuda"])(
            jax.ShapeDtypeStruct((4, 64), jnp.float32), jax.ShapeDtypeStruct((96, 64), jnp.float32)
        )
    assert TARGET not in exp.mlir_module()


def test_bad_setting_is_one_line_error(monkeypatch):
    monkeypatch.setenv(cpu_matmul.ENV_VAR, "fast")
    with pytest.raises(ValueError, match=r"CPU matmul setting 'fast': expected one of auto"):
        cpu_matmul.cpu_matmul_setting()


def test_auto_leaves_meshes_to_xla():
    """With several devices `auto` keeps XLA's product (XLA cannot partition a custom call)."""
    code = (
        "import jax, jax.numpy as jnp\n"
        "from specjax.model import linear\n"
        "print(jax.device_count(), 'specjax_rows_matmul' in "
        "jax.jit(linear).lower(jnp.zeros((2, 8)), jnp.zeros((4, 8))).as_text())\n"
    )
    env = dict(os.environ, XLA_FLAGS=xla_flags(2), SPECJAX_CPU_MATMUL="auto")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert out.stdout.split() == ["2", "False"]
