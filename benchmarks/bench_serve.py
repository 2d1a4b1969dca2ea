"""`specjax serve` under load: dev prompts at fixed concurrency, methods side by side.

For each method the script starts a server in this process (the scheduler and the HTTP API of
`specjax serve`, on a free local port), warms it up, then sends `--requests` streamed chat
requests per concurrency level from that many client threads (greedy, up to --max-tokens new
tokens), like genai-perf's fixed-concurrency runs. All methods' servers run at once and take
turns: each level runs its prompts untimed on each until a pass compiles (almost) nothing, at
most `--warm-passes` times (the batch and prefill shapes a pass meets depend on when requests
arrive and finish, so one pass does not meet them all), then
`--repeat` rounds of one timed pass per method, method after method, so a slow spell of the
machine falls on all of them; the fastest pass is reported (a shape first met in a timed pass
compiles there), each with the prefix cache and suffix decoding's
global cache emptied first (`@warm` keeps the global cache: the same requests come back).
Each row also lists every timed pass's wall, the seconds JAX spent compiling in it (a pass that
compiled is slow for that reason), and per round the first method's wall over this method's.
Per level: time to first token, inter-token latency (per request: (last - first token time) /
(tokens - 1)), the longest wait between two streamed chunks of any request (what a long
prompt's prefill costs the running ones), output tokens per second (all answers' tokens over
the level's wall time) and mean accepted tokens per target pass
(from the responses' `usage`). Every answer is checked against the first method's (greedy:
the same text). `@sampled` and `@mixed` runs sample (one setting for all, or four settings
side by side in one batch; a seed per request).

    python benchmarks/bench_serve.py --prompts ../shared/data/dev_prompts.jsonl \
        --methods vanilla,pld,eagle2 --concurrency 1,4,16 --out benchmarks/results/serve_intel
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import statistics
import threading
import time
from pathlib import Path

from common import machine, read_prompts

# Sampling settings by request (@sampled: all the first; @mixed: request i takes MIXED[i % 4]).
SAMPLED = {"temperature": 0.8, "top_p": 0.95}
MIXED = (
    {"temperature": 0},
    {"temperature": 0.7, "extra_body": {"top_k": 50}},
    {"temperature": 1.0, "top_p": 0.9},
    {"temperature": 0.8, "top_p": 0.95},
)


def settings_of(suffixes, i: int) -> dict:
    """The sampling fields of request i (greedy unless @sampled or @mixed), with a seed of its own."""
    if "mixed" in suffixes:
        return {**MIXED[i % len(MIXED)], "seed": i}
    if "sampled" in suffixes:
        return {**SAMPLED, "seed": i}
    return {"temperature": 0}


COMPILE_S = [0.0]  # seconds JAX has spent tracing, lowering and compiling in this process


def _count_compiles():
    import jax.monitoring

    def seen(name, secs, **_):
        if name.startswith("/jax/core/compile/"):
            COMPILE_S[0] += secs

    jax.monitoring.register_event_duration_secs_listener(seen)


def timed_level(*args, **kwargs):
    """`run_level`, and the seconds JAX spent compiling during it."""
    before = COMPILE_S[0]
    records, wall = run_level(*args, **kwargs)
    return records, wall, COMPILE_S[0] - before


def run_level(url, prompts, concurrency, max_tokens, settings=lambda i: {"temperature": 0}):
    """Stream every prompt through the server, `concurrency` at a time: per-request records.
    settings(i): request i's sampling fields."""
    import openai

    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=600)
    todo = list(enumerate(prompts))
    lock = threading.Lock()
    records = {}

    def worker():
        while True:
            with lock:
                if not todo:
                    return
                i, text = todo.pop(0)
            t0 = time.perf_counter()
            stamps, pieces, usage = [], [], None
            for chunk in client.chat.completions.create(
                model="m",
                messages=[{"role": "user", "content": text}],
                max_tokens=max_tokens,
                **settings(i),
                stream=True,
            ):
                if chunk.choices and chunk.choices[0].delta.content:
                    stamps.append(time.perf_counter())
                    pieces.append(chunk.choices[0].delta.content)
                if chunk.usage is not None:
                    usage = chunk.usage
            n = usage.completion_tokens
            records[i] = {
                "text": "".join(pieces),
                "tokens": n,
                "steps": usage.model_extra["steps"],
                "ttft": stamps[0] - t0 if stamps else None,
                "itl": (stamps[-1] - stamps[0]) / (n - 1) if len(stamps) > 1 and n > 1 else None,
                "stall": max((b - a for a, b in zip(stamps, stamps[1:])), default=None),
            }

    t = time.perf_counter()
    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    wall = time.perf_counter() - t
    return [records[i] for i in range(len(prompts))], wall


def new_setting_probe(url, prompt: str, max_tokens: int) -> dict:
    """Seconds of a warm sampled request, then of three requests at settings never seen before
    (each alone): a new setting that compiled would take seconds more than the warm one."""
    import openai

    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=600)

    def ask(**settings):
        t0 = time.perf_counter()
        client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens, seed=1, **settings
        )
        return round(time.perf_counter() - t0, 3)

    ask(temperature=0.5)  # this shape's programs compiled
    warm = ask(temperature=0.5)
    new = [ask(temperature=0.731), ask(temperature=0.732, top_p=0.9), ask(temperature=1.37, extra_body={"top_k": 7})]
    return {"warm_s": warm, "new_settings_s": new, "worst_vs_warm": round(max(new) / warm, 2)}


def _ms(values, stat, digits):
    """`stat` of `values` in ms; None when there are none (every answer in one streamed chunk
    has no inter-token gap)."""
    return round(1000 * stat(values), digits) if values else None


def summarize(records, wall):
    ttft = [r["ttft"] for r in records if r["ttft"] is not None]
    itl = [r["itl"] for r in records if r["itl"] is not None]
    tokens = sum(r["tokens"] for r in records)
    return {
        "requests": len(records),
        "output_tokens": tokens,
        "seconds": round(wall, 2),
        "output_tokens_per_s": round(tokens / wall, 2),
        "ttft_ms_mean": _ms(ttft, statistics.mean, 1),
        "ttft_ms_p50": _ms(ttft, statistics.median, 1),
        "itl_ms_mean": _ms(itl, statistics.mean, 2),
        "stall_ms_max": round(1000 * max(r["stall"] or 0 for r in records), 1),
        "tokens_per_step": round(tokens / sum(r["steps"] for r in records), 3),
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--prompts", default="../shared/data/dev_prompts.jsonl")
    ap.add_argument(
        "--methods",
        default="vanilla,pld,eagle2,eagle2@fixed",
        help="comma-separated METHOD[:key=value...] (make_proposer options); "
        "@fixed: verify whole trees (specjax serve --fixed-speculation); "
        "@whole: prefill whole prompts (--prefill-chunk 0); "
        "@warm: keep suffix decoding's global cache from the untimed pass (the same requests "
        "come back; otherwise the timed pass starts with it empty); "
        "@sampled: every request samples at one setting (T 0.8, top-p 0.95); "
        "@mixed: requests cycle through greedy and three sampling settings",
    )
    ap.add_argument("--concurrency", default="1,4,16")
    ap.add_argument("--requests", type=int, default=16, help="requests per level (at least the level's concurrency)")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--max-batch", type=int, default=16)
    ap.add_argument("--prefill-chunk", type=int, default=256, help="prompt tokens per row per round (0: whole prompts)")
    ap.add_argument("--out", default="benchmarks/results/serve")
    ap.add_argument("--probe-new-settings", action="store_true", help="also time requests at never-seen settings")
    ap.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="timed passes per level (the fastest is reported)",
    )
    ap.add_argument(
        "--warm-passes",
        type=int,
        default=3,
        help="untimed passes per method and level, at most: they stop once one compiled < 0.5 s",
    )
    args = ap.parse_args()

    from tqdm import tqdm

    from specjax import Engine, load_model
    from specjax.bench import MethodSpec
    from specjax.compile_cache import enable_compile_cache
    from specjax.methods import make_proposer
    from specjax.proposers.suffix_cache import caches_of
    from specjax.serving.scheduler import Scheduler
    from specjax.serving.server import create_app, running_in_thread

    enable_compile_cache()
    _count_compiles()
    model = load_model(args.model)
    levels = [int(c) for c in args.concurrency.split(",")]
    n = max(args.requests, max(levels))
    prompts = read_prompts(Path(args.prompts), n)
    pages = args.max_batch * -(-(1024 + args.max_tokens + 64) // 16) + 8
    rows, probes, reference = [], [], None
    with contextlib.ExitStack() as servers:
        running = []  # (label, @-switches, scheduler, url): all up at once, so passes interleave
        for text in tqdm(args.methods.split(","), desc="servers"):
            name, *suffixes = text.split("@")
            spec = MethodSpec.parse(name)
            proposer, pparams = make_proposer(spec.method, model, **dict(spec.options))
            engine = Engine(model.params, model.config, num_pages=pages, page_size=16)
            sched = Scheduler(
                engine,
                proposer,
                pparams,
                max_batch=args.max_batch,
                prefill_chunk=None if "whole" in suffixes else args.prefill_chunk or None,
                budget="fixed" not in suffixes,
            )
            url = servers.enter_context(running_in_thread(create_app(sched, model.tokenizer, "m")))
            running.append((text, suffixes, sched, url))
        for c in tqdm(levels, desc="levels"):
            passes = {text: [] for text, *_ in running}

            def fresh_pass(suffixes, sched, url):
                sched.engine.allocator.forget_prefixes()  # (idle now) the pass prefills in full
                if "warm" not in suffixes:  # nor does it find its own answers in suffix caches
                    for cache in caches_of(sched.proposer_params):
                        cache.reset()
                return timed_level(url, prompts, c, args.max_tokens, functools.partial(settings_of, suffixes))

            for _, suffixes, sched, url in running:  # compiles what the level's passes meet
                for _ in range(args.warm_passes):  # which shapes a pass meets depends on timing
                    if fresh_pass(suffixes, sched, url)[2] < 0.5:
                        break
            for _ in range(args.repeat):  # method after method, so a slow spell hits them all
                for text, suffixes, sched, url in running:
                    passes[text].append(fresh_pass(suffixes, sched, url))
            first = passes[running[0][0]]
            for text, *_ in running:
                records, wall, _ = min(passes[text], key=lambda p: p[1])
                texts = [r["text"] for r in records]
                if reference is None:
                    reference = texts
                row = {
                    "method": text,
                    "concurrency": c,
                    **summarize(records, wall),
                    "same_as_first_method": sum(a == b for a, b in zip(texts, reference)),
                    "walls_s": [round(w, 2) for _, w, _ in passes[text]],
                    "compile_s": [round(x, 2) for _, _, x in passes[text]],
                    "vs_first_by_round": [round(f[1] / w, 3) for f, (_, w, _) in zip(first, passes[text])],
                }
                rows.append(row)
                print(json.dumps(row), flush=True)
        if args.probe_new_settings:
            for text, _, _, url in running:
                probe = {"method": text, **new_setting_probe(url, prompts[0], args.max_tokens)}
                probes.append(probe)
                print(json.dumps(probe), flush=True)
    base = {r["concurrency"]: r["output_tokens_per_s"] for r in rows if r["method"] == rows[0]["method"]}
    for r in rows:
        r["throughput_vs_first"] = round(r["output_tokens_per_s"] / base[r["concurrency"]], 3)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {
        "machine": machine(),
        "model": args.model,
        "requests_per_level": n,
        "max_tokens": args.max_tokens,
        "max_batch": args.max_batch,
        "prefill_chunk": args.prefill_chunk,
        "timed_passes": args.repeat,
        "date": time.strftime("%Y-%m-%d"),
    }
    out.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows, "new_settings": probes}, indent=1))
    head = (
        "| method | concurrency | output tok/s | vs first | TTFT mean / p50 ms | ITL ms | "
        "longest stall ms | tokens per step | same text | vs first by round | compile s by pass |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|\n"
    )
    body = "".join(
        f"| {r['method']} | {r['concurrency']} | {r['output_tokens_per_s']} | "
        f"{r['throughput_vs_first']:.2f}x | {r['ttft_ms_mean']} / {r['ttft_ms_p50']} | "
        f"{r['itl_ms_mean']} | {r['stall_ms_max']} | {r['tokens_per_step']} | "
        f"{r['same_as_first_method']}/{r['requests']} | "
        f"{', '.join(f'{x:.2f}' for x in r['vs_first_by_round'])} | {', '.join(map(str, r['compile_s']))} |\n"
        for r in rows
    )
    out.with_suffix(".md").write_text(f"{meta}\n\n{head}{body}")
    plot(rows, out.with_suffix(".png"), meta)
    print(head + body)


def plot(rows, path, meta):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for method in dict.fromkeys(r["method"] for r in rows):
        mine = [r for r in rows if r["method"] == method]
        xs = [r["concurrency"] for r in mine]
        axes[0].plot(xs, [r["output_tokens_per_s"] for r in mine], marker="o", label=method)
        axes[1].plot(xs, [r["itl_ms_mean"] for r in mine], marker="o", label=method)
    for ax, title in zip(axes, ("output tokens/s", "inter-token latency (ms)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent requests")
        ax.set_title(title)
        ax.legend()
    fig.suptitle(f"specjax serve, {meta['model']}, {meta['machine']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
