"""`dspark train`: prompts -> self-distillation -> target cache -> drafter training -> checkpoint.

Runs alone or under `torchrun --nproc-per-node N` unchanged: this module is the only place that reads
torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT) and
hands it to dspark_core as a DistConfig.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from pathlib import Path

from dspark_core.drafters.base import DEFAULT_SUPPORT_SIZE
from dspark_core.errors import InvalidArgument

from .models import resolve_target
from .options import add_target_arg

KINDS = ("dspark", "dspark-rnn", "dflash", "eagle3")


def _layer_ids(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.replace(" ", "").split(",") if x)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be comma-separated layer ids, e.g. 1,9,17; got {text!r}") from None


def _decay(text: str) -> float | None:
    if text == "paper":
        return None
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number or 'paper'; got {text!r}") from None


def _temperatures(text: str) -> tuple[float, ...]:
    try:
        ts = tuple(float(x) for x in text.replace(" ", "").split(",") if x)
    except ValueError:
        ts = ()
    if not ts or any(not 0 <= t < float("inf") for t in ts) or len(set(ts)) != len(ts):
        raise argparse.ArgumentTypeError(f"must be distinct temperatures >= 0, e.g. 1 or 0,1; got {text!r}")
    return ts


def _support(text: str) -> int | None:
    if text == "vocab":
        return None
    try:
        k = int(text)
    except ValueError:
        k = 0
    if k < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer or 'vocab'; got {text!r}")
    return k


def add_parser(sub) -> None:
    p = sub.add_parser(
        "train", help="train a drafter for a target (self-distillation, target cache, training)",
        description="Train a DSpark / DSpark-RNN / DFlash / Eagle3 drafter for TARGET. Prompts (the 80% train "
                    "split) are answered by the target itself (or --responses brings answers generated elsewhere), the "
                    "target's features are cached, and the drafter "
                    "is trained from the cache. Runs unchanged under torchrun --nproc-per-node N.")
    p.add_argument("--kind", default="dspark", choices=KINDS, help="drafter to train (default dspark)")
    add_target_arg(p)
    p.add_argument("--data", nargs="+", default=None, metavar="JSONL",
                   help="DeepSpec-format prompt files ({\"turns\": [...]} per line); the train split is used, "
                        "answered by the target itself")
    p.add_argument("--responses", nargs="+", default=None, metavar="JSONL",
                   help="train from responses generated elsewhere (e.g. vLLM serving the target) instead of "
                        "distilling --data: {\"prompt\": ..., \"response\": ...}, {\"messages\": [...]} or "
                        "{\"prompt_ids\": [...], \"response_ids\": [...]} per line; held-out prompts are skipped")
    p.add_argument("--out", required=True, help="run directory: checkpoints/, final/, metrics.jsonl, training card")
    p.add_argument("--cache-dir", default=None, help="target cache directory (default OUT/cache); reused when it "
                                                     "was built from the same target, layers, prompts and settings")
    p.add_argument("--rebuild-cache", action="store_true", help="discard an existing cache in --cache-dir")
    p.add_argument("--add-cache", nargs="+", default=(), metavar="DIR",
                   help="complete target caches of earlier runs (same target and tapped layers) to train on "
                        "together with this run's own, e.g. another distillation of other prompts")
    p.add_argument("--limit-prompts", type=int, default=None, help="first N prompts of each file")
    p.add_argument("--eval-fraction", type=float, default=0.2, help="held-out fraction of the fixed split (0.2)")
    g = p.add_argument_group("distillation")
    g.add_argument("--max-new-tokens", type=int, default=256, help="response tokens per prompt (default 256)")
    g.add_argument("--distill-temperature", type=_temperatures, default=(1.0,), metavar="T[,T...]",
                   help="target sampling temperature (1.0); a list such as 0,1 answers every prompt once per "
                        "temperature (one cache each, under --cache-dir/T<t>) and trains on all of them")
    g.add_argument("--max-prompt-tokens", type=int, default=None, metavar="N",
                   help="leave out prompts longer than N tokens (default: any that fits the context window)")
    g.add_argument("--concurrency", type=int, default=32, help="prompts answered at once per rank (32)")
    g.add_argument("--cache-dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"),
                   help="dtype of cached features (default bfloat16)")
    g = p.add_argument_group("optimisation")
    g.add_argument("--steps", type=int, default=1000, help="optimizer steps (default 1000)")
    g.add_argument("--global-batch", type=int, default=32, help="sequences per step over all ranks (default 32)")
    g.add_argument("--micro-batch", type=int, default=1, help="sequences per forward per rank (default 1)")
    g.add_argument("--lr", type=float, default=6e-4, help="peak AdamW learning rate (default 6e-4)")
    g.add_argument("--warmup-ratio", type=float, default=0.04, help="linear warm-up share of the steps (0.04)")
    g.add_argument("--grad-clip", type=float, default=1.0, help="global gradient-norm clip (default 1.0)")
    g.add_argument("--num-anchors", type=int, default=512, help="blocks per sequence at most (default 512)")
    g.add_argument("--max-length", type=int, default=4096, help="tokens per sequence at most (default 4096)")
    g.add_argument("--seed", type=int, default=0, help="initialisation, sample order, anchors, distillation")
    g.add_argument("--checkpoint-every", type=int, default=0, help="steps between checkpoints (0 = end only)")
    g.add_argument("--keep-checkpoints", type=int, default=2, help="checkpoints kept (default 2)")
    g.add_argument("--resume", action="store_true", help="continue from OUT's latest checkpoint")
    g.add_argument("--fsdp", action="store_true", help="shard parameters / gradients / optimizer (FSDP2) "
                                                      "instead of DistributedDataParallel")
    g.add_argument("--bf16", action="store_true",
                   help="bfloat16 autocast: on CUDA, or on a CPU with native bf16 matmuls (AVX512-BF16 / AMX), where "
                        "the vocabulary-sized LM-head matmuls dominate a step")
    g = p.add_argument_group("drafter and loss")
    g.add_argument("--block-size", type=int, default=7, help="gamma: block size / Eagle3 TTT length (default 7)")
    g.add_argument("--draft-layers", type=int, default=None, help="draft depth (default: min(5, target layers / 6))")
    g.add_argument("--markov-rank", type=int, default=None, help="Markov rank r (default: hidden / 8 in [16, 256])")
    g.add_argument("--target-layers", type=_layer_ids, default=None, help="tapped target layers, e.g. 1,9,17,25,33")
    g.add_argument("--ce-weight", type=float, default=None, help="CE weight (dspark 0.1, dflash 1.0)")
    g.add_argument("--tv-weight", type=float, default=None, help="TV weight (dspark 0.9)")
    g.add_argument("--confidence-weight", type=float, default=None, help="confidence BCE weight (dspark 1.0)")
    g.add_argument("--position-decay", type=_decay, default=4.0,
                   help="slot weights exp(-j / DECAY); 'paper' = block size (default 4, the reference code)")
    g.add_argument("--step-decay", type=float, default=0.8, help="Eagle3 TTT step weights DECAY^s (0.8)")
    g.add_argument("--confidence-support", type=_support, default=DEFAULT_SUPPORT_SIZE, metavar="K|vocab",
                   help="the confidence label is the acceptance of the draft truncated to its top-K, as inference "
                        f"samples it (default {DEFAULT_SUPPORT_SIZE}, the drafters' support, i.e. min(K, vocabulary)); "
                        "'vocab' = full vocabulary (paper formula)")
    g.add_argument("--confidence-temperature", type=float, default=1.0,
                   help="sampling temperature of draft and target in the confidence label (default 1.0)")
    g.add_argument("--init-from", default=None, metavar="DIR",
                   help="start from this drafter checkpoint's weights (same kind, shape and taps; the block size "
                        "may differ) instead of a fresh initialisation")
    g.add_argument("--trainable", default="all",
                   choices=("all", "confidence", "confidence-sampled", "confidence-greedy"),
                   help="parameters to train: all (but the frozen embedding / LM head; default) or only the "
                        "confidence head (with --init-from: refit the confidence, drafts and tau unchanged); "
                        "confidence-sampled / confidence-greedy: only that output of it")
    g.add_argument("--draft-vocab", type=int, default=0, metavar="N",
                   help="predict only the N most frequent label tokens of the training data (their target ids are "
                        "saved with the drafter; 0 = the whole vocabulary, the default). The LM head and Markov "
                        "output shrink to N rows, so steps and drafting get cheaper; the target mass outside "
                        "them is counted exactly in the loss (a one-time log-partition pass over the cache)")
    g.add_argument("--layer-init", choices=("random", "target"), default="random",
                   help="draft layers' initial weights: random (seeded, default) or target: copies of the target's "
                        "last decoder layers, the context projection starting as the deepest tapped layer")
    g.add_argument("--greedy-confidence", action="store_true",
                   help="DSpark: also train a greedy confidence output (label: draft argmax == target argmax), "
                        "used for temperature-0 requests; with --init-from a checkpoint without one it starts "
                        "as a copy of the confidence head")
    p.add_argument("--device", default="auto",
                   help="auto (cuda when present), cpu, cuda (under torchrun: GPU LOCAL_RANK of each rank) or cuda:N "
                        "(one process on GPU N) (default auto)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.set_defaults(func=run)


def dist_config_from_env(device: str):
    """torchrun's variables -> DistConfig (a world of one without them)."""
    from dspark_core.training.distributed import DistConfig

    world = int(os.environ.get("WORLD_SIZE", "1"))
    init = None
    if world > 1:
        addr, port = os.environ.get("MASTER_ADDR", "127.0.0.1"), os.environ.get("MASTER_PORT", "29500")
        init = f"tcp://{addr}:{port}"
    return DistConfig(rank=int(os.environ.get("RANK", "0")), world_size=world,
                      local_rank=int(os.environ.get("LOCAL_RANK", "0")), init_method=init, device=device)


def _target_layers(target_dir: str, args) -> tuple[int, ...]:
    from transformers import AutoConfig

    from dspark_core.training.trainer import default_target_layers

    if args.target_layers:
        return args.target_layers
    try:
        hf = AutoConfig.from_pretrained(target_dir, local_files_only=True)
    except Exception as exc:  # noqa: BLE001 - any failure here is a bad target directory
        raise InvalidArgument("--target", target_dir, f"must be a Hugging Face model directory ({exc})") from None
    hf = hf.get_text_config() if hasattr(hf, "get_text_config") else hf
    return default_target_layers(hf.num_hidden_layers)


def _load_responses(args, target, say):
    from dspark_core.training.data import load_responses

    out = []
    for f in args.responses:
        samples, held, long_ = load_responses(f, target.tokenizer, target.eos_token_ids,
                                              max_length=min(args.max_length, target.max_context),
                                              eval_fraction=args.eval_fraction)
        say(f"responses: {f}: {len(samples)} sequences ({held} held-out prompts and {long_} sequences longer "
            f"than --max-length skipped)")
        out.extend(samples)
    if not out:
        raise InvalidArgument("--responses", args.responses, "must hold at least one usable training sequence")
    return out


def run(args) -> int:
    import gc

    import torch

    from dspark_core.target import TargetConfig, TargetRuntime
    from dspark_core.training.cache import ConcatCache, TargetCache
    from dspark_core.training.data import load_prompts, split
    from dspark_core.training.distributed import init_distributed
    from dspark_core.training.prepare import DistillSettings, prepare_target_cache
    from dspark_core.training.trainer import (TrainConfig, Trainer, choose_draft_vocab, fresh_drafter,
                                              init_from_checkpoint)

    cfg = TrainConfig(
        kind=args.kind, out_dir=args.out, steps=args.steps, global_batch=args.global_batch,
        micro_batch=args.micro_batch, lr=args.lr, warmup_ratio=args.warmup_ratio, grad_clip=args.grad_clip,
        num_anchors=args.num_anchors, seed=args.seed, checkpoint_every=args.checkpoint_every,
        keep_checkpoints=args.keep_checkpoints, max_length=args.max_length, block_size=args.block_size,
        draft_layers=args.draft_layers, markov_rank=args.markov_rank, target_layer_ids=args.target_layers,
        ce_weight=args.ce_weight, tv_weight=args.tv_weight, confidence_weight=args.confidence_weight,
        position_decay=args.position_decay, step_decay=args.step_decay,
        confidence_support=args.confidence_support, confidence_temperature=args.confidence_temperature,
        init_from=args.init_from, trainable=args.trainable, greedy_confidence=args.greedy_confidence,
        draft_vocab_size=args.draft_vocab, layer_init=args.layer_init, fsdp=args.fsdp, bf16=args.bf16)
    kind, _, index = args.device.partition(":")
    if not (args.device in ("auto", "cpu", "cuda") or (kind == "cuda" and index.isdigit())):
        raise InvalidArgument("--device", args.device, "must be auto, cpu, cuda or cuda:N")
    if bool(args.data) == bool(args.responses):
        raise InvalidArgument("--data", args.data, "give prompt files (--data) or response files (--responses): one")
    if args.init_from and not Path(args.init_from, "config.json").is_file():
        raise InvalidArgument("--init-from", args.init_from, "must be a drafter checkpoint directory (config.json)")
    settings = [DistillSettings(max_new_tokens=args.max_new_tokens, temperature=t, seed=args.seed,
                                concurrency=args.concurrency, dtype=args.cache_dtype,
                                max_prompt_tokens=args.max_prompt_tokens) for t in args.distill_temperature]
    ctx = init_distributed(dist_config_from_env(args.device))
    if args.bf16 and ctx.device.type == "cpu":
        from dspark_core.drafters.checkpoint import cpu_has_native_bf16

        if not cpu_has_native_bf16():
            ctx.close()
            raise InvalidArgument("--bf16", True, "needs CUDA or a CPU with native bf16 matmuls (AVX512-BF16 / AMX)")
    try:
        if ctx.device.type == "cpu" and ctx.distributed:  # share the cores between the local ranks
            local_world = int(os.environ.get("LOCAL_WORLD_SIZE", str(ctx.world_size)))
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world))
        say = (lambda msg: print(msg, file=sys.stderr, flush=True)) if ctx.is_main else (lambda msg: None)
        prompts = [p for f in args.data or () for p in load_prompts(f, limit=args.limit_prompts)]
        train_prompts, held_out = split(prompts, args.eval_fraction)
        if args.data:
            say(f"prompts: {len(prompts)} ({len(train_prompts)} train, {len(held_out)} held out for evaluation)")
        target_dir = resolve_target(args.target)
        taps = _target_layers(target_dir, args)
        cfg = dataclasses.replace(cfg, target_layer_ids=taps)
        # the loaded (for an imported GGUF: dequantized float32) weights: training data stays exact and does
        # not depend on the CPU's packed kernels
        target = TargetRuntime(TargetConfig(model_dir=target_dir, device=str(ctx.device), dtype="auto",
                                            tap_layer_ids=taps, weights="float32"))
        cache_dir = Path(args.cache_dir or Path(args.out) / "cache")
        responses = _load_responses(args, target, say) if args.responses else None
        if responses is not None:
            settings = settings[:1]
        caches = [prepare_target_cache(target, train_prompts, cache_dir / f"T{s.temperature:g}" if len(settings) > 1
                                       else cache_dir, ctx, s, rebuild=args.rebuild_cache,
                                       progress=not args.no_progress, log=say, responses=responses)
                  for s in settings]
        for extra in args.add_cache:
            if not (Path(extra) / "manifest.json").is_file():
                raise InvalidArgument("--add-cache", extra, "must be a complete target cache (manifest.json)")
            caches.append(TargetCache(extra))
            say(f"adding target cache {extra} ({len(caches[-1])} sequences)")
        cache = caches[0] if len(caches) == 1 else ConcatCache(caches, cache_dir)
        draft_vocab = None
        if cfg.init_from and not cfg.draft_vocab_size:
            # continuing a drafter with a draft vocabulary keeps its vocabulary
            from safetensors import safe_open

            from dspark_core.drafters.config import load_config as load_drafter_config

            n = load_drafter_config(Path(cfg.init_from)).draft_vocab_size
            if n:
                with safe_open(str(Path(cfg.init_from) / "model.safetensors"), framework="pt") as f:
                    draft_vocab = f.get_tensor("draft_vocab_ids").long()
                cfg = dataclasses.replace(cfg, draft_vocab_size=n)
                say(f"draft vocabulary: {n} ids, kept from {cfg.init_from}")
        elif cfg.draft_vocab_size:
            if cfg.draft_vocab_size > target.vocab_size:
                raise InvalidArgument("--draft-vocab", cfg.draft_vocab_size,
                                      f"must be at most the target's vocabulary ({target.vocab_size})")
            counts = cache.label_counts(target.vocab_size)
            eos = target.tokenizer.eos_token_id
            draft_vocab = choose_draft_vocab(counts, cfg.draft_vocab_size,
                                             tuple(eos if isinstance(eos, list) else [eos] if eos is not None else []))
            covered = float(counts[draft_vocab].sum()) / max(1.0, float(counts.sum()))
            say(f"draft vocabulary: {cfg.draft_vocab_size} of {target.vocab_size} ids, covering {covered:.1%} of "
                f"the {int(counts.sum())} label tokens ({int((counts > 0).sum())} distinct)")
        if draft_vocab is not None:
            # the ranks split the shards (one LM-head pass over every cached token is minutes on a CPU), then each
            # checks them all (shards are written atomically)
            cache.ensure_target_lse(target.model.get_output_embeddings().weight.detach().float().cpu(),
                                    progress=not args.no_progress and ctx.is_main, rank=ctx.rank,
                                    world_size=ctx.world_size, barrier=ctx.barrier)
        drafter = fresh_drafter(target, cfg, draft_vocab)
        if cfg.init_from:
            init_from_checkpoint(drafter, cfg.init_from)
            say(f"initialised from {cfg.init_from}")
        cache_dtypes = {c.manifest.dtype for c in caches}
        if len(cache_dtypes) == 1 and (cache_dtype := cache_dtypes.pop()) != "float32":
            # it learns from features at the cache's precision: it reads them at that precision when serving too
            drafter.config = dataclasses.replace(drafter.config, context_feature_dtype=cache_dtype)
        del target
        gc.collect()
        data_info = {"prompt_files": [str(f) for f in args.data or ()], "train_prompts": len(train_prompts),
                     "held_out_prompts": len(held_out),
                     **({"added_caches": [str(d) for d in args.add_cache]} if args.add_cache else {}),
                     **({"response_files": [str(f) for f in args.responses], "responses": len(responses)}
                        if responses is not None else {}),
                     "distill": settings[0].__dict__ if len(settings) == 1 else
                     {**settings[0].__dict__, "temperature": [s.temperature for s in settings]}}
        trainer = Trainer(cfg, cache, drafter, ctx, resume=args.resume, data_info=data_info,
                          progress=not args.no_progress)
        if args.resume and trainer.step:
            say(f"resuming at step {trainer.step} from {Path(args.out) / 'checkpoints'}")
        result = trainer.train()
        say(f"trained {result.steps} steps, {result.tokens} tokens in {result.seconds:.1f} s "
            f"({result.tokens_per_second:.0f} tokens/s); drafter: {result.checkpoint}")
        say("final losses: " + ", ".join(f"{k} {v:.4f}" for k, v in result.final_losses.items()))
    finally:
        ctx.close()
    return 0
