"""Spec-Bench-style benchmark: every decoding method on a prompt file, per category, peers alongside.

For each method and category: mean accepted tokens per target pass, tokens/s, speedup over our
vanilla decoding in the same run, and whether the greedy output equalled vanilla's for every
prompt. Peers (transformers `generate`: vanilla, prompt lookup, assisted generation with the same
self-draft as ours) run on the same weights and prompts, so the table also gives
specjax/transformers ratios. Each prompt is timed after a warm-up call of the same shapes (compile
excluded), batch 1, greedy (or sampling, every method and peer with the same settings and
seeds), stopping at EOS or max_new_tokens.

Per-prompt records are appended to `records.jsonl` in the output folder as they finish; an
interrupted run started again with the same folder and settings skips what is there: each record
names its prompt by a hash of the text, so a record whose (category, index) now holds another
prompt (another `--limit` spreads the picks differently) is run again, never reused (records
written before records carried the hash run again too).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import time
from pathlib import Path

from specjax.prompts import PromptError, encode_prompt, read_prompt_file

PEERS = ("hf-vanilla", "hf-pld", "hf-assisted")
# Compiled programs are dropped between prompts once the process holds this share of the
# kernel's memory-mapping limit (`mapping_share`), leaving room for one prompt's compiles
# (in the every-method run of docs/benchmarks.md one prompt's 17 methods added ~10-11k of
# the usual 65530).
KEEP_MAPPING_SHARE = 0.4


class BenchError(ValueError):
    """Bad benchmark settings or prompt file."""


@dataclasses.dataclass(frozen=True)
class MethodSpec:
    """One benchmarked configuration: `METHOD[:key=value[:key=value]][@fixed]`, e.g.
    `eagle2:eagle_total_tokens=16:eagle_depth=3` (keys are `make_proposer` keywords); `@fixed`
    verifies whole trees every step (no speculation budget), beside the same method with it."""

    label: str
    method: str
    options: tuple = ()
    fixed: bool = False

    @classmethod
    def parse(cls, text: str) -> "MethodSpec":
        from specjax.method_configs import METHODS, canonical_method

        body, fixed = text.strip(), text.strip().endswith("@fixed")
        body = body.removesuffix("@fixed")
        method, *pairs = body.split(":")
        method = canonical_method(method)
        if method not in METHODS:
            raise BenchError(f"unknown method '{method}' (available: {', '.join(METHODS)})")
        options = []
        for pair in pairs:
            key, sep, value = pair.partition("=")
            if not sep or not key:
                raise BenchError(f"method option '{pair}' in '{text}' is not key=value")
            try:
                options.append((key, json.loads(value)))
            except json.JSONDecodeError:
                options.append((key, value))
        return cls(text.strip(), method, tuple(options), fixed)


def read_bench_prompts(path, categories=None, limit=None) -> list[dict]:
    """[{category, index, text}] from a prompt file (`specjax.prompts`; records without a
    `category` are "all"), at most `limit` per category, spread over the file."""
    try:
        records = read_prompt_file(path, default_category="all")
    except PromptError as e:
        raise BenchError(str(e)) from None
    by_cat: dict[str, list[str]] = {}
    for rec in records:
        by_cat.setdefault(rec.category, []).append(rec.text)
    cats = list(categories) if categories else list(by_cat)
    missing = [c for c in cats if c not in by_cat]
    if missing:
        raise BenchError(f"no prompts of category {missing[0]} in {path} (has {', '.join(by_cat)})")
    out = []
    for c in cats:
        texts = by_cat[c]
        step = max(1, len(texts) // limit) if limit else 1
        picked = texts[::step][:limit] if limit else texts
        out += [{"category": c, "index": i, "text": t} for i, t in enumerate(picked)]
    return out


def resident_gib() -> float:
    """This process's resident memory in GiB (Linux's /proc; infinity where it cannot be read,
    so callers that free memory above a limit always do)."""
    try:
        with open("/proc/self/statm") as f:
            pages = int(f.read().split()[1])
    except (OSError, ValueError, IndexError):
        return float("inf")
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**30


def mapping_share() -> float:
    """This process's memory mappings as a share of the kernel's limit (vm.max_map_count); 0
    where either cannot be read. Each compiled XLA:CPU program holds mappings of its own, and
    at the limit LLVM cannot map the next one ("Unable to allocate section memory") whatever
    memory is free."""
    try:
        limit = int(Path("/proc/sys/vm/max_map_count").read_text())
        with open("/proc/self/maps") as f:
            used = sum(1 for _ in f)
    except (OSError, ValueError):
        return 0.0
    return used / max(limit, 1)


def machine() -> str:
    """The CPU model and core count, for result tables."""
    import platform

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{cpu}, {os.cpu_count()} cores"


def _load_records(path: Path) -> dict:
    done = {}
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                r = json.loads(line)
            except json.JSONDecodeError:  # a line cut by an interruption
                continue
            done[(r["category"], r["index"], r["method"])] = r
    return done


def _hf_models(model, draft_layers: int, max_draft_len: int):
    import copy

    import torch
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(model.path), dtype=torch.float32).eval()
    draft = copy.deepcopy(hf)  # the same self-draft as ours: the first layers, norm and head
    draft.model.layers = torch.nn.ModuleList(list(draft.model.layers)[:draft_layers])
    draft.config.num_hidden_layers = draft_layers
    draft.generation_config.num_assistant_tokens = max_draft_len
    draft.generation_config.num_assistant_tokens_schedule = "constant"
    return hf, draft


def run_bench(
    model_name: str,
    methods: list[str],
    prompts_file,
    out_dir,
    *,
    categories=None,
    limit: int | None = None,
    max_new_tokens: int = 128,
    peers=(),
    heads_dir=None,
    page_size: int = 16,
    progress: bool = True,
    sampling=None,
    seed: int = 0,
    keep_programs_gib: float = 8.0,
    warm_cache: bool = False,
    fixed_speculation: bool = False,
) -> dict:
    """Run the benchmark; writes records.jsonl, results.json, results.md and results.png in
    out_dir and returns the results dict. sampling: a SamplingConfig (default greedy); every
    method and peer samples with it, prompt i with seed + i. Compiled programs are kept across
    prompts (prompts of the same length bucket reuse them) until the process holds more than
    keep_programs_gib of memory or KEEP_MAPPING_SHARE of its memory-mapping limit.

    A method with a cache of earlier outputs (suffix decoding) starts the run with it empty and
    fills it prompt by prompt, as a server started cold would. warm_cache=True runs such methods
    a second time over the whole workload, as "LABEL (warm)", their caches holding the first
    pass's outputs (replayed from the records, so a resumed run is warm too).
    fixed_speculation: verify whole trees every step (`Engine.generate`'s; default: the budget
    chooses the width, its measurements kept across the run's prompts)."""
    import jax
    from tqdm import tqdm

    from specjax import Engine, SamplingConfig, load_model
    from specjax.methods import HEAD_KINDS, make_proposer
    from specjax.proposers.suffix_cache import caches_of

    sampling = sampling or SamplingConfig()

    specs = [MethodSpec.parse(m) for m in methods]
    if not specs or specs[0].method != "vanilla" or specs[0].options:
        specs = [MethodSpec.parse("vanilla")] + [s for s in specs if s.label != "vanilla"]
    unknown = [p for p in peers if p != "hf"]
    if unknown:
        raise BenchError(f"unknown peer '{unknown[0]}' (available: hf)")
    prompts = read_bench_prompts(prompts_file, categories, limit)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    _check_settings(
        out_dir,
        {
            "model": model_name,
            "max_new_tokens": max_new_tokens,
            "sampling": sampling.settings(),
            "seed": seed,
            "fixed_speculation": fixed_speculation,
        },
    )
    model = load_model(model_name)
    proposers = {}
    for s in specs:
        opts = dict(s.options)
        if s.method in HEAD_KINDS and "heads" not in opts and heads_dir is not None:
            opts["heads"] = str(Path(heads_dir) / HEAD_KINDS[s.method])
        proposers[s.label] = make_proposer(s.method, model, **opts)
    encoded = [encode_prompt(model.tokenizer, p["text"], raw=False) for p in prompts]
    longest = max(len(e) for e in encoded) + max_new_tokens + 128
    engine = Engine(model.params, model.config, page_size=page_size, num_pages=2 * (-(-longest // page_size)) + 8)
    records_path = out_dir / "records.jsonl"
    done = _load_records(records_path)
    hf = hf_draft = None
    draft_spec = next((s for s in specs if s.method == "draft"), None)
    draft_opts = dict(draft_spec.options) if draft_spec else {}
    cached = {s.label: caches_of(proposers[s.label][1]) for s in specs}
    fixed_labels = {s.label: s.fixed for s in specs}
    warm = {f"{label} (warm)": label for label, c in cached.items() if c and warm_cache}
    labels = [s.label for s in specs] + (list(PEERS) if peers else [])

    def missing(order):
        return [
            (n, p, e, m)
            for n, (p, e) in enumerate(zip(prompts, encoded))
            for m in order
            if done.get((p["category"], p["index"], m), {}).get("prompt_sha") != prompt_sha(p)
        ]

    todo = missing(labels) + missing(list(warm))
    replayed = set()
    with records_path.open("a") as log:
        last = None
        for n, p, prompt, label in tqdm(todo, desc="bench", disable=not progress):
            if (
                n != last
                and last is not None
                and (resident_gib() > keep_programs_gib or mapping_share() > KEEP_MAPPING_SHARE)
            ):
                # every method's programs for every shape seen would stay in memory (past the
                # box's 24 GiB, or its mapping limit, over a long run); a warmup recompiles or
                # reloads those it needs
                jax.clear_caches()
            last = n
            if label in PEERS:
                if hf is None:
                    hf, hf_draft = _hf_models(
                        model, draft_opts.get("draft_layers", 8), draft_opts.get("max_draft_len", 4)
                    )
                rec = _run_hf(
                    hf,
                    hf_draft,
                    label,
                    prompt,
                    max_new_tokens,
                    draft_opts.get("prompt_lookup_num_tokens", 10),
                    sampling,
                    seed + n,
                )
            else:
                proposer, pparams = proposers[warm.get(label, label)]
                if label in warm and label not in replayed:  # the cold pass's outputs, in its order
                    replayed.add(label)
                    for cache in cached[warm[label]]:
                        cache.reset()
                        for q in prompts:
                            cache.add(done[(q["category"], q["index"], warm[label])]["token_ids"])
                kw = dict(
                    proposer=proposer,
                    proposer_params=pparams,
                    sampling=sampling,
                    seeds=[seed + n],
                    fixed_speculation=fixed_speculation or fixed_labels.get(warm.get(label, label), False),
                )
                # every method prefills the whole prompt, as a first request does: none reuses
                # the pages an earlier run published (the chat template's opening included), and
                # the warmup compiles the very shapes the timed run uses
                engine.allocator.forget_prefixes()
                engine.generate([prompt], max_new_tokens, warmup=True, **kw)
                out = engine.generate([prompt], max_new_tokens, **kw)
                rec = {
                    "tokens": len(out.token_ids[0]),
                    "seconds": out.seconds,
                    "prefill_seconds": out.prefill_seconds,
                    "steps": out.steps[0],
                    "token_ids": out.token_ids[0],
                }
            rec.update(category=p["category"], index=p["index"], method=label, prompt_sha=prompt_sha(p))
            done[(p["category"], p["index"], label)] = rec
            log.write(json.dumps(rec) + "\n")
            log.flush()
    rows = summarize(done, [p for p in prompts], labels + list(warm), compare_outputs=sampling.greedy)
    result = {
        "machine": machine(),
        "model": model_name,
        "max_new_tokens": max_new_tokens,
        "batch": 1,
        "prompts_file": str(prompts_file),
        "sampling": sampling.settings(),
        "seed": seed,
        "rows": rows,
    }
    write_results(result, out_dir)
    return result


def prompt_sha(prompt: dict) -> str:
    """What a record calls its prompt: the first 16 hex digits of the text's SHA-256."""
    return hashlib.sha256(prompt["text"].encode()).hexdigest()[:16]


def _check_settings(out_dir: Path, settings: dict) -> None:
    """Records in out_dir resume only a run with the same settings (settings.json)."""
    path = out_dir / "settings.json"
    if path.exists():
        old = json.loads(path.read_text())
        if old != settings:
            changed = ", ".join(f"{k} {old.get(k)} -> {v}" for k, v in settings.items() if old.get(k) != v)
            raise BenchError(f"{out_dir} holds a run with other settings ({changed}); use another --out")
    path.write_text(json.dumps(settings) + "\n")


def _run_hf(hf, hf_draft, label, prompt, max_new_tokens, pld_tokens, sampling, seed) -> dict:
    import torch

    if sampling.greedy:
        how = {"do_sample": False}
    else:
        torch.manual_seed(seed)
        how = {
            "do_sample": True,
            "temperature": sampling.temperature,
            "top_k": sampling.top_k,
            "top_p": sampling.top_p,
        }  # top_k 0: off

    extra = {
        "hf-vanilla": {},
        "hf-pld": {"prompt_lookup_num_tokens": pld_tokens},
        "hf-assisted": {"assistant_model": hf_draft},
    }[label]
    ids = torch.tensor([prompt])
    with torch.no_grad():
        t = time.perf_counter()
        res = hf.generate(ids, max_new_tokens=max_new_tokens, **how, **extra)
        seconds = time.perf_counter() - t
    return {
        "tokens": int(res.shape[1] - ids.shape[1]),
        "seconds": seconds,
        "steps": None,
        "token_ids": res[0, ids.shape[1] :].tolist(),
    }


def summarize(records: dict, prompts: list[dict], labels: list[str], compare_outputs: bool = True) -> list[dict]:
    """One row per (category, method): sums over the category's prompts. compare_outputs:
    count the prompts whose output equals vanilla's (greedy runs; sampled runs differ)."""
    rows = []
    for cat in dict.fromkeys(p["category"] for p in prompts):
        idx = [p["index"] for p in prompts if p["category"] == cat]
        base = {}
        for label in labels:
            recs = [records[(cat, i, label)] for i in idx if (cat, i, label) in records]
            if not recs:
                continue
            tokens = sum(r["tokens"] for r in recs)
            seconds = sum(r["seconds"] for r in recs)
            tps = tokens / seconds if seconds else 0.0
            peer = label.startswith("hf-")
            # decoding alone: every new token comes from a decode step, after a prefill of the
            # prompt that all methods share (records of older runs hold no prefill time)
            decode_s = (
                None
                if peer or any("prefill_seconds" not in r for r in recs)
                else sum(r["seconds"] - r["prefill_seconds"] for r in recs)
            )
            decode_tps = tokens / decode_s if decode_s else None
            if label in ("vanilla", "hf-vanilla"):
                base["hf" if peer else "ours"] = tps
                if not peer:
                    base["decode"] = decode_tps
            vanilla = [records.get((cat, r["index"], "vanilla")) for r in recs]
            steps = None if peer else sum(r["steps"] for r in recs)
            same = sum(v is not None and v["token_ids"] == r["token_ids"] for v, r in zip(vanilla, recs))
            rows.append(
                {
                    "category": cat,
                    "method": label,
                    "library": "transformers" if peer else "specjax",
                    "prompts": len(recs),
                    "new_tokens": tokens,
                    "mean_accepted": round(tokens / steps, 3) if steps else None,
                    "tokens_per_s": round(tps, 2),
                    "speedup_vs_vanilla": round(tps / base["ours"], 3) if base.get("ours") else None,
                    "speedup_vs_own_vanilla": round(tps / base["hf" if peer else "ours"], 3)
                    if base.get("hf" if peer else "ours")
                    else None,
                    "decode_tokens_per_s": None if decode_tps is None else round(decode_tps, 2),
                    "decode_speedup_vs_vanilla": round(decode_tps / base["decode"], 3)
                    if decode_tps and base.get("decode")
                    else None,
                    "greedy_equals_vanilla": None if peer or not compare_outputs else f"{same}/{len(recs)}",
                }
            )
    return rows


def markdown_table(rows: list[dict]) -> str:
    lines = [
        "| category | method | mean accepted | tokens/s | speedup vs specjax vanilla | "
        "speedup vs own vanilla | decode speedup vs specjax vanilla | greedy = vanilla |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        name = r["method"] if r["library"] == "specjax" else f"transformers {r['method'][3:]}"
        fmt = lambda x: "-" if x is None else f"{x:.2f}x"
        lines.append(
            f"| {r['category']} | {name} | {r['mean_accepted'] or '-'} | "
            f"{r['tokens_per_s']} | {fmt(r['speedup_vs_vanilla'])} | "
            f"{fmt(r['speedup_vs_own_vanilla'])} | "
            f"{fmt(r.get('decode_speedup_vs_vanilla'))} | "
            f"{r['greedy_equals_vanilla'] or '-'} |"
        )
    return "\n".join(lines)


def write_results(result: dict, out_dir: Path) -> None:
    """results.json, results.md (the table) and results.png (speedup per method and category)."""
    out_dir = Path(out_dir)
    (out_dir / "results.json").write_text(json.dumps(result, indent=2) + "\n")
    table = markdown_table(result["rows"])
    (out_dir / "results.md").write_text(
        f"{result['model']}, batch 1, up to {result['max_new_tokens']} new tokens, "
        f"{decoding_of(result)}, {result['machine']}\n\n{table}\n\n"
        "Decode speedup: new tokens per second of decoding alone (the time after the prompt's "
        "prefill, which every method runs alike), over vanilla's.\n"
    )
    plot_speedup(result, out_dir / "results.png")


def decoding_of(result: dict) -> str:
    """'greedy' or the sampling settings of a results dict."""
    s = result.get("sampling") or {"temperature": 0.0}
    if s["temperature"] == 0:
        return "greedy"
    return (
        f"sampling at temperature {s['temperature']}, top-k {s['top_k'] or 'off'}, "
        f"top-p {s['top_p']}, seed {result.get('seed', 0)} + prompt number"
    )


def _wrapped(label: str, width: int = 110) -> str:
    """A method label cut into lines of at most `width` characters at its ':' separators."""
    lines = [""]
    for part in label.split(":"):
        piece = part if not lines[-1] else ":" + part
        if lines[-1] and len(lines[-1]) + len(piece) > width:
            lines.append(piece)
        else:
            lines[-1] += piece
    return "\n".join(lines)


def plot_speedup(result: dict, out: Path) -> Path:
    """Bars of the speedup per category and method; a second panel for decoding alone (after
    the prompt's prefill) when the records hold it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in result["rows"] if r["method"] not in ("vanilla", "hf-vanilla")]
    cats = list(dict.fromkeys(r["category"] for r in result["rows"]))
    methods = list(dict.fromkeys(r["method"] for r in rows))
    panels = [("speedup_vs_own_vanilla", "speedup vs own vanilla (whole request)")]
    if any(r.get("decode_speedup_vs_vanilla") for r in rows):
        panels.append(("decode_speedup_vs_vanilla", "decode speedup vs vanilla (after prefill)"))
    width_in = max(6, 1.8 * len(cats) + 0.6 * len(methods))
    fig, axes = plt.subplots(len(panels), 1, figsize=(width_in, 4.2 * len(panels)), squeeze=False)
    width = 0.8 / max(1, len(methods))
    colors = plt.get_cmap("tab20").colors  # one color per method (up to 20)
    for ax, (key, ylabel) in zip(axes[:, 0], panels):
        for m, method in enumerate(methods):
            vals = [
                next((r.get(key) or 0 for r in rows if r["category"] == c and r["method"] == method), 0) for c in cats
            ]
            xs = [i + (m - (len(methods) - 1) / 2) * width for i in range(len(cats))]
            bars = ax.bar(xs, vals, width, label=method, color=colors[m % len(colors)])
            ax.bar_label(bars, fmt="%.2f", fontsize=6)
        ax.axhline(1.0, color="gray", lw=0.8, ls="--")
        ax.set_xticks(range(len(cats)), cats)
        ax.set_ylabel(ylabel, fontsize=8)
    axes[0, 0].set_title(
        f"{result['model']}, batch 1, up to {result['max_new_tokens']} tokens, "
        f"{decoding_of(result)}, {result['machine']}",
        fontsize=7,
    )
    fig.tight_layout()
    if methods:  # below the panels, so long method labels leave the bars their width
        handles, labels = axes[0, 0].get_legend_handles_labels()
        axes[-1, 0].legend(
            handles,
            [_wrapped(label) for label in labels],
            fontsize=6,
            loc="upper center",
            bbox_to_anchor=(0.5, -0.1),
            frameon=False,
        )
    fig.savefig(out, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return out
