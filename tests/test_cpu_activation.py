"""The MLP activation kernel (`specjax.cpu.activation.swiglu`) against XLA's silu(gate) * up."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.cpu.activation import swiglu
from specjax.cpu.matmul import use_cpu_matmul
from specjax.cpu.native import unsupported_reason

needs_kernel = pytest.mark.skipif(
    unsupported_reason() is not None, reason=f"kernel unavailable: {unsupported_reason()}"
)


def xla_swiglu(h):
    g, u = np.split(np.asarray(h, np.float64), 2, axis=-1)
    return g / (1 + np.exp(-g)) * u


@needs_kernel
@pytest.mark.parametrize("shape", [(1, 3072), (10, 3072), (2, 3, 70), (700, 96)])
def test_kernel_matches_silu_times_up_and_each_row_alone(shape):
    """Values from -100 to 100 (no overflow either side) within float32 rounding of float64
    silu(gate) * up; a row's result is the same bits alone or among others (decode = verify)."""
    rng = np.random.default_rng(shape[0])
    h = rng.normal(0, 4, shape).astype(np.float32)
    h.reshape(-1)[:4] = [-100.0, 100.0, 0.0, -0.0]
    with use_cpu_matmul("kernel"):
        f = jax.jit(swiglu)
        assert "specjax_swiglu" in f.lower(jnp.asarray(h)).as_text()
        y = np.asarray(f(jnp.asarray(h)))
        first = np.asarray(f(jnp.asarray(h.reshape(-1, shape[-1])[:1])))
    assert y.shape == shape[:-1] + (shape[-1] // 2,)
    np.testing.assert_allclose(y, xla_swiglu(h), rtol=3e-6, atol=1e-30)
    np.testing.assert_array_equal(first[0], y.reshape(-1, shape[-1] // 2)[0])


@needs_kernel
def test_gradient_is_xlas():
    """Training differentiates through the kernel: the gradient is XLA's silu(gate) * up's."""
    h = jnp.asarray(np.random.default_rng(1).normal(size=(3, 40)), jnp.float32)
    loss = lambda f: lambda x: jnp.sum(f(x) ** 2)
    with use_cpu_matmul("kernel"):
        got = jax.grad(loss(swiglu))(h)
    want = jax.grad(loss(lambda x: jax.nn.silu(x[:, :20]) * x[:, 20:]))(h)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)


def test_xla_path_without_the_kernel():
    h = jnp.asarray(np.random.default_rng(2).normal(size=(4, 12)), jnp.float32)
    with use_cpu_matmul("xla"):
        y = swiglu(h)
    np.testing.assert_array_equal(np.asarray(y), np.asarray(jax.nn.silu(h[:, :6]) * h[:, 6:]))
