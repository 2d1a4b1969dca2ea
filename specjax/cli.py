"""The `specjax` command: generate, serve, bench, convert, and (from specjax.training) train and
synthesize-prompts.

Errors print one line on stderr and exit non-zero; `--debug` shows the traceback instead.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from specjax import settings
from specjax.method_configs import (
    METHODS,
    MethodError,
    add_option_flags,
    as_flags,
    canonical_method,
    given_options,
    method_config,
)
from specjax.prompts import encode_prompt, read_prompt_file


class UsageError(ValueError):
    """Bad command-line input."""


def _add_sampling_args(p):
    p.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0, help="0 is off")
    p.add_argument("--seed", type=int, default=0, help="prompt i samples with seed + i")


def _sampling_of(args):
    """The SamplingConfig of --temperature, --top-k and --top-p (one-line errors)."""
    from specjax.sampling import SamplingConfig

    if args.temperature < 0:
        raise UsageError(f"--temperature must be >= 0, got {args.temperature}")
    if not 0 < args.top_p <= 1:
        raise UsageError(f"--top-p must be in (0, 1], got {args.top_p}")
    if args.top_k < 0:
        raise UsageError(f"--top-k must be >= 0, got {args.top_k}")
    return SamplingConfig(args.temperature, args.top_k, args.top_p)


def _add_generate(sub):
    p = sub.add_parser("generate", help="generate text with a model (vanilla or speculative)")
    p.add_argument("--model", default="smollm2-135m", help="embedded name, checkpoint dir or .gguf file")
    p.add_argument("--method", default="vanilla", help=f"decoding method ({', '.join(METHODS)}; eagle is eagle1)")
    p.add_argument("--prompt", action="append", default=[], help="a prompt (repeatable)")
    p.add_argument("--prompts-file", help="JSONL with 'turns' (first is the prompt) or 'prompt'")
    p.add_argument("--limit", type=int, default=None, help="use only the first N prompts of the file")
    p.add_argument("--max-new-tokens", type=int, default=128)
    _add_sampling_args(p)
    p.add_argument("--batch-size", type=int, default=1, help="prompts decoded together")
    p.add_argument("--raw", action="store_true", help="tokenize the prompt as is, no chat template")
    p.add_argument("--json", action="store_true", help="one JSON line per prompt")
    p.add_argument("--no-warmup", action="store_true", help="time the first (compiling) run too")
    p.add_argument(
        "--fixed-speculation",
        action="store_true",
        help="verify the method's whole trees every step (default: as many nodes as pay on "
        "this device, down to plain decoding, measured as it decodes)",
    )
    p.add_argument("--cache-pages", type=int, default=None, help="KV pages in the pool")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--debug", action="store_true", help="show tracebacks")
    add_option_flags(p)
    par = p.add_argument_group("parallelism (mesh of tp x dp devices; multi-host through jax.distributed)")
    par.add_argument(
        "--tp", type=int, default=1, help="tensor parallel: devices each layer is split over (divides KV heads)"
    )
    par.add_argument("--dp", type=int, default=1, help="data parallel: device groups the batch is split over")
    par.add_argument(
        "--coordinator",
        default=None,
        metavar="HOST:PORT",
        help="multi-host: address of process 0 (run the same command on every host)",
    )
    par.add_argument("--num-processes", type=int, default=None, help="multi-host: process count")
    par.add_argument("--process-id", type=int, default=None, help="multi-host: this process's id")


def _add_convert(sub):
    p = sub.add_parser("convert", help="convert a checkpoint (HF dir, GGUF, specjax) to specjax or HF")
    p.add_argument("src", help="Hugging Face model dir, .gguf file, specjax checkpoint or embedded name")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument(
        "--to",
        choices=("specjax", "hf"),
        default=None,
        help="output format (default: specjax, or hf when SRC is a specjax checkpoint)",
    )
    p.add_argument("--debug", action="store_true", help="show tracebacks")


def read_prompts(args) -> list[str]:
    """The prompts of --prompt and --prompts-file (see `specjax.prompts`), cut to --limit."""
    prompts = list(args.prompt)
    if args.prompts_file:
        prompts += [r.text for r in read_prompt_file(args.prompts_file)]
    if args.limit is not None:
        prompts = prompts[: args.limit]
    if not prompts:
        raise UsageError("no prompt given (use --prompt TEXT or --prompts-file FILE)")
    return prompts


def _validate_generate(args):
    if args.max_new_tokens < 0:
        raise UsageError(f"--max-new-tokens must be >= 0, got {args.max_new_tokens}")
    _sampling_of(args)
    if args.batch_size < 1:
        raise UsageError(f"--batch-size must be >= 1, got {args.batch_size}")
    _validate_method_args(args)


def _validate_method_args(args):
    """Checks of --method and --page-size (generate and serve); the method's own flags are
    checked by its config (`method_config_of`)."""
    args.method = canonical_method(args.method)
    if args.method not in METHODS:
        raise UsageError(f"unknown method '{args.method}' (available: {', '.join(METHODS)})")
    if args.page_size < 1:
        raise UsageError(f"--page-size must be >= 1, got {args.page_size}")


def method_config_of(args):
    """The method config of `specjax generate`'s flags: the options the user gave, the rest
    left to the config's defaults and the heads' recommendations."""
    return method_config(args.method, **given_options(args))


def _parallel_mesh(args):
    """The device mesh of --tp/--dp (None for one device), after joining the multi-host
    runtime when --coordinator is given (before any other JAX use)."""
    if args.tp < 1 or args.dp < 1:
        raise UsageError(f"--tp and --dp must be >= 1, got {args.tp} and {args.dp}")
    multi = (args.coordinator, args.num_processes, args.process_id)
    if any(x is not None for x in multi) and any(x is None for x in multi):
        raise UsageError("multi-host needs all of --coordinator, --num-processes and --process-id")
    from specjax import sharding

    if args.coordinator is not None:
        sharding.init_distributed(args.coordinator, args.num_processes, args.process_id)
    if args.tp * args.dp == 1 and args.coordinator is None:
        return None
    if args.coordinator is not None:
        import jax

        if args.tp * args.dp != jax.device_count():
            raise UsageError(
                f"multi-host: --tp x --dp must span all {jax.device_count()} devices "
                f"of the {args.num_processes} processes, got {args.tp * args.dp}"
            )
    return sharding.make_mesh(args.tp, args.dp)


def cmd_generate(args) -> int:
    _validate_generate(args)
    texts = read_prompts(args)
    config = method_config_of(args)  # options that do not fit fail before any loading
    mesh = _parallel_mesh(args)
    from specjax.generate import Engine, bucket
    from specjax.loading import load_model
    from specjax.methods import make_proposer
    from specjax.spec_decode import scratch_slots

    model = load_model(args.model, mesh=mesh)
    proposer, proposer_params = make_proposer(config, model)
    tok = model.tokenizer
    encoded = [encode_prompt(tok, t, args.raw) for t in texts]
    batches = [list(range(i, min(i + args.batch_size, len(texts)))) for i in range(0, len(texts), args.batch_size)]
    longest = max(len(e) for e in encoded) + args.max_new_tokens + scratch_slots(proposer)
    if args.cache_pages is None:
        per_seq = -(-bucket(longest) // args.page_size)
        pages = 2 * (args.batch_size + args.dp - 1) * per_seq  # batches pad to a multiple of dp
    else:
        pages = args.cache_pages
    engine = Engine(model.params, model.config, num_pages=pages, page_size=args.page_size, mesh=mesh)
    quiet = mesh is not None and _process_index() != 0
    sampling = _sampling_of(args)
    for batch in batches:
        prompts = [encoded[i] for i in batch]
        seeds = [args.seed + i for i in batch]
        kw = dict(
            sampling=sampling,
            seeds=seeds,
            proposer=proposer,
            proposer_params=proposer_params,
            fixed_speculation=args.fixed_speculation,
        )
        if not args.no_warmup:
            engine.generate(prompts, args.max_new_tokens, warmup=True, **kw)
        out = engine.generate(prompts, args.max_new_tokens, **kw)
        for j, i in enumerate(batch):
            ids = out.token_ids[j]
            text = tok.decode(ids, skip_special_tokens=True)
            steps = out.steps[j]
            rec = {
                "prompt": texts[i],
                "text": text,
                "token_ids": ids,
                "new_tokens": len(ids),
                "steps": steps,
                "mean_accepted": len(ids) / steps if steps else 0.0,
                "seconds": out.seconds,
                "tokens_per_s": len(ids) / out.seconds if out.seconds else 0.0,
            }
            if quiet:  # multi-host: the process of the mesh's first device prints
                continue
            if args.json:
                print(json.dumps(rec, ensure_ascii=False), flush=True)
            else:
                print(text, flush=True)
                print(
                    f"[{len(ids)} tokens, {steps} steps, {rec['tokens_per_s']:.1f} tok/s]", file=sys.stderr, flush=True
                )
    return 0


def _process_index() -> int:
    import jax

    return jax.process_index()


def cmd_convert(args) -> int:
    from specjax.convert.hf import convert_checkpoint

    out = convert_checkpoint(args.src, args.out, to=args.to)
    print(f"wrote {out}", file=sys.stderr)
    return 0


def _add_serve(sub):
    p = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (continuous batching, any method)")
    p.add_argument("--model", default="smollm2-135m", help="embedded name, checkpoint dir or .gguf file")
    p.add_argument("--method", default="vanilla", help=f"decoding method ({', '.join(METHODS)}; eagle is eagle1)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--max-batch", type=int, default=8, help="requests decoded together")
    p.add_argument(
        "--max-queue", type=int, default=256, help="requests waiting for a slot before new ones get HTTP 429"
    )
    p.add_argument(
        "--sync-steps", type=int, default=4, help="decoding steps between two looks at the queue and the streams"
    )
    p.add_argument(
        "--prefill-chunk",
        type=int,
        default=256,
        help="prompt tokens a request prefills per round between decoding steps, so "
        "a long prompt does not stall the running ones (0: whole prompts)",
    )
    p.add_argument(
        "--cache-pages",
        type=int,
        default=None,
        help="KV pages in the pool (default: max-batch full contexts of 2048 tokens)",
    )
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--served-model-name", default=None, help="the model's name in the API (default: --model)")
    p.add_argument(
        "--api-key",
        default=None,
        help="answer /v1 requests only with 'Authorization: Bearer KEY' (default: $SPECJAX_API_KEY, else none)",
    )
    p.add_argument(
        "--max-request-bytes", type=int, default=1 << 20, help="larger request bodies get HTTP 413 (default 1 MiB)"
    )
    p.add_argument(
        "--max-input-tokens", type=int, default=None, help="longer prompts get HTTP 400 (default: what fits)"
    )
    p.add_argument(
        "--access-log", action="store_true", help="one line per request on stderr (client, path, status, ms, tokens)"
    )
    p.add_argument(
        "--fixed-speculation",
        action="store_true",
        help="verify the method's whole trees every step (default: as many nodes as "
        "pay for the batch running, measured while serving)",
    )
    p.add_argument(
        "--tp", type=int, default=1, help="tensor parallel: devices each layer is split over (divides KV heads)"
    )
    p.add_argument("--dp", type=int, default=1, help="data parallel: device groups the batch's rows are split over")
    p.add_argument("--debug", action="store_true", help="show tracebacks")
    add_option_flags(p)


def cmd_serve(args) -> int:
    """Load the model and the method, then serve until SIGINT/SIGTERM (in-flight requests
    finish first)."""
    _validate_method_args(args)
    for flag in ("max_batch", "max_queue", "sync_steps"):
        if getattr(args, flag) < 1:
            raise UsageError(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    if args.max_request_bytes < 1 or (args.max_input_tokens is not None and args.max_input_tokens < 1):
        raise UsageError("--max-request-bytes and --max-input-tokens must be >= 1")
    if args.prefill_chunk < 0:
        raise UsageError(f"--prefill-chunk must be >= 0 (0: whole prompts), got {args.prefill_chunk}")
    config = method_config_of(args)
    try:
        import uvicorn

        from specjax.serving.server import create_app
    except ImportError as e:
        raise UsageError(f"specjax serve needs the serve extra (pip install 'specjax[serve]'): {e}") from None
    from specjax.generate import Engine
    from specjax.loading import load_model
    from specjax.methods import make_proposer
    from specjax.serving.scheduler import Scheduler

    args.coordinator = args.num_processes = args.process_id = None  # one host
    mesh = _parallel_mesh(args)
    model = load_model(args.model, mesh=mesh)
    proposer, pparams = make_proposer(config, model)
    context = min(2048, model.config.max_position_embeddings)
    pages = args.cache_pages or args.max_batch * -(-context // args.page_size) + 8
    engine = Engine(model.params, model.config, num_pages=pages, page_size=args.page_size, mesh=mesh)
    scheduler = Scheduler(
        engine,
        proposer,
        pparams,
        max_batch=args.max_batch,
        max_queue=args.max_queue,
        sync_steps=args.sync_steps,
        prefill_chunk=args.prefill_chunk or None,
        budget=not args.fixed_speculation,
    )
    app = create_app(
        scheduler,
        model.tokenizer,
        args.served_model_name or args.model,
        exit_on_failure=True,
        aliases=(args.model,),
        api_key=args.api_key or settings.api_key(),
        max_request_bytes=args.max_request_bytes,
        max_input_tokens=args.max_input_tokens,
        method=args.method,
        access_log=args.access_log,
    )
    if args.access_log:
        import logging

        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(asctime)s %(message)s"))
        access = logging.getLogger("specjax.access")
        access.addHandler(handler)
        access.setLevel(logging.INFO)
    print(
        f"specjax serve: {args.model} ({args.method}) on http://{args.host}:{args.port}/v1", file=sys.stderr, flush=True
    )
    # SIGTERM: stop admitting, wait up to 10 s for running requests, cancel the rest, exit
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning", timeout_graceful_shutdown=10)
    if scheduler.error is not None:
        print("specjax serve: the decoding loop stopped; exiting so that a supervisor restarts it", file=sys.stderr)
        return 1
    return 0


def _add_bench(sub):
    p = sub.add_parser("bench", help="benchmark decoding methods per prompt category (Spec-Bench style)")
    p.add_argument("--model", default="smollm2-135m", help="embedded name, checkpoint dir or .gguf file")
    p.add_argument(
        "--methods",
        default="vanilla,pld,draft",
        help="comma-separated METHOD[:key=value...] (make_proposer options), e.g. "
        "'vanilla,pld:min_matching_ngram_size=2,eagle2:eagle_total_tokens=16'",
    )
    p.add_argument("--prompts", required=True, help="JSONL with 'turns' or 'prompt', and 'category'")
    p.add_argument("--categories", nargs="+", default=None, help="categories to run (default all)")
    p.add_argument("--limit", type=int, default=None, help="prompts per category")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument(
        "--peers", default="", help="'hf': transformers generate (vanilla, prompt lookup, assisted) on the same weights"
    )
    p.add_argument(
        "--heads-dir",
        default=None,
        help="folder with medusa/, eagle/, eagle3/, redrafter/ head checkpoints "
        "(default: the embedded model's shipped heads)",
    )
    p.add_argument("--fixed-speculation", action="store_true", help="verify whole draft trees every step (no budget)")
    p.add_argument(
        "--warm-cache",
        action="store_true",
        help="run methods with a cache of earlier outputs (suffix) a second time, the cache warm",
    )
    _add_sampling_args(p)
    p.add_argument("--out", required=True, help="output folder (re-running it resumes)")
    p.add_argument("--debug", action="store_true", help="show tracebacks")


def cmd_bench(args) -> int:
    from specjax.bench import run_bench

    if args.limit is not None and args.limit < 1:
        raise UsageError(f"--limit must be >= 1, got {args.limit}")
    if args.max_new_tokens < 1:
        raise UsageError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    sampling = _sampling_of(args)
    peers = [p for p in args.peers.split(",") if p]
    result = run_bench(
        args.model,
        [m for m in args.methods.split(",") if m],
        args.prompts,
        args.out,
        categories=args.categories,
        limit=args.limit,
        max_new_tokens=args.max_new_tokens,
        peers=peers,
        heads_dir=args.heads_dir,
        sampling=sampling,
        seed=args.seed,
        warm_cache=args.warm_cache,
        fixed_speculation=args.fixed_speculation,
    )
    from specjax.bench import markdown_table

    print(markdown_table(result["rows"]))
    print(f"wrote {args.out}/results.json, results.md, results.png", file=sys.stderr)
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="specjax", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    _add_generate(sub)
    _add_convert(sub)
    _add_bench(sub)
    _add_serve(sub)
    from specjax.training.command import add_synthesize_parser, add_train_parser, run_synthesize, run_train

    add_train_parser(sub)
    add_synthesize_parser(sub)
    args = parser.parse_args(argv)
    try:
        return {
            "generate": cmd_generate,
            "convert": cmd_convert,
            "bench": cmd_bench,
            "serve": cmd_serve,
            "train": run_train,
            "synthesize-prompts": run_synthesize,
        }[args.command](args)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # one line, no traceback: the CLI contract
        if args.debug or settings.debug():
            raise
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        if isinstance(e, MethodError):
            msg = as_flags(msg)  # options are named as this command's flags
        print(f"specjax: error: {msg}", file=sys.stderr)
        return 1


def command(argv=None) -> int:
    """The `specjax` executable: `main` with JAX's persistent compilation cache on, so that a
    second run loads its compiled programs (`specjax.compile_cache`). Calling `main` in a process
    of your own leaves JAX's configuration alone. transformers' advice that PyTorch is missing is
    silenced: the command never needs torch (tokenizers and GGUF conversion run without it)."""
    from specjax.compile_cache import enable_compile_cache

    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    enable_compile_cache()
    return main(argv)


if __name__ == "__main__":
    sys.exit(command())
