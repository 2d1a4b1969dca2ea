"""Pallas tree-paged-attention kernel: interpret mode on CPU against the XLA reference, CUDA
lowering through jax.export, and greedy decoding with the kernel forced on."""

from __future__ import annotations

import dataclasses

import jax
import jax.extend.core
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export

from specjax import Engine, ModelConfig, init_params
from specjax.attention import attention_backend, gpu_supports_kernel, paged_attention, use_attention_backend
from specjax.cache import PagedKVCache, init_pages
from specjax.kernels_pallas import tree_paged_attention, tree_paged_attention_reference
from specjax.kernels_pallas.random_cases import TOL, make_case, rel_err
from specjax.model import causal_mask, decoder_layers, forward, lm_head_weight
from specjax.proposers.eagle import EagleDynamicProposer

TRITON = "__gpu$xla.gpu.triton"
# On a CUDA GPU (sm80+) the same tests run the kernel natively; elsewhere in interpret mode.
INTERPRET = not gpu_supports_kernel()
KERNEL = "pallas-interpret" if INTERPRET else "pallas"


# (T, G, page_size): every T with every GQA ratio, the page sizes spread over them.
GRID = [
    (t, g, ps)
    for i, (t, g) in enumerate((t, g) for t in (1, 5, 26, 64) for g in (1, 3, 8))
    for ps in ((16, 32, 64)[i % 3],)
]


@pytest.mark.parametrize("t,g,ps", GRID)
def test_matches_reference_float32(t, g, ps):
    args, _ = make_case(t * 100 + g * 10 + ps, t=t, g=g, ps=ps, kvh=2 if g < 8 else 1)
    out = tree_paged_attention(*args, interpret=INTERPRET)
    ref = tree_paged_attention_reference(*args)
    assert np.isfinite(np.asarray(out)).all()
    assert rel_err(out, ref) < TOL[jnp.float32]


@pytest.mark.parametrize(
    "dtype,t,g,ps", [(jnp.bfloat16, 1, 8, 16), (jnp.bfloat16, 26, 3, 32), (jnp.float16, 64, 1, 64)]
)
def test_matches_reference_half(dtype, t, g, ps):
    args, _ = make_case(7 + t, t=t, g=g, ps=ps, dtype=dtype)
    out = tree_paged_attention(*args, interpret=INTERPRET)
    assert out.dtype == dtype
    assert rel_err(out, tree_paged_attention_reference(*args)) < TOL[dtype]


@pytest.mark.parametrize("k_splits", [2, 5])
def test_split_keys_merge(k_splits):
    """Flash-decoding: committed slots over several programs, merged by XLA (splits past the
    last block stay empty)."""
    args, _ = make_case(11, t=5, g=3, ps=16, n=12)
    out = tree_paged_attention(*args, interpret=INTERPRET, k_splits=k_splits)
    assert rel_err(out, tree_paged_attention_reference(*args)) < TOL[jnp.float32]


def test_scratch_tree_wider_than_queries():
    """EAGLE drafting: T queries over J > T scratch keys written by earlier calls."""
    args, _ = make_case(12, t=4, j=26, g=3, ps=16)
    out = tree_paged_attention(*args, interpret=INTERPRET)
    assert rel_err(out, tree_paged_attention_reference(*args)) < TOL[jnp.float32]


def test_prefill_chunk_blocks_over_tree_keys():
    """A causal prefill chunk wider than one tree block: only the blocks a query block sees."""
    args, _ = make_case(13, t=70, g=2, ps=32)
    q, k, v, tables, lengths, _ = args
    tree = causal_mask(q.shape[0], 70) & (jnp.arange(70) < 60)[None, None, :]  # padding at 60+
    args = (q, k, v, tables, lengths, tree)
    out = tree_paged_attention(*args, interpret=INTERPRET, block_j=16, block_q=32)
    assert rel_err(out, tree_paged_attention_reference(*args)) < TOL[jnp.float32]


@pytest.mark.parametrize("k_splits", [1, 3])
def test_sliding_window_key_mask(k_splits):
    args, key_mask = make_case(14, t=5, g=3, ps=16, window=20)
    out = tree_paged_attention(*args, key_mask=key_mask, interpret=INTERPRET, k_splits=k_splits)
    ref = tree_paged_attention_reference(*args, key_mask=key_mask)
    assert rel_err(out, ref) < TOL[jnp.float32]


def test_nan_in_unread_slots_changes_nothing():
    nan_args, _ = make_case(15, t=5, g=3, ps=16, fill=np.nan)
    zero_args, _ = make_case(15, t=5, g=3, ps=16, fill=0.0)
    a = np.asarray(tree_paged_attention(*nan_args, interpret=INTERPRET, k_splits=2))
    b = np.asarray(tree_paged_attention(*zero_args, interpret=INTERPRET, k_splits=2))
    assert np.isfinite(a).all()
    np.testing.assert_array_equal(a, b)


def test_query_without_visible_keys_gives_zeros():
    args, _ = make_case(16, b=2, t=5, g=3, ps=16)
    q, k, v, tables, lengths, tree = args
    lengths = lengths.at[1].set(0)
    tree = tree.at[1, 2].set(False)
    out = np.asarray(tree_paged_attention(q, k, v, tables, lengths, tree, interpret=INTERPRET))
    np.testing.assert_array_equal(out[1, 2], 0.0)
    ref = tree_paged_attention_reference(q, k, v, tables, lengths, tree)
    assert rel_err(out, ref) < TOL[jnp.float32]


def test_rejects_shapes_triton_cannot_tile():
    args, _ = make_case(17, t=1, g=1, d=8)
    with pytest.raises(ValueError, match="head_dim"):
        tree_paged_attention(*args, interpret=INTERPRET)
    with use_attention_backend("pallas-interpret"), pytest.raises(ValueError, match="forced"):
        paged_attention(*args)
    with use_attention_backend("auto"):  # off GPU: the CPU kernel or the reference (any shape)
        assert attention_backend() in ("cpu", "xla")
        paged_attention(*args)


# --- CUDA lowering -------------------------------------------------------------------------------


def _triton_modules(exported):
    """The Triton modules of every Pallas kernel in an exported function, parsed and verified."""
    from jax._src.interpreters import mlir
    from jax._src.lib.mlir import ir
    from jax._src.pallas.triton import lowering

    with mlir.make_ir_context():
        module = ir.Module.parse(exported.mlir_module())
        blobs = []

        def walk(op):
            for region in op.regions:
                for block in region.blocks:
                    for inner in block.operations:
                        if (
                            inner.operation.name == "stablehlo.custom_call"
                            and ir.StringAttr(inner.attributes["call_target_name"]).value == TRITON
                        ):
                            config = inner.attributes["mhlo.backend_config"]
                            blobs.append(ir.StringAttr(config["ir"]).value_bytes)
                        walk(inner.operation)

        walk(module.operation)
    texts = []
    for blob in blobs:
        with lowering._new_ir_context():
            triton_module = ir.Module.parse(blob)
            assert triton_module.operation.verify()
            texts.append(str(triton_module))
    return texts


def export_cuda(fn, *args):
    """jax.export for CUDA on this CPU machine. Triton custom calls carry no compatibility
    guarantee, so export refuses them unless that check is disabled."""
    return export.export(
        jax.jit(fn), platforms=["cuda"], disabled_checks=[export.DisabledSafetyCheck.custom_call(TRITON)]
    )(*args)


S = jax.ShapeDtypeStruct
# (B, T, J, H, KVH, D, page_size, pages per sequence, dtype, window): Llama-3-8B heads at
# decode / tree verify / prefill / EAGLE drafting, SmolLM2 and Qwen2 head groups, Mistral windows.
KERNEL_CONFIGS = [
    (1, 1, 1, 32, 8, 128, 16, 512, jnp.bfloat16, None),
    (32, 1, 1, 32, 8, 128, 16, 128, jnp.bfloat16, None),
    (8, 64, 64, 32, 8, 128, 16, 128, jnp.bfloat16, None),
    (1, 512, 512, 32, 8, 128, 16, 64, jnp.bfloat16, None),
    (4, 10, 60, 32, 8, 128, 16, 64, jnp.bfloat16, None),
    (2, 26, 26, 9, 3, 64, 32, 32, jnp.float16, None),
    (2, 8, 8, 14, 2, 64, 64, 16, jnp.float32, None),
    (2, 8, 8, 32, 8, 128, 16, 64, jnp.bfloat16, 4096),
]


@pytest.mark.parametrize("cfg", KERNEL_CONFIGS, ids=lambda c: "-".join(map(str, c[:8])))
def test_kernel_exports_for_cuda(cfg):
    b, t, j, h, kvh, d, ps, n, dtype, window = cfg
    pool = S((kvh, b * n + 1, ps, d), dtype)
    args = [S((b, t, h, d), dtype), pool, pool, S((b, n), jnp.int32), S((b,), jnp.int32), S((b, t, j), bool)]
    if window:
        args.append(S((b, t, n * ps), bool))

    def fn(q, k, v, tables, lengths, tree, key_mask=None):
        return tree_paged_attention(q, k, v, tables, lengths, tree, key_mask=key_mask)

    texts = _triton_modules(export_cuda(fn, *args))
    assert len(texts) == 1
    if dtype == jnp.float32:  # float32 products must not fall to TF32 on Ampere and Hopper
        assert "tt.dot" in texts[0] and "inputPrecision = tf32" not in texts[0]


TINY = ModelConfig(
    vocab_size=64,
    hidden_size=64,
    intermediate_size=96,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    max_position_embeddings=512,
)


@pytest.mark.parametrize("window", [None, 24])
def test_model_passes_export_for_cuda(window):
    """Every attention call the model makes (prefill chunk, decode, tree verify, drafting into
    scratch slots) lowers with the kernel forced on."""
    cfg = dataclasses.replace(TINY, sliding_window=window)
    params = init_params(cfg, jax.random.PRNGKey(0), dtype=jnp.bfloat16)
    k_pages, v_pages = init_pages(cfg, 64, 16, jnp.bfloat16)
    b, n = 2, 8
    cache = PagedKVCache(k_pages, v_pages, jnp.zeros((b, n), jnp.int32), jnp.zeros((b,), jnp.int32))

    def run(params, cache, tokens, tree):
        t = tokens.shape[1]
        pos = cache.lengths[:, None] + jnp.arange(t)[None]
        return forward(params, cfg, tokens, pos, cache, tree).logits

    def draft(params, cache, x, tree):
        t = x.shape[1]
        pos = cache.lengths[:, None] + jnp.arange(t)[None]
        slots = cache.lengths[:, None] + 2 + jnp.arange(t)[None]
        return decoder_layers(params["layers"], cfg, x, pos, cache, tree, jnp.ones(x.shape[:2], bool), slots=slots)[0]

    with use_attention_backend("pallas"):
        for t in (1, 8, 48):
            texts = _triton_modules(export_cuda(run, params, cache, S((b, t), jnp.int32), S((b, t, t), bool)))
            assert len(texts) == cfg.num_layers
        texts = _triton_modules(export_cuda(draft, params, cache, S((b, 3, 64), jnp.bfloat16), S((b, 3, 5), bool)))
        assert len(texts) == cfg.num_layers


# --- end to end --------------------------------------------------------------------------------

PROMPTS = [[3, 9, 27, 17, 51, 25, 11, 33, 35, 41, 7, 7, 2, 60, 31, 18, 19, 40], [5, 5, 5, 6], [1, 2]]


def test_greedy_decoding_with_kernel_matches_reference():
    params = init_params(TINY, jax.random.PRNGKey(1), scale=0.5)
    runs = {}
    for backend in ("xla", KERNEL):
        with use_attention_backend(backend):
            eng = Engine(params, TINY, num_pages=64, page_size=16)
            runs[backend] = eng.generate(PROMPTS, 12, eos_token_ids=()).token_ids
            traced = str(
                jax.make_jaxpr(
                    lambda p: forward(
                        p,
                        TINY,
                        jnp.zeros((1, 1), jnp.int32),
                        jnp.zeros((1, 1), jnp.int32),
                        PagedKVCache(
                            eng.k_pages, eng.v_pages, jnp.zeros((1, 2), jnp.int32), jnp.zeros((1,), jnp.int32)
                        ),
                        causal_mask(1, 1),
                    )
                )(params)
            )
            assert ("pallas_call" in traced) == (backend != "xla")
    assert runs[KERNEL] == runs["xla"]
    assert all(len(r) == 12 for r in runs["xla"])


@pytest.mark.slow  # ~40 s of interpret-mode compiles
def test_eagle_tree_decoding_with_kernel_matches_reference():
    """Tree verify (T > 1) and EAGLE-2 drafting into scratch slots (J != T) through the kernel."""
    params = init_params(TINY, jax.random.PRNGKey(2), scale=0.5)
    draft_cfg = dataclasses.replace(TINY, num_layers=1)
    layer = init_params(draft_cfg, jax.random.PRNGKey(3), scale=0.3)["layers"][0]
    del layer["attn_norm"]
    k1, k2 = jax.random.split(jax.random.PRNGKey(4))
    fc = {
        "kernel": 0.3 * jax.random.normal(k1, (2 * TINY.hidden_size, TINY.hidden_size)),
        "bias": 0.3 * jax.random.normal(k2, (TINY.hidden_size,)),
    }
    pparams = {"net": {"fc": fc, "layers": [layer]}, "embed": params["embed"], "lm_head": lm_head_weight(params)}
    proposer = EagleDynamicProposer(draft_cfg, total_tokens=10, depth=3, top_k=3)
    with use_attention_backend("xla"):
        want = Engine(params, TINY, num_pages=64, page_size=16).generate(PROMPTS, 10, eos_token_ids=()).token_ids
    with use_attention_backend(KERNEL):
        got = Engine(params, TINY, num_pages=64, page_size=16).generate(
            PROMPTS, 10, eos_token_ids=(), proposer=proposer, proposer_params=pparams
        )
    assert got.token_ids == want


@pytest.mark.parametrize("t,g,ps,k_splits", [(1, 3, 16, 1), (5, 1, 16, 2), (26, 8, 32, 1)])
def test_unwritten_tree_rows(t, g, ps, k_splits):
    """k_new/v_new: the tree keys passed as rows instead of read from their slots (a verify pass
    deferring its writes). With the slots themselves NaN, the result equals the written case."""
    args, _ = make_case(t * 7 + g, t=t, g=g, ps=ps, kvh=2 if g < 8 else 1)
    q, k, v, tables, lengths, tree = args
    slots = np.asarray(lengths)[:, None] + np.arange(t)[None]
    page = np.take_along_axis(np.asarray(tables), slots // ps, axis=1)
    rows = lambda pool: jnp.asarray(np.asarray(pool)[:, page, slots % ps].transpose(1, 2, 0, 3))
    k_new, v_new = rows(k), rows(v)  # [B, T, KVH, D]
    k_nan = np.asarray(k).copy()
    v_nan = np.asarray(v).copy()
    k_nan[:, page, slots % ps] = np.nan
    v_nan[:, page, slots % ps] = np.nan
    want = tree_paged_attention_reference(*args)
    got = tree_paged_attention(
        q,
        jnp.asarray(k_nan),
        jnp.asarray(v_nan),
        tables,
        lengths,
        tree,
        k_new=k_new,
        v_new=v_new,
        interpret=INTERPRET,
        k_splits=k_splits,
    )
    assert rel_err(got, want) < TOL[jnp.float32]


def test_verify_defers_pool_writes_on_the_pallas_path():
    """On the Pallas path too, verify's lax.switch branches write no pool (the kernel reads the
    unwritten tree rows): results equal writing inside the pass, and no branch of the traced
    speculative loop returns a pool (which is what makes XLA copy it)."""
    from tests.test_speculative import check_deferred_writes

    params = init_params(TINY, jax.random.PRNGKey(5), scale=0.5)
    with use_attention_backend(KERNEL):
        check_deferred_writes(params, TINY, tol=1e-4, compiled=False)


@pytest.mark.parametrize("dtype_bytes", [2, 4])
def test_tiles_fit_each_architectures_shared_memory(dtype_bytes):
    """Hopper keeps its tiles; sm86/sm89 (99 KiB of shared memory) get smaller ones that fit."""
    from specjax.kernels_pallas.tree_paged_attention import default_blocks

    shapes = [(1, 1, 32, 8, 16, 8192), (32, 1, 32, 8, 16, 8192), (8, 64, 32, 8, 16, 2048), (2, 26, 9, 3, 32, 1024)]
    for shape in shapes:
        d = 64 if shape[2] == 9 else 128
        for kib in (99, 163, 227):
            bq, bk, _, _ = default_blocks(*shape, d=d, itemsize=dtype_bytes, smem_kib=kib)
            assert (bq + 4 * bk) * d * dtype_bytes <= 0.75 * kib * 1024, (shape, kib)
            assert bq >= 16 and bk >= 16
    assert default_blocks(*shapes[0], smem_kib=227)[:2] == (16, 128)
    assert default_blocks(*shapes[2], smem_kib=227)[:2] == (128, 64)


def _dot_precisions(jaxpr) -> list:
    """The `precision` of every dot_general in a jaxpr, nested jaxprs (pallas_call's body) too."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            found.append(eqn.params["precision"])
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            found += _dot_precisions(sub)
    return found


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_float32_dots_ask_for_full_precision(dtype):
    """On a GPU a float32 dot of default precision runs as TF32 (relative error ~5e-4): the first
    H200 run found the reference doing that against the kernel's full-precision dots. Both must
    ask for HIGHEST in float32 (and leave half precision alone)."""
    args, _ = make_case(0, t=5, g=4, ps=16, kvh=2, dtype=dtype)
    for fn in (tree_paged_attention_reference, lambda *a: tree_paged_attention(*a, interpret=True)):
        precisions = _dot_precisions(jax.make_jaxpr(fn)(*args).jaxpr)
        assert len(precisions) >= 2
        for p in precisions:
            highest = p is not None and all(x == jax.lax.Precision.HIGHEST for x in p)
            assert highest == (dtype == jnp.float32), p
