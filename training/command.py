"""`specjax train` and `specjax synthesize-prompts`: their parsers and runs (self-distill,
extract features, train, evaluate; prompts the base model writes itself)."""

from __future__ import annotations

import argparse
import sys


def add_train_parser(subparsers) -> argparse.ArgumentParser:
    """Register the `train` sub-command on an argparse subparsers object."""
    from specjax.training.losses import TOKEN_LOSSES
    from specjax.training.trainers import METHODS

    p = subparsers.add_parser(
        "train",
        help="train draft heads (Medusa, EAGLE, EAGLE-3, ReDrafter, DFlash) for a base model",
        description="Self-distillation data, teacher-forced features, training and evaluation; "
        "every stage resumes from what the output (and data) folder holds.",
    )
    p.add_argument("--method", required=True, choices=sorted(METHODS))
    p.add_argument("--base", default="smollm2-135m", help="base model: embedded name, dir or .gguf")
    p.add_argument(
        "--prompts", required=True, help="JSONL with 'turns' (first is the prompt), 'prompt', or plain 'text'"
    )
    p.add_argument("--out", required=True, help="output folder (checkpoints, heads, plots)")
    p.add_argument(
        "--data",
        default=None,
        help="data folder for distillation and features (default OUT/data; share it between methods of one base model)",
    )
    d = p.add_argument_group("data")
    d.add_argument(
        "--extra-data",
        action="append",
        default=[],
        metavar="DIR",
        help="also train on the features (same method) of this data folder; repeatable",
    )
    d.add_argument("--max-prompts", type=int, default=1000, help="prompts used, round-robin over categories (0: all)")
    d.add_argument("--max-prompt-tokens", type=int, default=512, help="longer prompts are skipped")
    d.add_argument("--max-new-tokens", type=int, default=160, help="answer length of distillation")
    d.add_argument("--temperature", type=float, default=0.0, help="0: greedy answers")
    d.add_argument("--top-p", type=float, default=1.0)
    d.add_argument("--top-k", type=int, default=0)
    d.add_argument("--distill-batch-size", type=int, default=16)
    d.add_argument(
        "--only-distilled",
        action="store_true",
        help="use only the selected prompts the data folder has answered already "
        "(e.g. after stopping a long distillation)",
    )
    d.add_argument("--feature-dtype", choices=("float16", "float32"), default="float16")
    t = p.add_argument_group("training")
    t.add_argument("--steps", type=int, default=1000)
    t.add_argument("--batch-size", type=int, default=8, help="sequences per step")
    t.add_argument("--max-len", type=int, default=512, help="tokens per sequence (cut)")
    t.add_argument("--lr", type=float, default=1e-3)
    t.add_argument("--warmup", type=int, default=50)
    t.add_argument("--weight-decay", type=float, default=0.0)
    t.add_argument("--clip", type=float, default=1.0, help="global gradient-norm clip")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--save-every", type=int, default=100, help="checkpoint every N steps")
    t.add_argument(
        "--group-by-length",
        action="store_true",
        help="batches of sequences of similar length (less padding, faster steps)",
    )
    t.add_argument(
        "--stop-after",
        type=int,
        default=None,
        help="stop (with a checkpoint) after N steps in total; rerun to continue",
    )
    t.add_argument("--init-heads", default=None, help="start from these heads (specjax format)")
    m = p.add_argument_group("method options")
    m.add_argument("--num-heads", type=int, default=None, help="Medusa heads (default 4)")
    m.add_argument(
        "--num-layers",
        type=int,
        default=None,
        help="ResBlocks per Medusa head (default 1) / EAGLE or DFlash draft layers (default 1)",
    )
    m.add_argument(
        "--own-lm-head",
        action="store_true",
        help="Medusa: a vocabulary projection per head (default: the base's, frozen)",
    )
    m.add_argument("--noise-std", type=float, default=None, help="EAGLE feature noise (0.2)")
    m.add_argument(
        "--feature-loss-weight",
        type=float,
        default=None,
        help="EAGLE: weight of the feature regression (smooth L1; default 1.0)",
    )
    m.add_argument(
        "--token-loss-weight",
        type=float,
        default=None,
        help="EAGLE: weight of the token cross-entropy against the target's distribution (default 0.1)",
    )
    m.add_argument(
        "--token-loss",
        choices=TOKEN_LOSSES,
        default=None,
        help="EAGLE: the token term, kl (cross-entropy to the target's distribution, "
        "EAGLE's; default) or lk (-log of the acceptance rate sum min(p, q), "
        "the LK loss: for sampled decoding)",
    )
    m.add_argument(
        "--draft-steps",
        type=int,
        default=None,
        help="EAGLE-3 (7) / EAGLE (1) training-time-test steps; ReDrafter drafted tokens (5)",
    )
    m.add_argument(
        "--loss-positions",
        type=int,
        default=None,
        help="Medusa/ReDrafter/EAGLE: score N random answer positions per sequence "
        "and step through the vocabulary projection (cheaper steps on CPU; "
        "default all); DFlash: anchors (blocks) per sequence and step (default 32)",
    )
    m.add_argument(
        "--block-size",
        type=int,
        default=None,
        help="DFlash: block of the anchor token and N - 1 drafted positions (default 16)",
    )
    m.add_argument(
        "--loss-decay-gamma",
        type=float,
        default=None,
        help="DFlash: drafted slot j weighs exp(-(j - 1) / gamma) "
        "(default the paper's: 4, 5, 7 for blocks of 8, 10, 16)",
    )
    m.add_argument(
        "--mask-token-id",
        type=int,
        default=None,
        help="DFlash: the mask token (default the highest id the training data never holds)",
    )
    m.add_argument(
        "--draft-vocab-size",
        type=int,
        default=None,
        help="EAGLE-3 (default 8192) / ReDrafter (default: all) draft vocabulary: the most frequent answer tokens",
    )
    m.add_argument(
        "--draft-vocab-loss",
        action="store_true",
        help="Medusa / EAGLE: the token loss over the draft_ids rows of the lm_head "
        "only (what decoding drafts from; ~6x cheaper per scored position)",
    )
    e = p.add_argument_group("evaluation")
    e.add_argument("--eval-prompts", type=int, default=20, help="held-out prompts of the same file (never trained on)")
    e.add_argument("--eval-max-new-tokens", type=int, default=64)
    p.add_argument(
        "--until", choices=("distill", "features", "train", "evaluate"), default="evaluate", help="last stage to run"
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.add_argument("--debug", action="store_true", help="show tracebacks")
    return p


def config_from_args(args):
    from specjax.training.train import TrainConfig, TrainError
    from specjax.training.trainers import method_options

    # The last five are method options: None means the method's default.
    for name in (
        "steps",
        "batch_size",
        "max_len",
        "save_every",
        "max_new_tokens",
        "distill_batch_size",
        "max_prompt_tokens",
        "num_heads",
        "num_layers",
        "draft_steps",
        "loss_positions",
        "draft_vocab_size",
    ):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise TrainError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    if args.block_size is not None and args.block_size < 2:
        raise TrainError(f"--block-size must be >= 2 (the anchor and a draft), got {args.block_size}")
    if args.loss_decay_gamma is not None and not args.loss_decay_gamma > 0:
        raise TrainError(f"--loss-decay-gamma must be > 0, got {args.loss_decay_gamma}")
    if args.mask_token_id is not None and args.mask_token_id < 0:
        raise TrainError(f"--mask-token-id must be >= 0, got {args.mask_token_id}")
    for name in ("noise_std", "feature_loss_weight", "token_loss_weight"):
        value = getattr(args, name)
        if value is not None and not value >= 0:  # NaN too
            raise TrainError(f"--{name.replace('_', '-')} must be >= 0, got {value}")
    if args.feature_loss_weight == 0 and args.token_loss_weight == 0:
        raise TrainError("--feature-loss-weight and --token-loss-weight are both 0: nothing to train")
    if args.lr <= 0:
        raise TrainError(f"--lr must be > 0, got {args.lr}")
    if args.max_prompts < 0 or args.eval_prompts < 0:
        raise TrainError("--max-prompts and --eval-prompts must be >= 0")
    options = {
        "num_heads": args.num_heads,
        "num_layers": args.num_layers,
        "noise_std": args.noise_std,
        "own_lm_head": True if args.own_lm_head else None,
        "steps": args.draft_steps,
        "draft_vocab_size": args.draft_vocab_size,
        "loss_positions": args.loss_positions,
        "v_w": args.feature_loss_weight,
        "p_w": args.token_loss_weight,
        "token_loss": args.token_loss,
        "draft_vocab_loss": True if args.draft_vocab_loss else None,
        "block_size": args.block_size,
        "loss_decay_gamma": args.loss_decay_gamma,
        "mask_token_id": args.mask_token_id,
    }
    flags = {"steps": "--draft-steps", "v_w": "--feature-loss-weight", "p_w": "--token-loss-weight"}
    foreign = [
        flags.get(k, "--" + k.replace("_", "-"))
        for k, v in options.items()
        if v is not None and k not in method_options(args.method)
    ]
    if foreign:
        raise TrainError(f"{', '.join(foreign)} does not apply to --method {args.method}")
    return TrainConfig(
        method=args.method,
        base=args.base,
        prompts=args.prompts,
        out=args.out,
        data=args.data,
        max_prompts=args.max_prompts or None,
        max_prompt_tokens=args.max_prompt_tokens,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        distill_batch=args.distill_batch_size,
        feature_dtype=args.feature_dtype,
        max_len=args.max_len,
        steps=args.steps,
        batch_size=args.batch_size,
        lr=args.lr,
        warmup=args.warmup,
        weight_decay=args.weight_decay,
        clip=args.clip,
        seed=args.seed,
        save_every=args.save_every,
        group_by_length=args.group_by_length,
        method_options=tuple(sorted((k, v) for k, v in options.items() if v is not None)),
        init_heads=args.init_heads,
        eval_prompts=args.eval_prompts,
        eval_max_new_tokens=args.eval_max_new_tokens,
        until=args.until,
        only_distilled=args.only_distilled,
        extra_data=tuple(args.extra_data),
    )


def run_train(args) -> int:
    """Run `specjax train` from parsed arguments; prints where the results went."""
    from specjax.training.train import run

    cfg = config_from_args(args)
    res = run(cfg, stop_after=args.stop_after, progress=not args.no_progress)
    err = sys.stderr
    print(f"data: {cfg.data_dir} ({res.get('sequences', 0)} sequences)", file=err)
    if cfg.extra_data and "train_sequences" in res:
        print(f"trained on {res['train_sequences']} sequences with --extra-data", file=err)
    if "heads" in res:
        print(f"heads: {res['heads']}", file=err)
    elif "state" in res:
        print(f"stopped at step {int(res['state'].step)} of {cfg.steps}; rerun to continue", file=err)
    if "plot" in res:
        print(f"loss curve: {res['plot']}", file=err)
    if "eval" in res:
        ev = res["eval"]
        for cat, st in {**ev["categories"], "all": ev["all"]}.items():
            print(f"  {cat:>14}: mean accepted {st['mean_accepted']:.2f} ({st['prompts']} prompts)", file=err)
    return 0


def add_synthesize_parser(subparsers) -> argparse.ArgumentParser:
    """Register `synthesize-prompts`: user requests the base model writes itself (Magpie)."""
    from specjax.training.synthesize import SynthesisConfig

    d = SynthesisConfig()
    p = subparsers.add_parser(
        "synthesize-prompts",
        help="chat prompts written by the base model itself (Magpie-style)",
        description="Sample user requests from an instruction-tuned model given its chat template "
        "up to a user turn; write them as a prompt file for `specjax train`. "
        "Re-running with the same file resumes.",
    )
    p.add_argument("--base", default="smollm2-135m", help="base model: embedded name, dir or .gguf")
    p.add_argument("--n", type=int, required=True, help="prompts to keep")
    p.add_argument("--out", required=True, help="output JSONL (appended to; resumes)")
    p.add_argument("--temperature", type=float, default=d.temperature)
    p.add_argument("--top-p", type=float, default=d.top_p)
    p.add_argument(
        "--max-tokens",
        type=int,
        default=d.max_tokens,
        help="requests that have not ended their turn by then are dropped",
    )
    p.add_argument("--min-tokens", type=int, default=d.min_tokens, help="shorter requests are dropped")
    p.add_argument("--max-attempts", type=int, default=None, help="requests sampled at most (default 4 x --n)")
    p.add_argument("--category", default=d.category, help="category written to each record")
    p.add_argument("--seed", type=int, default=d.seed, help="request k samples with seed + k")
    p.add_argument("--batch-size", type=int, default=d.batch_size)
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--debug", action="store_true", help="show tracebacks")
    return p


def run_synthesize(args) -> int:
    """Run `specjax synthesize-prompts` from parsed arguments."""
    import jax.numpy as jnp

    from specjax.loading import load_model
    from specjax.training.synthesize import SynthesisConfig, SynthesisError, synthesize_prompts

    if args.batch_size < 1:
        raise SynthesisError(f"--batch-size must be >= 1, got {args.batch_size}")
    cfg = SynthesisConfig(
        temperature=args.temperature,
        top_p=args.top_p,
        max_tokens=args.max_tokens,
        min_tokens=args.min_tokens,
        seed=args.seed,
        batch_size=args.batch_size,
        category=args.category,
    )
    model = load_model(args.base, dtype=jnp.float32)
    kept = synthesize_prompts(
        model, args.n, args.out, cfg, max_attempts=args.max_attempts, progress=not args.no_progress
    )
    print(f"{args.out}: {len(kept)} prompts", file=sys.stderr)
    return 0
