"""`dspark bench`: serving benchmark (issue #4) — aggregate vs per-user tokens/s for each policy and
concurrency on the embedded engine, the batch-1 speedup over autoregressive decoding, and Hugging Face
transformers' own assisted generation as a peer at batch 1.

Prompts: the held-out 20% split (`dspark_core.training.data.split`, as `dspark eval` uses) of each `--dataset
F.jsonl` (DeepSpec format, first turn; `--split all`: the file as given), default the dev code sets, mbpp and
livecodebench, taken round-robin; the first `--num-prompts` that fit the context window. The measurement protocol is
documented in `dspark_core/benchmark.py`.

Causal and async need the target's SPS(B) table (`sps.json`, written by `dspark profile`, loaded
as `dspark generate` does). When it is missing they are skipped with a warning (stderr, and `warnings` in
the JSON). `--profile-sps` measures a quick table in the benchmark's own process instead (B on a doubling
grid up to max concurrency x (block + 1), 3 timed repeats each; not saved), so that the policies schedule
with the cost curve of the very conditions (threads, machine load) they are measured under.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from dspark_core.errors import InvalidArgument
from dspark_core.lookup import DEFAULT_LOOKUP_NGRAM, check_ngram
from dspark_core.scheduling import DRAFT_WINDOW

from .models import models_dir, resolve_drafter_path, resolve_target
from .options import (DRAFTER_CHOICES, add_device_args, add_matmul_dtype_arg, add_target_arg, add_weights_arg,
                      drafter_is_auto)

DEFAULT_DATASETS = ("mbpp.jsonl", "livecodebench.jsonl")


def _write_result(result: dict, out: str | None) -> str:
    """The result as one JSON line, also written to `out` (parents created) when given."""
    text = json.dumps(result)
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(text + "\n")
    return text

def default_datasets() -> list[str]:
    root = Path(__file__).resolve().parents[1] / "data" / "dev"
    return [str(root / name) for name in DEFAULT_DATASETS]


def add_parser(sub) -> None:
    p = sub.add_parser("bench", help="throughput / per-user speed benchmark of the policies (and HF peer)",
                       description="For every concurrency x policy, keep CONCURRENCY requests in flight on the "
                                   "embedded engine and measure aggregate tokens/s, per-user tokens/s and the "
                                   "mean verification length; at batch 1, also the speedup over autoregressive "
                                   "decoding and over Hugging Face assisted generation.")
    p.add_argument("--concurrency", default=None,
                   help="comma-separated (default 1,2,4,8,16,32; with --distributed 1,8,32)")
    p.add_argument("--policy", default=None,
                   help="comma-separated among causal, async, fixed, gamma1, threshold, ar "
                        "(default causal,async,fixed,gamma1,ar; ar = no drafter); with --distributed one policy, "
                        "the schedulers' (default fixed)")
    p.add_argument("--distributed", action="store_true",
                   help="serve the same models as real processes on loopback, embedded (`dspark serve all`) and "
                        "distributed (redis + verifier + drafter + scheduler), and load both with the same prompts "
                        "over gRPC, interleaved; reports tokens/s per concurrency, their ratio "
                        "(distributed_vs_embedded) and where each scheduler step spends its time (stage_breakdown). "
                        "Needs redis-server on PATH")
    p.add_argument("--dataset", action="append", default=None, metavar="F.jsonl",
                   help="prompt file ({\"turns\": [...]} per line, first turn); repeatable; its held-out split "
                        "unless --split all. Default: held-out split of the dev code sets (mbpp, livecodebench)")
    p.add_argument("--split", default="eval", choices=("eval", "all"),
                   help="eval: the fixed held-out 20%% of each --dataset, as `dspark eval` takes it (default: the "
                        "rest is what `dspark train` distils, so a drafter has seen those prompts); all: the file "
                        "as given (a prompt set kept apart from training)")
    p.add_argument("--num-prompts", type=int, default=16, help="prompts in the fixed list (default 16)")
    p.add_argument("--max-new-tokens", type=int, default=128, help="tokens per request at most (default 128)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default 0)")
    p.add_argument("--repeats", type=int, default=1, help="repeats of every point; medians count (default 1)")
    p.add_argument("--block-size", type=int, default=None, help="draft block size (default: the drafter's)")
    p.add_argument("--seed", type=int, default=0, help="base seed; prompt i uses its own stream (default 0)")
    p.add_argument("--draft-window", type=int, default=DRAFT_WINDOW, metavar="N",
                   help="a request's drafter context begins at most N positions before its first anchor (serving's "
                        f"--draft-window); 0 = the whole prompt (default {DRAFT_WINDOW})")
    p.add_argument("--request-history", choices=("on", "off", "both"), default="on",
                   help="the drafter's request-history recalibration (calibration.json request_history): on "
                        "(default), off, or both: every confidence policy also runs without it, as "
                        "<policy>/no-history, interleaved in the same run")
    p.add_argument("--draft-gate", choices=("on", "off", "both"), default="on",
                   help="the engine's draft gate (a request whose drafts do not pay for themselves decodes "
                        "autoregressively for a while): on (default), off, or both: causal / async also run "
                        "without it, as <policy>/no-gate, interleaved in the same run (draft_gate_vs_off in the "
                        "JSON)")
    p.add_argument("--slot-correction", choices=("on", "off", "both"), default="off",
                   help="the engine's online slot correction (per position, the workload's level of the confidences "
                        "learned from verified rounds): off (default, as in serving), on, or both: every confidence "
                        "policy runs with it and also without it, as <policy>/no-correction, interleaved in the same "
                        "run (slot_correction_vs_off in the JSON)")
    p.add_argument("--draft-gate-scope", choices=("batch", "request", "both"), default="batch",
                   help="what the draft gate decides for: batch (default, as in serving: whether a step runs the "
                        "drafter at all, weighing the pass's fixed cost against the requests whose drafts pay; "
                        "the batch probes together), request (each request on its own, carrying its share of "
                        "the pass), or both: causal / async also run in request scope, as <policy>/request-scope, "
                        "interleaved in the same run (draft_gate_batch_vs_request_scope in the JSON)")
    p.add_argument("--lookup", choices=("on", "off", "both"), default="on",
                   help="n-gram lookup drafts (what followed the request's longest suffix of at least "
                        "--lookup-ngram tokens earlier in its prompt + output, verified instead of the drafter's "
                        "block when expected to accept more): on (default, as in serving), off, or both: "
                        "every drafted policy also runs without them, as <policy>/no-lookup, interleaved in the "
                        "same run (lookup_vs_off in the JSON)")
    p.add_argument("--lookup-ngram", type=int, default=DEFAULT_LOOKUP_NGRAM, metavar="N",
                   help=f"shortest match of lookup drafts (default {DEFAULT_LOOKUP_NGRAM}, serving's)")
    add_target_arg(p)
    p.add_argument("--drafter", default="auto", choices=DRAFTER_CHOICES,
                   help="shipped drafter (default auto = dspark)")
    p.add_argument("--drafter-path", default=None, help="drafter checkpoint directory (DeepSpec format)")
    p.add_argument("--no-hf", action="store_true", help="skip the Hugging Face peer")
    p.add_argument("--hf-assistant", default=None,
                   help="assistant model directory for HF assisted generation (default: the target's, "
                        "models/assistant for tiny, models/<target>/assistant for another)")
    p.add_argument("--hf-prompt-lookup-tokens", type=int, default=10,
                   help="prompt_lookup_num_tokens of HF prompt-lookup decoding (default 10)")
    p.add_argument("--no-llamacpp", action="store_true", help="skip the llama.cpp peer")
    p.add_argument("--llamacpp-gguf", default=None, metavar="FILE.gguf",
                   help="GGUF file for the llama.cpp peer (default: the one the target was imported from, its "
                        "gguf_source.json); the peer runs when llama-cpp-python is installed (pip install "
                        "'dspark[llamacpp]'), with torch's thread count")
    p.add_argument("--llamacpp-prompt-lookup-tokens", type=int, default=10,
                   help="num_pred_tokens of llama-cpp-python's prompt-lookup decoding (default 10; 0 = skip it)")
    p.add_argument("--profile-sps", action="store_true",
                   help="measure a quick SPS table in this process (not saved) instead of reading the target's "
                        "sps.json; without it, causal/async are skipped with a warning when the target has none")
    add_device_args(p)
    add_matmul_dtype_arg(p)
    add_weights_arg(p)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--out", default=None, help="also write the JSON object to this file")
    p.add_argument("--plot", default=None, metavar="OUT.png",
                   help="write the frontier (paper Fig. 7) to OUT.png and per-concurrency bars (Fig. 8) "
                        "to OUT_by_concurrency.png")
    p.set_defaults(func=run)


def check_args(args):
    from dspark_core.benchmark import BenchSettings, parse_int_list, parse_policies

    distributed = getattr(args, "distributed", False)
    if args.concurrency is None:
        args.concurrency = "1,8,32" if distributed else "1,2,4,8,16,32"
    if args.policy is None:
        args.policy = "fixed" if distributed else "causal,async,fixed,gamma1,ar"
    concurrencies = parse_int_list(args.concurrency, "--concurrency")
    policies = parse_policies(args.policy, "--policy")
    if distributed:
        if len(policies) != 1:
            raise InvalidArgument("--policy", args.policy, "must name one policy with --distributed (each deployment's "
                                                           "scheduler runs one)")
        for flag, given in (("--plot", args.plot), ("--profile-sps", args.profile_sps),
                            ("--draft-gate", args.draft_gate != "on" and args.draft_gate),
                            ("--slot-correction", args.slot_correction != "off" and args.slot_correction),
                            ("--draft-gate-scope", args.draft_gate_scope != "batch" and args.draft_gate_scope),
                            ("--lookup", args.lookup == "both" and args.lookup),
                            ("--llamacpp-gguf", args.llamacpp_gguf), ("--hf-assistant", args.hf_assistant)):
            if given:
                raise InvalidArgument(flag, given, "does not apply with --distributed (the services run the policy "
                                                   "on their own cost tables; no peers)")
        import shutil

        if shutil.which("redis-server") is None:
            raise InvalidArgument("--distributed", True, "needs redis-server on PATH")
    if args.num_prompts < 1:
        raise InvalidArgument("--num-prompts", args.num_prompts, "must be >= 1")
    if args.max_new_tokens < 1:
        raise InvalidArgument("--max-new-tokens", args.max_new_tokens, "must be >= 1")
    if not args.temperature >= 0 or args.temperature != args.temperature:
        raise InvalidArgument("--temperature", args.temperature, "must be >= 0")
    if args.repeats < 1:
        raise InvalidArgument("--repeats", args.repeats, "must be >= 1")
    if check_ngram(args.lookup_ngram, "--lookup-ngram") == 0:
        raise InvalidArgument("--lookup-ngram", 0, "must be the shortest match (--lookup off: no lookup drafts)")
    if args.draft_window < 0:
        raise InvalidArgument("--draft-window", args.draft_window, "must be >= 0 (0: the whole prompt)")
    if args.block_size is not None and not 1 <= args.block_size <= 32:
        raise InvalidArgument("--block-size", args.block_size, "must be in [1, 32]")
    if args.llamacpp_prompt_lookup_tokens < 0:
        raise InvalidArgument("--llamacpp-prompt-lookup-tokens", args.llamacpp_prompt_lookup_tokens, "must be >= 0")
    if args.llamacpp_gguf is not None and not Path(args.llamacpp_gguf).is_file():
        raise InvalidArgument("--llamacpp-gguf", args.llamacpp_gguf, "must be an existing .gguf file")
    if args.hf_prompt_lookup_tokens < 1:
        raise InvalidArgument("--hf-prompt-lookup-tokens", args.hf_prompt_lookup_tokens, "must be >= 1")
    if args.drafter != "auto" and args.drafter_path:
        raise InvalidArgument("--drafter", args.drafter, "give --drafter or --drafter-path, not both")
    for f in args.dataset or ():
        if not Path(f).is_file():
            raise InvalidArgument("--dataset", f, "must be an existing JSONL file")
    return BenchSettings(policies=tuple(policies), concurrencies=tuple(concurrencies),
                         max_new_tokens=args.max_new_tokens, temperature=args.temperature, repeats=args.repeats,
                         block_size=args.block_size, seed=args.seed, request_history=args.request_history,
                         draft_window=args.draft_window or None, draft_gate=args.draft_gate,
                         slot_correction=args.slot_correction, draft_gate_scope=args.draft_gate_scope,
                         lookup=args.lookup, lookup_ngram=args.lookup_ngram)


def load_prompt_list(args, target) -> tuple[list[list[int]], dict]:
    """Token ids of the fixed prompt list, and where it came from."""
    from dspark_core.text import encode_prompt
    from dspark_core.training.data import load_prompts, split

    limit = target.max_context - args.max_new_tokens - 1
    as_given = bool(args.dataset) and args.split == "all"
    files = args.dataset or default_datasets()
    sets = [load_prompts(f) if as_given else split(load_prompts(f), 0.2)[1] for f in files]
    for f, held in zip(args.dataset or (), sets):
        if not held:
            raise InvalidArgument("--dataset", f, "has no held-out prompt (its eval split is empty); pass "
                                                  "--split all to use the file as given")
    source = {"datasets": [Path(f).name for f in args.dataset] if args.dataset else list(DEFAULT_DATASETS),
              "split": "none (used as given)" if as_given else "eval (20%, hashed), round-robin"}
    order = [s[i] for i in range(max(map(len, sets), default=0)) for s in sets if i < len(s)]
    prompts, too_long = [], 0
    for pr in order:
        ids = encode_prompt(target.tokenizer, pr.text)
        if len(ids) > limit:
            too_long += 1
            continue
        prompts.append(ids)
        if len(prompts) == args.num_prompts:
            break
    if not prompts:
        raise InvalidArgument("--dataset", args.dataset, f"has no prompt that fits the context window ({limit} tokens)")
    source.update(num_prompts=len(prompts), skipped_too_long=too_long,
                  prompt_tokens_median=sorted(map(len, prompts))[len(prompts) // 2])
    return prompts, source


def load_hf_peer(args, target_dir: str, warnings: list[str]):
    import torch
    from transformers import AutoModelForCausalLM

    from dspark_core.benchmark import HFPeer, load_assistant
    from dspark_core.stack import drafters_dir
    from dspark_core.target import resolve_device

    dev = resolve_device(args.device)
    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).to(dev).eval()
    asst_dir = args.hf_assistant or str(drafters_dir(target_dir) / "assistant")
    assistant = None
    if (Path(asst_dir) / "config.json").exists():
        assistant = load_assistant(asst_dir, model).to(dev)
        theirs, mine = assistant.get_output_embeddings().weight.shape[0], model.get_output_embeddings().weight.shape[0]
        if theirs != mine:
            if args.hf_assistant:
                raise InvalidArgument("--hf-assistant", args.hf_assistant,
                                      f"must share the target's vocabulary ({mine} tokens; it has {theirs})")
            warnings.append(f"HF assisted generation skipped: the assistant in {asst_dir} has another vocabulary "
                            f"({theirs} tokens, the target {mine}); --hf-assistant DIR names one for this target")
            assistant = None
    elif args.hf_assistant:
        raise InvalidArgument("--hf-assistant", args.hf_assistant, "must be a model directory with a config.json")
    else:
        warnings.append(f"no assistant model in {asst_dir} (scripts/train_assistant.py makes one)")
    eos = model.generation_config.eos_token_id
    eos = [eos] if isinstance(eos, int) else list(eos or [])
    return HFPeer(model=model, assistant=assistant, prompt_lookup_num_tokens=args.hf_prompt_lookup_tokens,
                  eos_token_ids=tuple(eos), pad_token_id=model.generation_config.pad_token_id), asst_dir


def load_llamacpp(args, target_dir: str, target, warnings: list[str]):
    """The llama.cpp peer, or None (with the reason in `warnings` when one was wanted)."""
    import importlib.util

    import torch

    from dspark_core.benchmark import load_llamacpp_peer
    from dspark_core.gguf_import import gguf_source

    if args.no_llamacpp:
        return None
    path = args.llamacpp_gguf
    if path is None:
        try:
            path = gguf_source(target_dir)
        except Exception as exc:  # noqa: BLE001 - a stale record: say so, run without the peer
            warnings.append(f"llama.cpp peer skipped: {exc}")
            return None
        if path is None:
            return None  # not a GGUF target: nothing to compare with, no warning
    if importlib.util.find_spec("llama_cpp") is None:
        warnings.append("llama.cpp peer skipped: llama-cpp-python is not installed "
                        "(pip install 'dspark[llamacpp]')")
        return None
    n_ctx = min(target.max_context, 4096)
    return load_llamacpp_peer(str(path), torch.get_num_threads(), n_ctx, args.llamacpp_prompt_lookup_tokens,
                              target.eos_token_ids)


def run(args) -> int:
    from tqdm import tqdm

    import torch

    from dspark_core.benchmark import (plan, plan_llamacpp, plot_results, repeated_prompt_warnings, run_benchmark,
                                       total_requests)
    from dspark_core.profiling import quick_sps_table

    from .generate import _quiet_transformers
    from .models import load_sps, load_stack

    settings = check_args(args)  # validate before loading anything
    _quiet_transformers()
    if args.distributed:
        return run_distributed(args, settings)
    target_dir = resolve_target(args.target)
    drafter_path = resolve_drafter_path(args.drafter, args.drafter_path, target_dir)
    target, drafter = load_stack(target_dir, drafter_path, args.device, args.dtype, args.drafter_matmul_dtype,
                                 auto=drafter_is_auto(args), weights=args.weights)
    prompts, source = load_prompt_list(args, target)
    warnings: list[str] = []
    wants_sps = any(p in ("causal", "async") for p in settings.policies)
    sps, sps_source = None, None
    if wants_sps and args.profile_sps:
        print("dspark bench: profiling a quick SPS table for this run (--profile-sps)", file=sys.stderr)
        block = (args.block_size or getattr(drafter, "block_size", None) or 7) + 1
        sps = quick_sps_table(target, max(settings.concurrencies) * block, budget_s=float("inf"))
        sps_source = "quick profile in this process (--profile-sps, not saved)"
    elif wants_sps:
        sps, sps_path = load_sps(target_dir)
        sps_source = str(sps_path) if sps is not None else None
        from dspark_core.profiling import kernels_in_use, stale_kernels

        stale = stale_kernels(sps, kernels_in_use(target))
        if stale is not None:
            print(f"dspark bench: warning: the cost table {sps_path} is stale ({stale}); the causal / async "
                  "policies start from it and correct it online. `dspark models install` (or `make setup`) or "
                  "`dspark profile` measures it again; --profile-sps measures one for this run",
                  file=sys.stderr)
    hf = None
    hf_config = None
    if not args.no_hf:
        hf, asst_dir = load_hf_peer(args, target_dir, warnings)
        hf_config = {"assistant": asst_dir if hf.assistant is not None else None,
                     "prompt_lookup_num_tokens": args.hf_prompt_lookup_tokens, "dtype": "float32",
                     "assistant_schedule": "transformers default"}
    llamacpp = load_llamacpp(args, target_dir, target, warnings)
    policies, hf_modes, plan_warnings = plan(settings, drafter, sps, hf)
    plan_warnings += repeated_prompt_warnings(settings, len(prompts))  # the result lists them too
    for w in warnings + plan_warnings:
        print(f"dspark bench: warning: {w}", file=sys.stderr)
    lc_modes, _ = plan_llamacpp(settings, llamacpp)
    bar = tqdm(total=total_requests(settings, len(prompts), policies, hf_modes, lc_modes), desc="bench", unit="req",
               file=sys.stderr)
    result = run_benchmark(target, drafter, prompts, settings, sps=sps, hf=hf, on_request_done=lambda: bar.update(1),
                           llamacpp=llamacpp)
    bar.close()
    result["warnings"] = warnings + result["warnings"]
    result["config"] = {
        "target": target_dir, "drafter": drafter_path, "drafter_kind": getattr(drafter, "kind", None),
        "drafter_weights_sha256": _fingerprint(Path(drafter_path) / "model.safetensors") if drafter_path else None,
        "block_size": args.block_size or getattr(drafter, "block_size", None),
        "concurrency": list(settings.concurrencies), "policies": list(settings.policies),
        "max_new_tokens": args.max_new_tokens, "temperature": args.temperature, "repeats": args.repeats,
        "seed": args.seed, "sps": sps_source, "device": str(target.device), "prompts": source,
        "draft_window": settings.draft_window, "draft_gate": settings.draft_gate,
        "slot_correction": settings.slot_correction, "draft_gate_scope": settings.draft_gate_scope,
        "lookup": settings.lookup, "lookup_ngram": settings.lookup_ngram,
        "sps_table": ({"batch_sizes": list(sps.batch_sizes), "steps_per_second": [round(v, 3) for v in sps.steps_per_second]}
                      if hasattr(sps, "batch_sizes") else None),
        "hf": hf_config,
        "weights": target.weights, "weight_bytes_per_step": target.weight_bytes, "threads": torch.get_num_threads(),
        "llamacpp": ({"gguf": llamacpp.gguf_path, "threads": llamacpp.threads,
                      "prompt_lookup_num_tokens": args.llamacpp_prompt_lookup_tokens or None,
                      "version": _llamacpp_version()} if llamacpp is not None else None),
        "protocol": ("closed loop per (policy, concurrency), max(prompts, 2 x concurrency) requests; per-user "
                     "time runs from add to finish (prefill included, no queueing); batch 1 interleaved per "
                     "prompt across policies and HF modes; speedups are medians of paired per-prompt ratios"),
    }
    text = _write_result(result, args.out)
    if args.plot:
        plot = Path(args.plot)
        plot.parent.mkdir(parents=True, exist_ok=True)
        plot_results(result, plot, plot.with_name(plot.stem + "_by_concurrency" + (plot.suffix or ".png")),
                     title=f"{Path(target_dir).name} + {Path(drafter_path).name if drafter_path else 'no drafter'}, "
                           f"{len(prompts)} prompts, {args.max_new_tokens} new tokens, T={args.temperature}")
    if args.json:
        print(text)
    else:
        print(human_summary(result))
    return 0


def run_distributed(args, settings) -> int:
    """`dspark bench --distributed` (dspark_cli/bench_distributed.py): embedded vs distributed processes."""
    import types

    from dspark_core.target import load_tokenizer

    from .bench_distributed import human_summary as dist_summary
    from .bench_distributed import run_distributed_bench

    target_dir = resolve_target(args.target)
    policy = settings.policies[0]
    drafter_path = None if policy == "ar" else resolve_drafter_path(args.drafter, args.drafter_path, target_dir)
    if policy != "ar" and drafter_path is None:
        raise InvalidArgument("--policy", policy, "needs a drafter (none is found for this target); use ar")
    tokenizer = load_tokenizer(target_dir)
    if tokenizer is None:
        raise InvalidArgument("--target", target_dir, "needs a tokenizer for the prompt list")
    from transformers import AutoConfig

    text_config = AutoConfig.from_pretrained(target_dir).get_text_config()
    light = types.SimpleNamespace(tokenizer=tokenizer,
                                  max_context=int(getattr(text_config, "max_position_embeddings", 2048) or 2048))
    prompts, source = load_prompt_list(args, light)
    say = (lambda m: print(f"dspark bench: {m}", file=sys.stderr))
    say(f"starting the embedded and the distributed deployment ({len(prompts)} prompts, policy {policy})")
    lookup_ngram = settings.lookup_ngram if settings.lookup == "on" else 0  # "both" is refused with --distributed
    result = run_distributed_bench(target_dir, drafter_path, prompts, policy, list(settings.concurrencies),
                                   settings.repeats, settings.max_new_tokens, settings.temperature, settings.seed,
                                   settings.block_size, progress=say, draft_window=settings.draft_window,
                                   lookup_ngram=lookup_ngram)
    import os

    result["config"] = {
        "target": target_dir, "drafter": drafter_path, "policy": policy, "block_size": args.block_size,
        "concurrency": list(settings.concurrencies), "max_new_tokens": settings.max_new_tokens,
        "temperature": settings.temperature, "repeats": settings.repeats, "seed": settings.seed, "prompts": source,
        "draft_window": settings.draft_window, "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "lookup_ngram": lookup_ngram,
        "cpus": os.cpu_count(),
        "protocol": ("both deployments up at once on loopback; per repeat and concurrency, embedded then "
                     "distributed, closed loop over gRPC GenerateUnary with max(prompts, 2 x concurrency) requests; "
                     "stage_breakdown: deltas of dspark_scheduler_stage_seconds_total over the load windows"),
    }
    text = _write_result(result, args.out)
    print(text if args.json else dist_summary(result))
    return 0


def _llamacpp_version() -> str | None:
    try:
        import llama_cpp

        return str(llama_cpp.__version__)
    except Exception:  # noqa: BLE001 - informative only
        return None


def _fingerprint(path: Path) -> str | None:
    """First 16 hex digits of a file's SHA-256: which checkpoint a result was measured with."""
    import hashlib

    if not path.is_file():
        return None
    h = hashlib.sha256()
    with path.open("rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()[:16]


def _fmt(x, spec=".2f", suffix=""):
    return "-" if x is None else f"{x:{spec}}{suffix}"


def human_summary(r: dict) -> str:
    lines = [f"{'policy':<20} {'conc':>4} {'agg tok/s':>10} {'user tok/s':>10} {'verify len':>10} {'tau':>6} "
             f"{'match ar':>8}"]
    for x in r["results"]:
        match = {True: "yes", False: "NO", None: "-"}[x.get("outputs_match_ar")]
        lines.append(f"{x['policy']:<20} {x['concurrency']:>4} {x['aggregate_tokens_per_s']:>10.1f} "
                     f"{x['per_user_tokens_per_s']:>10.1f} {x['mean_verify_len']:>10.2f} {_fmt(x.get('tau')):>6} "
                     f"{match:>8}")
    lines.append("")
    lines.append(f"batch-1 speedup over autoregressive ({r.get('batch1_policy')}): "
                 f"{_fmt(r.get('speedup_vs_ar_batch1'), '.2f', 'x')}")
    if r.get("hf"):
        lines.append("Hugging Face at batch 1 (tokens/s): "
                     + ", ".join(f"{m} {v:.1f}" for m, v in r["hf"].items()))
        lines.append(f"batch-1 speedup over HF assisted ({r.get('hf_assisted_mode_compared')}): "
                     f"{_fmt(r.get('speedup_vs_hf_assisted_batch1'), '.2f', 'x')}")
    if r.get("llamacpp"):
        lines.append("llama.cpp at batch 1 (tokens/s): " + ", ".join(f"{m} {v:.1f}" for m, v in r["llamacpp"].items()))
        lines.append(f"batch-1 autoregressive / llama.cpp plain: {_fmt(r.get('ar_vs_llamacpp_batch1'), '.2f', 'x')}; "
                     f"speculative / llama.cpp plain: {_fmt(r.get('speedup_vs_llamacpp_batch1'), '.2f', 'x')}")
    rh = r.get("request_history_vs_off_batch1") or {}
    if rh:
        lines.append("batch-1 request history on / off (paired): " + ", ".join(f"{p} {_fmt(v, '.3f', 'x')}"
                                                                           for p, v in rh.items()))
    dg = r.get("draft_gate_vs_off") or {}
    if dg:
        lines.append("draft gate on / off (aggregate; c=1 paired): " + "; ".join(
            f"{p} " + ", ".join(f"c={c} {_fmt(v, '.3f', 'x')}" for c, v in by_c.items()) for p, by_c in dg.items()))
    sc = r.get("slot_correction_vs_off") or {}
    if sc:
        lines.append("slot correction on / off (aggregate; c=1 paired): " + "; ".join(
            f"{p} " + ", ".join(f"c={c} {_fmt(v, '.3f', 'x')}" for c, v in by_c.items()) for p, by_c in sc.items()))
    gs = r.get("draft_gate_batch_vs_request_scope") or {}
    if gs:
        lines.append("draft gate batch / request scope (aggregate; c=1 paired): " + "; ".join(
            f"{p} " + ", ".join(f"c={c} {_fmt(v, '.3f', 'x')}" for c, v in by_c.items()) for p, by_c in gs.items()))
    cv = r.get("causal_vs_best_static") or {}
    if any(v is not None for v in cv.values()):
        lines.append("causal / best static aggregate: " + ", ".join(f"c={c} {_fmt(v)}" for c, v in cv.items()))
    mt = r.get("per_user_speedup_vs_gamma1_at_matched_throughput") or {}
    if mt:
        lines.append("causal per-user speed / gamma1's at matched throughput: "
                     + ", ".join(f"c={c} {_fmt(v)}" for c, v in mt.items()))
    for w in r.get("warnings", []):
        lines.append(f"warning: {w}")
    return "\n".join(lines)
