"""The draft top-k kernel (`specjax.cpu.top_k`) against lax.top_k over jax.nn.log_softmax."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.cpu.matmul import use_cpu_matmul
from specjax.cpu.native import unsupported_reason
from specjax.cpu.top_k import top_log_probs

needs_kernel = pytest.mark.skipif(
    unsupported_reason() is not None, reason=f"kernel unavailable: {unsupported_reason()}"
)


def reference(x, k):
    logp, ids = jax.lax.top_k(jax.nn.log_softmax(x, axis=-1), k)
    return np.asarray(logp), np.asarray(ids)


@needs_kernel
@pytest.mark.parametrize("shape,k", [((3, 4096), 3), ((1, 4096), 1), ((2, 5, 301), 8), ((4, 17), 17), ((6, 1000), 10)])
def test_kernel_gives_the_ids_of_top_k_and_the_log_softmax_values(shape, k):
    """Random logits with many exact ties (values on a coarse grid): the same ids in the same
    order as lax.top_k (ties to the lower index) and log-probabilities within float32 rounding
    of jax.nn.log_softmax's."""
    rng = np.random.default_rng(k + shape[-1])
    x = jnp.asarray(np.round(rng.normal(0, 4, shape) * 2) / 2, jnp.float32)  # ties
    with use_cpu_matmul("kernel"):
        logp, ids = jax.jit(top_log_probs, static_argnums=1)(x, k)
        assert "specjax_top_log_probs" in jax.jit(top_log_probs, static_argnums=1).lower(x, k).as_text()
    want_logp, want_ids = reference(x, k)
    assert logp.shape == ids.shape == shape[:-1] + (k,) and ids.dtype == jnp.int32
    np.testing.assert_array_equal(np.asarray(ids), want_ids)
    np.testing.assert_allclose(np.asarray(logp), want_logp, rtol=2e-6, atol=2e-6)


@needs_kernel
def test_kernel_handles_minus_infinity_and_a_row_of_equal_logits():
    """Masked (-inf) entries weigh nothing and are chosen last; equal logits give the first k
    ids and log(1 / V) each."""
    x = np.full((2, 40), -np.inf, np.float32)
    x[0, [7, 3, 30]] = [1.0, 2.0, 1.0]
    x[1] = 0.5
    with use_cpu_matmul("kernel"):
        logp, ids = top_log_probs(jnp.asarray(x), 4)
    want_logp, want_ids = reference(jnp.asarray(x), 4)
    np.testing.assert_array_equal(np.asarray(ids), want_ids)
    assert list(np.asarray(ids)[1]) == [0, 1, 2, 3]
    np.testing.assert_allclose(np.asarray(logp), want_logp, rtol=2e-6, atol=2e-6)
    assert np.isneginf(np.asarray(logp)[0, 3])


def test_xla_path_and_bad_k():
    """Without the kernel the function is lax.top_k over log_softmax; k outside [1, V] is
    refused with the sizes named."""
    x = jnp.asarray(np.random.default_rng(0).normal(size=(2, 50)), jnp.float32)
    with use_cpu_matmul("xla"):
        logp, ids = top_log_probs(x, 5)
    want_logp, want_ids = reference(x, 5)
    np.testing.assert_array_equal(np.asarray(ids), want_ids)
    np.testing.assert_array_equal(np.asarray(logp), want_logp)
    with pytest.raises(ValueError, match=r"top 51 of 50 logits"):
        top_log_probs(x, 51)
