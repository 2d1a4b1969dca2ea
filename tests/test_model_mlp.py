"""The decoder's gated MLP: rows beyond the CPU kernel's (a prefill) take their product as
columns; every row count gives the MLP's value."""

import numpy as np
import pytest

import specjax.model as model
from specjax.cpu.matmul import MAX_ROWS


def reference(x, layer, eps):
    h = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * layer["mlp_norm"]
    f = layer["w_down"].shape[1]
    gate, up = h @ layer["w_gate_up"][:f].T, h @ layer["w_gate_up"][f:].T
    return x + (gate / (1 + np.exp(-gate)) * up) @ layer["w_down"].T


@pytest.mark.parametrize("rows", [1, 8, MAX_ROWS, MAX_ROWS + 1, 200])
def test_mlp_block_matches_numpy_at_any_row_count(rows, monkeypatch):
    rng = np.random.default_rng(rows)
    d, f = 32, 96
    layer = {
        "mlp_norm": rng.uniform(0.5, 1.5, d).astype(np.float32),
        "w_gate_up": (rng.standard_normal((2 * f, d)) / np.sqrt(d)).astype(np.float32),
        "w_down": (rng.standard_normal((d, f)) / np.sqrt(f)).astype(np.float32),
    }
    x = rng.standard_normal((1, rows, d)).astype(np.float32)
    cfg = type("Cfg", (), {"rms_norm_eps": 1e-5})()
    columns = []
    real = model._gated_columns
    monkeypatch.setattr(model, "_gated_columns", lambda *a: columns.append(1) or real(*a))
    out = np.asarray(model.mlp_block(layer, cfg, x))
    assert bool(columns) == (rows > MAX_ROWS)  # the column form only past the kernel's rows
    np.testing.assert_allclose(out, reference(x, layer, 1e-5), rtol=2e-5, atol=2e-5)
