"""The native paged-attention kernel on CPU (specjax.cpu.attention) against the XLA reference."""

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import xla_flags

from specjax.attention import attention_backend, use_attention_backend
from specjax.cpu.attention import TARGET, _reference, cpu_paged_attention
from specjax.cpu.native import unsupported_reason

needs_kernel = pytest.mark.skipif(
    unsupported_reason() is not None, reason=f"kernel unavailable: {unsupported_reason()}"
)


def make_case(seed, b=2, t=5, g=3, kvh=3, d=64, pages=24, page_size=16, per_seq=6, new=5):
    """Random pools (hidden slots hold NaN), tables, new rows and a mask over pages + new rows."""
    rng = np.random.default_rng(seed)
    h = g * kvh
    q = rng.standard_normal((b, t, h, d)).astype(np.float32)
    k = rng.standard_normal((kvh, pages, page_size, d)).astype(np.float32)
    v = rng.standard_normal((kvh, pages, page_size, d)).astype(np.float32)
    tables = np.stack([rng.permutation(pages)[:per_seq] for _ in range(b)]).astype(np.int32)
    k_new = rng.standard_normal((b, new, kvh, d)).astype(np.float32)
    v_new = rng.standard_normal((b, new, kvh, d)).astype(np.float32)
    mask = rng.random((b, t, per_seq * page_size + new)) < 0.6
    mask[0, 0] = False  # a row that sees nothing gets 0
    # Slots no query sees may hold anything, NaN included.
    hidden = ~mask.any(axis=1)[:, : per_seq * page_size]
    for s in range(b):
        for slot in np.flatnonzero(hidden[s]):
            page, off = tables[s, slot // page_size], slot % page_size
            if not any(
                page == tables[o, sl // page_size] and sl % page_size == off
                for o in range(b)
                for sl in np.flatnonzero(~hidden[o])
            ):
                k[:, page, off] = v[:, page, off] = np.nan
    return tuple(map(jnp.asarray, (q, k, v, tables, mask, k_new, v_new)))


@needs_kernel
@pytest.mark.parametrize("t,g,d,new", [(1, 3, 64, 0), (4, 3, 64, 4), (8, 1, 128, 8), (5, 2, 256, 3), (3, 3, 64, 0)])
def test_matches_reference(t, g, d, new):
    q, k, v, tables, mask, k_new, v_new = make_case(t * 100 + d, t=t, g=g, d=d, new=new)
    out = np.asarray(cpu_paged_attention(q, k, v, tables, mask, k_new, v_new))
    ref = np.asarray(_reference(q, k, v, tables, mask, k_new, v_new, d**-0.5))
    assert np.isfinite(out).all()
    np.testing.assert_array_equal(out[0, 0], 0.0)
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=2e-6)


@needs_kernel
def test_a_row_does_not_depend_on_the_other_rows():
    """Each query row alone gives bit for bit what it gives among the others (whose masks differ),
    and so does a row whose key sits in the pages rather than among a pass's new rows."""
    q, k, v, tables, mask, k_new, v_new = make_case(7, b=1, t=8, new=8)
    paged = 6 * 16
    mask = mask.at[0, 3, 64:paged].set(False)  # row 3 sees no page slot past 63
    mask = mask.at[0, 3, paged : paged + 3].set(True)
    f = jax.jit(cpu_paged_attention)
    out = np.asarray(f(q, k, v, tables, mask, k_new, v_new))
    for i in range(8):
        alone = f(q[:, i : i + 1], k, v, tables, mask[:, i : i + 1], k_new, v_new)
        np.testing.assert_array_equal(np.asarray(alone)[:, 0], out[:, i])
    # Row 3 with the new rows it sees written into slots 64.. of its pages instead (as a decode
    # step finds them): the same keys in the same order.
    seen_new = np.flatnonzero(np.asarray(mask[0, 3, paged:]))
    page_mask = np.asarray(mask[0, 3, :paged]).copy()
    k2, v2 = np.asarray(k).copy(), np.asarray(v).copy()
    tab = np.asarray(tables)[0]
    for slot, j in enumerate(seen_new, start=64):
        k2[:, tab[slot // 16], slot % 16] = np.asarray(k_new)[0, j]
        v2[:, tab[slot // 16], slot % 16] = np.asarray(v_new)[0, j]
        page_mask[slot] = True
    written = f(q[:, 3:4], jnp.asarray(k2), jnp.asarray(v2), tables, jnp.asarray(page_mask)[None, None])
    np.testing.assert_array_equal(np.asarray(written)[0, 0], out[0, 3])


@needs_kernel
def test_causal_rows_match_the_reference_and_themselves_alone():
    """A prefill's causal mask (a shared page prefix, then new row j seen by rows >= j): the
    kernel reads each chunk of rows only up to the last key it sees; every row still equals the
    reference and, bit for bit, itself computed alone."""
    t = 40
    q, k, v, tables, _, k_new, v_new = make_case(11, b=1, t=t, new=t)
    paged = 6 * 16
    mask = np.zeros((1, t, paged + t), bool)
    mask[0, :, :20] = True
    mask[0, :, paged:] = np.tril(np.ones((t, t), bool))
    k, v = np.asarray(k).copy(), np.asarray(v).copy()
    tab = np.asarray(tables)[0]
    for slot in range(20, paged):  # slots nobody sees hold NaN
        k[:, tab[slot // 16], slot % 16] = v[:, tab[slot // 16], slot % 16] = np.nan
    k, v, mask = jnp.asarray(k), jnp.asarray(v), jnp.asarray(mask)
    f = jax.jit(cpu_paged_attention)
    out = np.asarray(f(q, k, v, tables, mask, k_new, v_new))
    ref = np.asarray(_reference(q, k, v, tables, mask, k_new, v_new, 64**-0.5))
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=2e-6)
    for i in (0, 1, 7, 20, 39):
        alone = f(q[:, i : i + 1], k, v, tables, mask[:, i : i + 1], k_new, v_new)
        np.testing.assert_array_equal(np.asarray(alone)[:, 0], out[:, i])


@needs_kernel
def test_gradients_through_the_reference():
    q, k, v, tables, mask, k_new, v_new = make_case(3, t=2, new=2)
    k = jnp.nan_to_num(k)
    v = jnp.nan_to_num(v)

    def loss(fn, q, k_new):
        return jnp.sum(jnp.sin(fn(q, k, v, tables, mask, k_new, v_new)))

    got = jax.grad(lambda q, kn: loss(cpu_paged_attention, q, kn), argnums=(0, 1))(q, k_new)
    ref = jax.grad(lambda q, kn: loss(lambda *a: _reference(*a, 64**-0.5), q, kn), argnums=(0, 1))(q, k_new)
    for a, b in zip(got, ref):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


@needs_kernel
def test_model_forward_uses_it():
    """A head_dim-64 model on the `cpu` backend: the custom call is in the compiled forward, and
    its logits match the XLA reference backend's."""
    from specjax.cache import PagedKVCache, init_pages
    from specjax.model import causal_mask, forward, init_params
    from specjax.model_config import ModelConfig

    config = ModelConfig(
        vocab_size=64, hidden_size=128, intermediate_size=256, num_layers=2, num_heads=6, num_kv_heads=2, head_dim=64
    )
    params = init_params(config, jax.random.PRNGKey(0))
    k, v = init_pages(config, 8, 16)
    cache = PagedKVCache(k, v, jnp.arange(4, dtype=jnp.int32)[None], jnp.zeros((1,), jnp.int32))
    tokens = jnp.arange(1, 11, dtype=jnp.int32)[None] % 64

    def run(defer):
        return forward(
            params, config, tokens, jnp.arange(10)[None], cache, causal_mask(1, 10), defer_kv_write=defer
        ).logits

    outs = {}
    for backend in ("cpu", "xla"):
        with use_attention_backend(backend):
            assert (TARGET in jax.jit(run, static_argnums=0).lower(True).as_text()) == (backend == "cpu")
            outs[backend] = [np.asarray(jax.jit(run, static_argnums=0)(d)) for d in (True, False)]
    for got, ref in zip(outs["cpu"], outs["xla"]):
        np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-5)


@needs_kernel
def test_lowering_for_a_gpu_takes_the_reference():
    from jax import export

    q, k, v, tables, mask, k_new, v_new = make_case(1, t=2, new=2)
    exp = export.export(jax.jit(cpu_paged_attention), platforms=["cuda"])(q, k, v, tables, mask, k_new, v_new)
    assert TARGET not in exp.mlir_module()


def test_auto_backend_on_one_and_several_cpu_devices():
    """`auto` picks the kernel on one CPU device and the reference over a mesh."""
    if unsupported_reason() is None:
        with use_attention_backend("auto"):
            assert attention_backend() == "cpu"
    code = (
        "import jax\nfrom specjax.attention import attention_backend\nprint(jax.device_count(), attention_backend())\n"
    )
    env = dict(os.environ, XLA_FLAGS=xla_flags(2), SPECJAX_ATTENTION="auto")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert out.stdout.split() == ["2", "xla"]
