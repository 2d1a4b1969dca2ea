"""Where one speculative step's time goes: propose / verify / accept / commit / update.

    python benchmarks/profile_step.py --method eagle2
    python benchmarks/profile_step.py --method eagle2 --option eagle_total_tokens=8 --top 20
    python benchmarks/profile_step.py --method eagle2 --option acceptance=recursive --temperature 1
    python benchmarks/profile_step.py --method eagle2 --temperature 0.7 --top-k 50 --top-p 0.9

Generates for one dev prompt under `jax.profiler`, with XLA's optimized HLO dumped, and sums the
time of every op of the jitted loop by the `jax.named_scope` of spec_step's phase it belongs to
(ops with no scope, mostly the attention inside the verify pass's branches and the step's own
bookkeeping, count as `other`; vanilla decoding is all `other`). Control-flow ops (conditionals,
loops), whose time holds their bodies', are left out. Op times are summed over threads, so the
total can differ from the wall time per step printed beside it.
"""

from __future__ import annotations

import argparse
import collections
import glob
import json
import os
import re
import shutil
import tempfile

PHASES = ("propose", "verify", "accept", "commit", "update")


def op_scopes(dump_dir: str) -> dict[str, str]:
    """HLO instruction name -> its op_name metadata, from the loops' optimized HLO."""
    scopes = {}
    for path in glob.glob(f"{dump_dir}/*loop*after_optimizations.txt"):
        for line in open(path):
            m = re.match(r"\s*(?:ROOT )?%?([\w.\-]+) = .*?op_name=\"([^\"]*)\"", line)
            if m:
                scopes[m.group(1)] = m.group(2)
    return scopes


def phase_of(op_name: str) -> str:
    for p in PHASES:
        if f"/{p}/" in op_name or op_name.endswith("/" + p):
            return p
    return "other"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--method", default="eagle2")
    ap.add_argument("--option", action="append", default=[], help="make_proposer option KEY=VALUE (repeatable)")
    ap.add_argument("--prompts", default="../shared/data/dev_prompts.jsonl")
    ap.add_argument("--category", default="math")
    ap.add_argument("--nth", type=int, default=0, help="which of the category's prompts")
    ap.add_argument("--batch", type=int, default=1, help="rows: the category's prompts nth, nth + 1, ...")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--top", type=int, default=10, help="also list the N costliest ops")
    ap.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    ap.add_argument("--top-k", type=int, default=0, help="0: off")
    ap.add_argument("--top-p", type=float, default=1.0)
    args = ap.parse_args(argv)

    work = tempfile.mkdtemp(prefix="specjax-profile-")
    dump = os.path.join(work, "hlo")
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + f" --xla_dump_to={dump} --xla_dump_hlo_as_text"
    import jax
    from jax.profiler import ProfileData

    jax.config.update("jax_enable_compilation_cache", False)  # compile here, so the HLO is dumped

    from specjax import Engine, load_model
    from specjax.bench import read_bench_prompts
    from specjax.methods import make_proposer
    from specjax.prompts import encode_prompt

    options = {}
    for item in args.option:
        key, _, value = item.partition("=")
        try:
            options[key] = json.loads(value)
        except json.JSONDecodeError:
            options[key] = value
    model = load_model(args.model)
    prompts = read_bench_prompts(args.prompts, [args.category], args.nth + args.batch)[args.nth :]
    if len(prompts) < args.batch:
        ap.error(f"the {args.category} category has {len(prompts) + args.nth} prompts, fewer than nth + batch")
    ids = [encode_prompt(model.tokenizer, p["text"], False) for p in prompts]
    engine = Engine(model.params, model.config)
    proposer, proposer_params = make_proposer(args.method, model, **options)
    from specjax.sampling import SamplingConfig

    # whole trees every step, in one loop on the device (the budget's segments would mix widths)
    kw = dict(proposer=proposer, proposer_params=proposer_params, fixed_speculation=True) if proposer else {}
    kw["sampling"] = SamplingConfig(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)
    engine.generate(ids, args.max_new_tokens, warmup=True, **kw)  # compiles (and dumps HLO)
    trace = os.path.join(work, "trace")
    jax.profiler.start_trace(trace)
    out = engine.generate(ids, args.max_new_tokens, **kw)
    jax.profiler.stop_trace()
    steps = max(out.steps)  # the batch's passes

    scopes = op_scopes(dump)
    per_phase, per_op, counts = collections.Counter(), collections.Counter(), collections.Counter()
    profile = ProfileData.from_file(glob.glob(f"{trace}/**/*.xplane.pb", recursive=True)[0])
    for plane in profile.planes:
        for line in plane.lines:
            for event in line.events:
                stats = dict(event.stats)
                op, module = stats.get("hlo_op"), stats.get("hlo_module", "")
                if op is None or not ("spec_loop" in module or "decode_loop" in module):
                    continue
                if re.match(r"(cond|while|call|conditional)[.\d]*$", op):
                    continue
                phase = phase_of(scopes.get(op, ""))
                per_phase[phase] += event.duration_ns
                counts[phase] += 1
                per_op[(phase, op)] += event.duration_ns
    shutil.rmtree(work, ignore_errors=True)
    total = sum(per_phase.values())
    label = " ".join([args.method, *args.option])
    print(
        f"{label}: {steps} steps for {sum(map(len, out.token_ids))} tokens over {len(ids)} rows "
        f"({out.seconds / steps * 1e3:.2f} ms per step wall, profiler on)"
    )
    for phase, ns in per_phase.most_common():
        print(f"  {phase:8s} {ns / steps / 1e6:7.2f} ms/step  {ns / total:6.1%}  {counts[phase] / steps:.0f} ops/step")
    print(f"  {'total':8s} {total / steps / 1e6:7.2f} ms/step")
    for (phase, op), ns in per_op.most_common(args.top):
        print(f"    {ns / steps / 1e6:7.3f} ms  {phase:8s} {op}")


if __name__ == "__main__":
    main()
