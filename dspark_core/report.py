"""Tables and plots from saved evaluation results (the JSON objects `dspark eval --out` writes).

- `table1_markdown`: paper Table 1 style: tau per dataset (rows, grouped by domain) x drafter (columns),
  domain macro averages (code / math / chat / other), the overall macro average over domains, and
  DSpark's gain over DFlash and Eagle3 in percent.
- plots (PNG, matplotlib Agg): conditional acceptance by position per drafter (paper Fig. 2), tau against
  block size (Fig. 4), the static confidence-threshold sweep (Fig. 5, offline from rollout records), and
  reliability diagrams for calibration.
- `head_cost_markdown`: the share of a round that DSpark's sequential head adds over DFlash.

Knows nothing about models or engines: dictionaries in, markdown and PNG files out.
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from pathlib import Path

from .errors import InvalidArgument

DOMAIN_ORDER = ("code", "math", "chat", "other")
BASELINES = ("dflash", "eagle3")


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


# ---- loading ---------------------------------------------------------------------------------------

def load_results(paths) -> list[dict]:
    """Every evaluation JSON under the given files / folders (objects with a `tau`; others skipped)."""
    files: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            files.extend(sorted(p.rglob("*.json")))
        elif p.is_file():
            files.append(p)
        else:
            raise InvalidArgument("results", str(p), "must be an existing file or folder")
    out = []
    for f in files:
        try:
            data = json.loads(f.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise InvalidArgument("results", str(f), f"must be readable JSON ({exc})") from None
        for obj in data if isinstance(data, list) else [data]:
            if isinstance(obj, dict) and "tau" in obj and "drafter" in obj:
                out.append({**obj, "_file": str(f)})
    if not out:
        raise InvalidArgument("results", [str(p) for p in paths], "must contain at least one eval JSON (with tau)")
    return out


def _kind(r: dict) -> str:
    return r.get("drafter_kind") or r["drafter"]


def _mean(xs):
    xs = [x for x in xs if x is not None and not (isinstance(x, float) and math.isnan(x))]
    return sum(xs) / len(xs) if xs else None


def _main_block(results: list[dict]) -> int | None:
    """The block size with the most results (Table 1 and Fig. 2 use one block size). Ties go to the block
    size more results were *trained* at (`trained_block_size`: a block-size sweep of block-7 drafters keeps
    Table 1 at block 7), then to the smaller block size."""
    counts: dict[int, int] = defaultdict(int)
    native: dict[int, int] = defaultdict(int)
    for r in results:
        counts[r.get("block_size")] += 1
        native[r.get("block_size")] += int(r.get("trained_block_size") == r.get("block_size"))
    return max(counts, key=lambda b: (counts[b], native[b], -(b or 0))) if counts else None


def _drafter_order(names) -> list[str]:
    rank = {"dspark": 0, "dspark-rnn": 1, "dflash": 2, "eagle3": 3}
    return sorted(set(names), key=lambda n: (rank.get(n, 9), n))


# ---- Table 1 ---------------------------------------------------------------------------------------

def table1(results: list[dict], block_size: int | None = None) -> dict:
    """{"drafters", "rows": [{"dataset", "domain", "tau": {drafter: tau}}], "domains": {...}, "macro": {...},
    "gain": {baseline: {row label: %}}} for one block size."""
    block_size = block_size if block_size is not None else _main_block(results)
    chosen = [r for r in results if r.get("block_size") == block_size]
    drafters = _drafter_order(r["drafter"] for r in chosen)
    kinds = {r["drafter"]: _kind(r) for r in chosen}
    cells: dict[tuple[str, str], dict[str, float]] = defaultdict(dict)
    for r in chosen:  # the last file wins on duplicates
        cells[(r.get("domain", "other"), r["dataset"])][r["drafter"]] = r["tau"]
    keys = sorted(cells, key=lambda k: (DOMAIN_ORDER.index(k[0]) if k[0] in DOMAIN_ORDER else 9, k[1]))
    rows = [{"dataset": ds, "domain": dom, "tau": cells[(dom, ds)]} for dom, ds in keys]
    domains = {}
    for dom in [d for d in DOMAIN_ORDER if any(k[0] == d for k in keys)]:
        domains[dom] = {d: _mean([row["tau"].get(d) for row in rows if row["domain"] == dom]) for d in drafters}
    macro = {d: _mean([domains[dom][d] for dom in domains]) for d in drafters}
    dspark = next((d for d in drafters if kinds[d] == "dspark"), None)
    gain: dict[str, dict[str, float | None]] = {}
    for base in BASELINES:
        bname = next((d for d in drafters if kinds[d] == base), None)
        if dspark is None or bname is None:
            continue
        g = {}
        for label, vals in [*((row["dataset"], row["tau"]) for row in rows),
                            *((f"{dom} avg", v) for dom, v in domains.items()), ("macro avg", macro)]:
            a, b = vals.get(dspark), vals.get(bname)
            g[label] = None if a is None or not b else 100.0 * (a / b - 1.0)
        gain[bname] = g
    return {"block_size": block_size, "drafters": drafters, "dspark": dspark, "rows": rows, "domains": domains,
            "macro": macro, "gain": gain}


def _fmt(x, pct=False) -> str:
    if x is None:
        return "-"
    return f"{x:+.1f}%" if pct else f"{x:.2f}"


def table1_markdown(results: list[dict], block_size: int | None = None) -> str:
    t = table1(results, block_size)
    drafters, gain = t["drafters"], t["gain"]
    head = ["dataset", "domain", *drafters, *(f"{t['dspark']} vs {b}" for b in gain)]
    lines = [f"Mean accepted length tau (bonus token included), block size {t['block_size']}.", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in t["rows"]:
        vals = [_fmt(row["tau"].get(d)) for d in drafters] + [_fmt(gain[b][row["dataset"]], True) for b in gain]
        lines.append(f"| {row['dataset']} | {row['domain']} | " + " | ".join(vals) + " |")
    for dom, vals in t["domains"].items():
        cells = [_fmt(vals[d]) for d in drafters] + [_fmt(gain[b][f"{dom} avg"], True) for b in gain]
        lines.append(f"| **{dom} avg** | {dom} | " + " | ".join(cells) + " |")
    cells = [_fmt(t["macro"][d]) for d in drafters] + [_fmt(gain[b]["macro avg"], True) for b in gain]
    lines.append("| **macro avg** | all | " + " | ".join(f"**{c}**" for c in cells) + " |")
    return "\n".join(lines) + "\n"


# ---- plots -------------------------------------------------------------------------------------------

def _by_drafter(results):
    groups: dict[str, list[dict]] = defaultdict(list)
    for r in results:
        groups[r["drafter"]].append(r)
    return {d: groups[d] for d in _drafter_order(groups)}


def plot_conditional_acceptance(results: list[dict], out: str | Path, block_size: int | None = None) -> Path:
    """Fig. 2: conditional acceptance by position, per drafter (macro average over datasets)."""
    plt = _plt()
    block_size = block_size if block_size is not None else _main_block(results)
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, rs in _by_drafter([r for r in results if r.get("block_size") == block_size]).items():
        curves = [r["conditional_acceptance"] for r in rs]
        n = max(len(c) for c in curves)
        ys = [_mean([c[k] for c in curves if k < len(c)]) for k in range(n)]
        xs = [k + 1 for k, y in enumerate(ys) if y is not None]
        ax.plot(xs, [y for y in ys if y is not None], marker="o", label=name)
    ax.set(xlabel="draft position k", ylabel="conditional acceptance P(k ok | < k ok)", ylim=(0, 1.02),
           title=f"Conditional acceptance by position (block {block_size})")
    ax.grid(alpha=0.3)
    ax.legend()
    return _save(fig, out)


def plot_tau_vs_block(results: list[dict], out: str | Path) -> Path:
    """Fig. 4: tau against block size, per drafter (macro average over domains of the dataset means)."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, rs in _by_drafter(results).items():
        sizes = sorted({r["block_size"] for r in rs})
        ys = [table1(rs, b)["macro"].get(name) for b in sizes]
        line, = ax.plot(sizes, ys, marker="o", label=name)
        extra = [(b, y) for b, y in zip(sizes, ys) if any(r.get("block_size_extrapolated") for r in rs
                                                           if r["block_size"] == b)]
        if extra:  # hollow markers: beyond the block size the drafter was trained for
            ax.plot(*zip(*extra), "o", mfc="white", mec=line.get_color(), ms=8)
    ax.set(xlabel="block size (draft tokens per round; hollow = extrapolated)", ylabel="tau (macro avg)",
           title="Accepted length vs block size")
    ax.grid(alpha=0.3)
    ax.legend()
    return _save(fig, out)


def sweep_results(results: list[dict], thresholds=None, block_size: int | None = None) -> dict[str, list[dict]]:
    """Per drafter with rollout records at one block size: the offline threshold sweep over its pooled
    rounds, each run's confidences scaled by that run's own STS temperatures."""
    from .evaluation import RoundLog, log_from_json, threshold_sweep

    block_size = block_size if block_size is not None else _main_block(results)
    out = {}
    for name, rs in _by_drafter([r for r in results if r.get("block_size") == block_size]).items():
        pooled = RoundLog(confidence_logits=[])
        for r in rs:
            if not r.get("rollouts") or r["rollouts"].get("confidence_logits") is None:
                continue
            lg = log_from_json(r["rollouts"])
            temps = r.get("calibration_temperatures") or [1.0]
            biases = r.get("calibration_biases") or [0.0]
            pooled.accepted += lg.accepted
            pooled.proposed += lg.proposed
            pooled.committed += lg.committed
            pooled.confidence_logits += [[x / temps[min(k, len(temps) - 1)] + biases[min(k, len(biases) - 1)]
                                          for k, x in enumerate(row)]
                                         for row in lg.confidence_logits]
        if pooled.rounds:
            out[name] = threshold_sweep(pooled, None, thresholds)
    return out


def plot_threshold_sweep(sweeps: dict[str, list[dict]], out: str | Path) -> Path:
    """Fig. 5: static confidence threshold vs tau and vs tokens verified per round."""
    plt = _plt()
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4))
    for name, rows in sweeps.items():
        xs = [r["threshold"] for r in rows]
        a1.plot(xs, [r["tau"] for r in rows], marker=".", label=name)
        a2.plot(xs, [r["verified_per_round"] for r in rows], marker=".", label=name)
    a1.set(xlabel="confidence threshold", ylabel="tau", title="Accepted length")
    a2.set(xlabel="confidence threshold", ylabel="tokens verified per round", title="Verification cost")
    for a in (a1, a2):
        a.grid(alpha=0.3)
        a.legend()
    return _save(fig, out)


def plot_reliability(before: list[dict], after: list[dict] | None, out: str | Path, title: str = "",
                     after_label: str = "calibrated") -> Path:
    """Reliability diagrams per position (observed prefix acceptance vs predicted survival): raw, and the
    calibrated confidences (labelled `after_label`) when `after` is given."""
    plt = _plt()
    n = len(before)
    fig, axes = plt.subplots(1, n, figsize=(3.2 * n, 3.4), squeeze=False)
    for k, ax in enumerate(axes[0]):
        curves = [(before[k], "raw", "o--")] + ([(after[k], after_label, "s-")] if after is not None else [])
        for data, label, style in curves:
            pts = [(c, y) for c, y in zip(data["confidence"], data["accuracy"]) if c is not None]
            if pts:
                ax.plot(*zip(*pts), style, ms=3, label=label)
        ax.plot([0, 1], [0, 1], color="grey", lw=0.8)
        ax.set(xlim=(0, 1), ylim=(0, 1), title=f"position {k + 1}", xlabel="predicted")
        if k == 0:
            ax.set_ylabel("observed")
            ax.legend(fontsize=8)
    if title:
        fig.suptitle(title)
    return _save(fig, out)


def _save(fig, out) -> Path:
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    _plt().close(fig)
    return out


# ---- markdown for the rest ----------------------------------------------------------------------------

def head_cost_markdown(rows: list[dict]) -> str:
    lines = ["Cost of the sequential head (median seconds; share = head extra / round).", "",
             "| batch | backbone | loop + heads | loop, no heads (DFlash) | verify | head extra | share of propose "
             "| share of round |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        v = "-" if r["verify_s"] is None else f"{r['verify_s'] * 1e3:.2f} ms"
        s = "-" if r["share_of_round"] is None else f"{100 * r['share_of_round']:.2f}%"
        lines.append(f"| {r['batch_size']} | {r['backbone_s'] * 1e3:.2f} ms | {r['heads_s'] * 1e3:.2f} ms | "
                     f"{r['no_heads_s'] * 1e3:.2f} ms | {v} | {r['head_extra_s'] * 1e3:.3f} ms | "
                     f"{100 * r['share_of_propose']:.2f}% | {s} |")
    return "\n".join(lines) + "\n"


def sweep_markdown(sweeps: dict[str, list[dict]], show=(0.0, 0.2, 0.4, 0.5, 0.6, 0.8)) -> str:
    lines = ["| drafter | " + " | ".join(f"h = {h:.1f}" for h in show) + " |", "|---|" + "---|" * len(show)]
    for name, rows in sweeps.items():
        by_h = {round(r["threshold"], 2): r for r in rows}
        cells = [f"{by_h[h]['tau']:.2f} / {by_h[h]['verified_per_round']:.2f}" if h in by_h else "-" for h in show]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "tau / tokens verified per round, by static threshold h on the calibrated per-position confidence:\n\n" \
        + "\n".join(lines) + "\n"


def write_report(results: list[dict], out_dir: str | Path, head_cost: list[dict] | None = None) -> dict:
    """report.md + PNGs in out_dir. Returns {"markdown": path, "plots": [paths]}."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    parts, plots = ["# DSpark evaluation report", ""], []
    # Runs at different sampling temperatures never share a table (tau at T = 0 and at T = 1 measure different
    # things): the paper's T = 1 (else the lowest present) drives Table 1 and the figures, every other
    # temperature gets its own table and conditional-acceptance plot.
    temps = sorted({r.get("temperature", 1.0) for r in results})
    main_t = 1.0 if 1.0 in temps or not temps else temps[0]
    others = {t: [r for r in results if r.get("temperature", 1.0) == t] for t in temps if t != main_t}
    results = [r for r in results if r.get("temperature", 1.0) == main_t]
    if results:
        sizes = sorted({r.get("block_size") for r in results if r.get("block_size") is not None})
        parts += ["## Table 1", "", table1_markdown(results),
                  f"Results: {len(results)} runs at T = {main_t:g}; block sizes {sizes}. "
                  "Eval split only, fixed policy (no scheduler).", ""]
        for t, rs in others.items():
            name = f"conditional_acceptance_t{t:g}.png"
            plots.append(plot_conditional_acceptance(rs, out_dir / name))
            parts += [f"## Table 1 at T = {t:g}", "", table1_markdown(rs),
                      f"Results: {len(rs)} runs at T = {t:g}.", "", f"![]({name})", ""]
        plots.append(plot_conditional_acceptance(results, out_dir / "conditional_acceptance.png"))
        parts += ["## Conditional acceptance by position", "", "![](conditional_acceptance.png)", ""]
        if len(sizes) > 1:
            plots.append(plot_tau_vs_block(results, out_dir / "tau_vs_block_size.png"))
            parts += ["## tau vs block size", "", "![](tau_vs_block_size.png)", ""]
        extrap = sorted({(r["drafter"], r["block_size"]) for r in results if r.get("block_size_extrapolated")})
        if extrap:
            parts += [f"Extrapolated block sizes (beyond what the drafter was trained for): {extrap}", ""]
        sweeps = sweep_results(results)
        if sweeps:
            plots.append(plot_threshold_sweep(sweeps, out_dir / "threshold_sweep.png"))
            parts += ["## Confidence-threshold sweep (offline, from fixed-policy rollouts)", "",
                      "![](threshold_sweep.png)", "", sweep_markdown(sweeps)]
            (out_dir / "threshold_sweep.json").write_text(json.dumps(sweeps, indent=1) + "\n")
    if head_cost:
        parts += ["## Sequential-head cost", "", head_cost_markdown(head_cost)]
        (out_dir / "head_cost.json").write_text(json.dumps(head_cost, indent=1) + "\n")
    md = out_dir / "report.md"
    md.write_text("\n".join(parts) + "\n")
    return {"markdown": md, "plots": plots}
