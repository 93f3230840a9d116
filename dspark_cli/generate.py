"""`dspark generate "PROMPT"`: one request through the engine, streamed to the terminal or as JSON."""

from __future__ import annotations

import argparse
import json
import sys
import time

from dspark_core.errors import InvalidArgument
from dspark_core.scheduling import policy_spec
from dspark_core.text import encode_prompt

from .models import load_sps, load_stack, note, resolve_drafter_path, resolve_target
from .options import (add_device_args, add_drafter_args, add_matmul_dtype_arg, add_policy_arg, add_target_arg,
                      add_temperature_arg, add_weights_arg, drafter_is_auto)


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-new-tokens", type=int, default=128, help="tokens to generate at most (default 128)")
    add_temperature_arg(p)
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass in (0, 1] (default 1.0 = off)")
    p.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (default 0 = off)")
    p.add_argument("--seed", type=int, default=None, help="seed of the request's random generator")


def add_parser(sub) -> None:
    p = sub.add_parser("generate", help="generate text for one prompt (embedded engine)",
                       description="Generate a continuation of PROMPT with speculative decoding (default: the bundled "
                                   "target and its drafter; any Hugging Face causal LM with --target).")
    p.add_argument("prompt", nargs="?", default=None, help="the prompt text (a user message for chat models)")
    p.add_argument("--prompt-ids", default=None, help="comma-separated token ids instead of text, e.g. 1,2,3")
    add_target_arg(p)
    add_drafter_args(p)
    add_policy_arg(p)
    p.add_argument("--block-size", type=int, default=None, help="draft block size (default: the drafter's)")
    p.add_argument("--lookup-ngram", type=int, default=0, metavar="N",
                   help="verify an n-gram lookup draft (what followed the longest suffix of at least N tokens "
                        "earlier in prompt + output) instead of the drafter's block when it is expected to accept "
                        "more; the output is unchanged (sampled: in distribution; default 0 = off: DeepSpec's "
                        "rounds)")
    p.add_argument("--raw", action="store_true", help="feed the prompt as plain text, without the chat template")
    add_device_args(p)
    add_matmul_dtype_arg(p)
    add_weights_arg(p)
    p.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    add_sampling_args(p)
    p.set_defaults(func=run)


def parse_prompt_ids(text: str) -> list[int]:
    try:
        ids = [int(x) for x in text.replace(" ", "").split(",") if x != ""]
    except ValueError:
        raise InvalidArgument("--prompt-ids", text, "must be comma-separated integers") from None
    if not ids:
        raise InvalidArgument("--prompt-ids", text, "must name at least one token id")
    return ids


class TextStreamer:
    """Prints decoded text as ids arrive, holding back an incomplete UTF-8 character."""

    def __init__(self, tokenizer, out=None):
        self.tokenizer, self.out, self.ids, self.printed = tokenizer, out or sys.stdout, [], 0

    def __call__(self, new_ids: list[int]) -> None:
        self.ids.extend(new_ids)
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        if text.endswith("\ufffd"):
            return
        self.out.write(text[self.printed:])
        self.out.flush()
        self.printed = len(text)

    def close(self) -> None:
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        self.out.write(text[self.printed:] + "\n")
        self.out.flush()


def sampling_params(args, stop_token_ids=()):
    from dspark_core.sampling import SamplingParams

    return SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed,
                          max_new_tokens=args.max_new_tokens, stop_token_ids=tuple(stop_token_ids))


def run(args) -> int:
    from dspark_core.engine import Engine, EngineConfig
    from dspark_core.lookup import check_ngram

    if (args.prompt is None) == (args.prompt_ids is None):
        raise InvalidArgument("prompt", args.prompt, "give exactly one of PROMPT or --prompt-ids")
    if args.prompt is not None and not args.prompt.strip():
        raise InvalidArgument("prompt", args.prompt, "must not be empty")
    params = sampling_params(args)  # validate before loading anything
    check_ngram(args.lookup_ngram, "--lookup-ngram")
    _quiet_transformers()
    target_dir = resolve_target(args.target)
    target, drafter = load_stack(target_dir, resolve_drafter_path(args.drafter, args.drafter_path, target_dir),
                                 args.device, args.dtype, args.drafter_matmul_dtype,
                                 auto=drafter_is_auto(args), weights=args.weights)
    params = sampling_params(args, stop_token_ids=target.eos_token_ids)
    prompt_ids = parse_prompt_ids(args.prompt_ids) if args.prompt_ids else encode_prompt(
        target.tokenizer, args.prompt, args.raw)
    policy = args.policy if drafter is not None else "ar"
    sps, _ = load_sps(target_dir)
    if policy_spec(policy).needs_sps and sps is None:
        note(f"policy {policy} needs the target's SPS cost table and {target_dir} has none yet "
             f"(`dspark profile --target {target_dir}` measures one); decoding with policy fixed")
        policy = "fixed"
    # DeepSpec's round protocol (the drafter over the whole prompt), so that released checkpoints reproduce their
    # reference traces round by round
    engine = Engine(target, drafter, EngineConfig(policy=policy, block_size=args.block_size, deepspec_rounds=True,
                                                  draft_window=None,
                                                  lookup_ngram=args.lookup_ngram if drafter is not None else 0),
                    sps=sps)
    streamer = None
    if not args.json and target.tokenizer is not None:
        streamer = TextStreamer(target.tokenizer)
    t0 = time.perf_counter()
    req = engine.generate(prompt_ids, params, on_tokens=streamer)
    wall = time.perf_counter() - t0
    text = target.tokenizer.decode(req.output_ids, skip_special_tokens=True) if target.tokenizer else None
    if streamer is not None:
        streamer.close()
    if args.json:
        from dspark_core.drafters.layers import matmul_dtype_name

        rounds = req.num_rounds
        print(json.dumps({
            "text": text,
            "token_ids": req.output_ids,
            "num_rounds": rounds,
            "accepted_per_round": req.accepted_per_round,
            "tau": (sum(req.accepted_per_round) + rounds) / rounds if rounds else None,
            "tokens_per_second": round(len(req.output_ids) / wall, 3),
            "prompt_tokens": len(prompt_ids),
            "finish_reason": req.finish_reason,
            "drafter": getattr(drafter, "name", None),
            "drafter_matmul_dtype": None if drafter is None else matmul_dtype_name(drafter),
            "policy": policy,
            "weights": target.weights,
        }))
    elif streamer is None:
        print(" ".join(map(str, req.output_ids)))
    return 0


def _quiet_transformers() -> None:
    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
