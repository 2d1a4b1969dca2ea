"""specjax's native CPU kernels: C++ sources (`*.cc`, `simd.h`) beside the Python that calls
them, built with the machine's g++ on first use and called as XLA FFI custom calls.

- `native`: whether the kernels can run here; builds (cached) and registers them.
- `matmul`: few-row matrix products (`rows_matmul.cc`), the packed weight layout, and the switch
  (`SPECJAX_CPU_MATMUL`) that turns every CPU kernel on or off.
- `draft_weights`: the type draft networks' weights take on the matmul kernel
  (`SPECJAX_DRAFT_WEIGHTS`).
- `attention`: paged attention (`paged_attention.cc`), chosen by `specjax.attention`.
- `activation`: an MLP's silu(gate) * up (`swiglu.cc`).
- `top_k`: a draft's best tokens and their log-probabilities (`top_log_probs.cc`).
"""
