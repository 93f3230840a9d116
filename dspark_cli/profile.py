"""`dspark profile`: measure the target's SPS(B) curve and save it beside the model."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from dspark_core.errors import InvalidArgument

from .models import SPS_FILE, generated_dir, resolve_target
from .options import add_device_args, add_target_arg, add_weights_arg


def add_parser(sub) -> None:
    p = sub.add_parser("profile", help="measure the target's verification steps per second SPS(B)",
                       description="Measure SPS(B), verification steps per second with B tokens per forward "
                                   "pass, and save it as a cost table (sps.json) in the model's install location: "
                                   "beside a model of your own, $DSPARK_HOME/models/NAME for a shipped one.")
    add_target_arg(p)
    p.add_argument("--max-batch", type=int, default=256,
                   help="largest B in tokens (default 256: 32 requests x 8 tokens); every B up to --dense-until, "
                        "then every --stride-th")
    p.add_argument("--dense-until", type=int, default=64, help="measure every B up to this (default 64)")
    p.add_argument("--stride", type=int, default=8, help="B step above --dense-until (default 8)")
    p.add_argument("--context-length", type=int, default=256, help="context per sequence (default 256)")
    p.add_argument("--block", type=int, default=8, help="most tokens one sequence verifies (default 8)")
    p.add_argument("--max-sequences", type=int, default=32,
                   help="B tokens go one per sequence up to this many sequences, then a few each (default 32)")
    p.add_argument("--requests", default="1,2,4,8,16,32",
                   help="also profile rows with exactly R requests per pass, B = R .. R x --block, for these R "
                        "(comma-separated; 'none' to skip). Schedulers read the row of the step's request "
                        "count: at batch 1, 8 tokens are one context's attention, not 8 (default 1,2,4,8,16,32)")
    p.add_argument("--repeats", type=int, default=7, help="timed repeats per B; the median counts (default 7)")
    p.add_argument("--out", default=None,
                   help="where to write the table (default: sps.json in the target's install location; the "
                        "commands and services read it from there)")
    p.add_argument("--plot", default=None, help="PNG path for the curve (default: beside --out)")
    add_device_args(p)
    add_weights_arg(p)
    p.add_argument("--threads", type=int, default=None,
                   help="torch intra-op threads (default: torch's own; on a busy shared CPU, 1 is steadier)")
    p.add_argument("--raw", action="store_true",
                   help="save the raw medians; default: the monotone fit (step time never falls as B grows, "
                        "which removes dips that outside load causes) with the raw table beside it")
    p.add_argument("--json", action="store_true", help="print the table as JSON")
    p.set_defaults(func=run)


def _requests(text: str) -> list[int]:
    from dspark_core.benchmark import parse_int_list

    return [] if text.strip().lower() == "none" else sorted(parse_int_list(text, "--requests"))


def run(args) -> int:
    from tqdm import tqdm

    from dspark_core.cost_model import monotone, plot_sps, profile_sps
    from dspark_core.profiling import VerifyStepBench, kernels_in_use, requests_grid
    from dspark_core.target import TargetConfig, TargetRuntime

    if args.max_batch < 1:
        raise InvalidArgument("--max-batch", args.max_batch, "must be >= 1")
    if args.stride < 1:
        raise InvalidArgument("--stride", args.stride, "must be >= 1")
    if args.max_sequences < 1:
        raise InvalidArgument("--max-sequences", args.max_sequences, "must be >= 1")
    requests = _requests(args.requests)
    if args.threads is not None:
        if args.threads < 1:
            raise InvalidArgument("--threads", args.threads, "must be >= 1")
        import torch

        torch.set_num_threads(args.threads)
    target_dir = resolve_target(args.target)
    target = TargetRuntime(TargetConfig(target_dir, device=args.device, dtype=args.dtype, weights=args.weights))
    bench = VerifyStepBench(target, context_length=args.context_length, block=args.block,
                            max_sequences=args.max_sequences)
    dense = min(args.max_batch, max(1, args.dense_until))
    sizes = list(range(1, dense + 1)) + list(range(dense + args.stride, args.max_batch + 1, args.stride))
    if sizes[-1] != args.max_batch:
        sizes.append(args.max_batch)
    grid = requests_grid(requests, args.block)
    bar = tqdm(total=args.repeats * (1 + len(grid)), desc="profile", unit="sweep")
    meta = dict(device=str(target.device), dtype=str(target.dtype).replace("torch.", ""),
                context_length=args.context_length, model=target.name, weights=target.weights,
                kernels=kernels_in_use(target))
    table = profile_sps(bench, sizes, repeats=args.repeats, warmup=2, progress=lambda: bar.update(1), **meta)
    rows = tuple((r, profile_sps(lambda b, r=r: bench(b, requests=r), bs, repeats=args.repeats, warmup=2,
                                 progress=lambda: bar.update(1), **meta)) for r, bs in grid.items())
    if rows:
        table = dataclasses.replace(table, by_requests=rows)
    bar.close()
    bench.close()
    out = Path(args.out) if args.out else generated_dir(target_dir) / SPS_FILE
    out.parent.mkdir(parents=True, exist_ok=True)
    plot = Path(args.plot) if args.plot else out.with_suffix(".png")
    if args.raw:
        table.save(out)
        plot_sps(table, plot)
    else:
        raw, table = table, monotone(table)
        table.save(out)
        raw.save(out.with_name(out.stem + "_raw.json"))
        plot_sps(table, plot, raw=raw)
    if args.json:
        print(table.to_json())
    else:
        s1, sb = table(1), table(args.max_batch)
        print(f"SPS(1) = {s1:.1f} steps/s, SPS({args.max_batch}) = {sb:.1f} steps/s "
              f"({args.max_batch * sb / s1:.1f}x the tokens/s of B=1); saved {out} and {plot}")
    return 0
