"""`dspark report`: Table 1 + plots from saved `dspark eval --out` JSONs, and the sequential-head cost.

`--results` takes files and folders (searched recursively for *.json); `--out DIR` receives report.md,
conditional_acceptance.png, tau_vs_block_size.png (when several block sizes are present),
threshold_sweep.png (when results carry rollout records of a confidence drafter). `--head-cost` times a
DSpark drafter's round parts at `--batch-sizes` (with the target's verify pass when a target is found).
"""

from __future__ import annotations

import json

from dspark_core.errors import InvalidArgument

from .models import resolve_target, resolve_drafter_path
from .options import add_device_args, add_drafter_args, add_weights_arg


def add_parser(sub) -> None:
    p = sub.add_parser("report", help="Table 1, acceptance plots and head cost from eval results",
                       description="Render a Table-1-style markdown table and plots from `dspark eval --out` JSONs.")
    p.add_argument("--results", nargs="+", default=None, metavar="PATH", help="eval JSON files or folders")
    p.add_argument("--out", required=True, help="output folder for report.md and PNGs")
    p.add_argument("--head-cost", action="store_true",
                   help="also time the sequential head of --drafter / --drafter-path (share of a round)")
    add_drafter_args(p, what="drafter whose head --head-cost times")
    p.add_argument("--target", default=None, help="target for the verify time in --head-cost (default: bundled "
                                                  "if present; without one only the share of propose is given)")
    p.add_argument("--batch-sizes", default="1,32", help="batch sizes for --head-cost (default 1,32)")
    p.add_argument("--context-length", type=int, default=128, help="context per request for --head-cost")
    p.add_argument("--repeats", type=int, default=20, help="timed repeats per measurement (median)")
    add_device_args(p)
    add_weights_arg(p)
    p.add_argument("--json", action="store_true", help="print what was written as JSON")
    p.set_defaults(func=run)


def _batch_sizes(text: str) -> list[int]:
    try:
        sizes = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise InvalidArgument("--batch-sizes", text, "must be comma-separated integers") from None
    if not sizes or min(sizes) < 1:
        raise InvalidArgument("--batch-sizes", text, "must be integers >= 1")
    return sizes


def head_cost(args) -> list[dict]:
    from pathlib import Path

    from dspark_core.drafters import load_drafter
    from dspark_core.evaluation import measure_head_cost
    from dspark_core.target import TargetConfig, TargetRuntime, resolve_device, resolve_dtype

    sizes = _batch_sizes(args.batch_sizes)
    path = resolve_drafter_path(args.drafter, args.drafter_path)
    if path is None:
        raise InvalidArgument("--drafter", None, "is required with --head-cost")
    dev = resolve_device(args.device)
    drafter = load_drafter(path, device=dev, dtype=resolve_dtype(args.dtype, dev))
    target_dir = resolve_target(args.target)
    target = None
    if args.target or (Path(target_dir) / "config.json").is_file():
        from .generate import _quiet_transformers

        _quiet_transformers()
        target = TargetRuntime(TargetConfig(target_dir, device=args.device, dtype=args.dtype, weights=args.weights))
        if args.context_length + drafter.block_size + 2 >= target.max_context:
            raise InvalidArgument("--context-length", args.context_length,
                                  f"must leave room for a block in the target's window ({target.max_context})")
    return measure_head_cost(drafter, sizes, context_length=args.context_length, repeats=args.repeats,
                             target=target, progress=True)


def run(args) -> int:
    from dspark_core.report import load_results, write_report

    if not args.results and not args.head_cost:
        raise InvalidArgument("--results", None, "give eval results (--results) and/or --head-cost")
    if args.repeats < 1:
        raise InvalidArgument("--repeats", args.repeats, "must be >= 1")
    results = load_results(args.results) if args.results else []
    cost = head_cost(args) if args.head_cost else None
    written = write_report(results, args.out, cost)
    if args.json:
        print(json.dumps({"markdown": str(written["markdown"]), "plots": [str(p) for p in written["plots"]],
                          "head_cost": cost}))
    else:
        print(written["markdown"].read_text())
        print(f"wrote {written['markdown']}" + "".join(f", {p}" for p in written["plots"]))
    return 0
