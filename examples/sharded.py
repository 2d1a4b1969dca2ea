"""The same speculative decode on a ("data", "model") device mesh.

`--tp N` splits every layer over N devices, Megatron style (attention heads and MLP columns on
each device, one all-reduce after each row-parallel product, vocabulary-parallel embedding and
head, KV pages split by KV head); `--dp M` splits the batch over M groups of devices. The
Engine does the placement; the decode itself is the same jitted loop as on one device, and its
greedy tokens are the same too (checked below).

No GPUs here? JAX can simulate CPU devices: this script sets
XLA_FLAGS=--xla_force_host_platform_device_count=8 before JAX is imported (it must come first),
unless XLA_FLAGS already asks for a device count. On GPUs the flag only adds host devices, and
the mesh is built over the GPUs.

    python examples/sharded.py [--tp 3] [--dp 2] [--method eagle2] [--max-new-tokens N]
    python examples/sharded.py --smoke      # few tokens (also SPECJAX_EXAMPLES_SMOKE=1)

SmolLM2-135M has 3 KV heads, so --tp is 1 or 3 for it.
"""

from __future__ import annotations

import os

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import argparse

import jax

import specjax
from specjax import Engine, settings
from specjax.methods import make_proposer
from specjax.prompts import encode_prompt
from specjax.sharding import make_mesh

PROMPTS = ["Write a short poem about the sea.", "What is the capital of France?"]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tp", type=int, default=3, help="devices each layer is split over")
    ap.add_argument("--dp", type=int, default=2, help="device groups the batch is split over")
    ap.add_argument("--method", default="eagle2")
    ap.add_argument("--max-new-tokens", type=int, default=None)
    ap.add_argument("--smoke", action="store_true", help="few tokens (CI)")
    args = ap.parse_args()
    smoke = args.smoke or settings.examples_smoke()
    max_new = args.max_new_tokens or (16 if smoke else 64)

    mesh = make_mesh(tp=args.tp, dp=args.dp)  # axes ("data", "model"), dp x tp devices
    print(f"devices={jax.device_count()} mesh={dict(mesh.shape)}")
    model = specjax.load_model("smollm2-135m", mesh=mesh)  # each weight straight into its shards
    q = model.params["layers"][0].get("wq", model.params["layers"][0].get("wqkv"))
    print(f"layer 0 query weight {q.shape}: {q.sharding.spec}, {q.addressable_shards[0].data.shape} per device")
    prompts = [encode_prompt(model.tokenizer, p, raw=False) for p in PROMPTS]
    proposer, params = make_proposer(args.method, model)

    # The sharded engine and, for comparison, the same weights on one device.
    engines = {"mesh": Engine(model.params, model.config, num_pages=64, mesh=mesh)}
    if not smoke:
        one = specjax.load_model("smollm2-135m")
        engines["one_device"] = Engine(one.params, one.config, num_pages=64)
        one_proposer = make_proposer(args.method, one)
    results = {}
    for name, engine in engines.items():
        p, pp = (proposer, params) if name == "mesh" else one_proposer
        engine.generate(prompts, max_new, warmup=True, proposer=p, proposer_params=pp)
        results[name] = out = engine.generate(prompts, max_new, proposer=p, proposer_params=pp)
        rate = sum(out.new_tokens) / out.seconds
        for text, ids, mean in zip(PROMPTS, out.token_ids, out.mean_accepted):
            answer = model.tokenizer.decode(ids, skip_special_tokens=True)
            print(f"[{name}] {text!r} -> {answer!r}")
            print(f"[{name}] mean_accepted={mean:.2f} tokens_per_s={rate:.1f} new_tokens={len(ids)}")
    if "one_device" in results:
        same = results["mesh"].token_ids == results["one_device"].token_ids
        print(f"same_as_one_device={same}")


if __name__ == "__main__":
    main()
