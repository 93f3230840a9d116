"""Plot a `scripts/measure_weights.py` JSON: the step time of one request verifying 1..16 tokens, per weight
format (what the schedulers' cost table sees), beside each format's autoregressive tokens/s.

    .venv/bin/python scripts/plot_weight_formats.py docs/results/weights/formats_q8dot.json \
        --out docs/results/weights/formats_q8dot.png
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("json")
    ap.add_argument("--out", default=None, help="PNG path (default: beside the JSON)")
    args = ap.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = json.loads(Path(args.json).read_text())
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(10, 4))
    for name, f in data["formats"].items():
        rows = sorted(int(r) for r in f["step_ms"])
        ax.plot(rows, [f["step_ms"][str(r)] for r in rows], marker="o", label=f"{name} ({f['weight_mb_per_step']:.0f} MB)")
        bx.bar(name, f["ar_tokens_per_s"])
    ax.set_xlabel("tokens verified in one pass (one request)")
    ax.set_ylabel("step time, ms")
    ax.set_title(f"context {data['context_length']}, {data['threads']} thread(s)")
    ax.set_ylim(bottom=0)
    ax.legend()
    bx.set_ylabel("autoregressive tokens/s (1 / one-token step)")
    bx.tick_params(axis="x", rotation=20)
    fig.tight_layout()
    out = Path(args.out) if args.out else Path(args.json).with_suffix(".png")
    fig.savefig(out, dpi=110)
    print(f"saved {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
