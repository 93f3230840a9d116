"""`dspark calibrate`: fit the confidence calibration on held-out rollouts and save it for the drafter.

Rollouts: the drafter decodes the eval split of each `--dataset` (first turn, `--limit K` first eval prompts
per file) with the fixed policy (every draft verified) at T = 1.0, `--samples` times with different seeds,
logging each round's raw confidence logits and accepted count. Those eval prompts are split once more,
alternately by prompt: even-numbered prompts fit the calibration, odd-numbered ones check it (the
before/after table is on the check half, out of sample). `--no-holdout` fits and reports on everything (in
sample, labelled as such).
`--method platt` (the default) fits a temperature and a bias per position by maximum likelihood, in order
(sequential Platt scaling); `--method sts` the paper's temperatures alone (ECE grid search). The table's
`*_sts` columns are the fitted calibration's, whichever method made it.
Writes `calibration.json` = {"method": "platt", "temperatures": [...], "biases": [...], ...} (STS: no
biases) to `--out DIR`, default the drafter's
install location (`dspark_cli.models.generated_dir`: beside a drafter of one's own, `$DSPARK_HOME/models/NAME` for
a shipped one, so that no tracked file changes); the commands and services read it from there.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from dspark_core.errors import InvalidArgument

from .eval import add_common_args, check_common, load_models, load_prompt_sets
from .models import generated_dir


def add_parser(sub) -> None:
    p = sub.add_parser("calibrate", help="fit the confidence calibration of a DSpark drafter",
                       description="Collect fixed-policy rollouts on the eval split, fit a sequential calibration "
                                   "(Platt scaling: a temperature and a bias per position; or STS: temperatures "
                                   "alone), write calibration.json to the drafter's install location (or --out) "
                                   "and print ECE / AUC by position.")
    add_common_args(p, max_new_tokens=256)
    p.add_argument("--samples", type=int, default=2,
                   help="rollouts per prompt, each with its own seed (default 2; temperature 0 runs one, the rest "
                        "would repeat it). ECE's sampling noise falls with the rounds: ~34k per half keeps it "
                        "under 1%% on the bundled model")
    p.add_argument("--plots", default=None, metavar="DIR",
                   help="write reliability diagrams here: reliability_before.png (raw), reliability_after.png (calibrated)")
    p.add_argument("--no-holdout", action="store_true",
                   help="fit and report on all rollouts (default: fit on even prompts, report on odd ones)")
    p.add_argument("--method", choices=("platt", "sts"), default="platt",
                   help="platt: a temperature and a bias per position, maximum likelihood, position by position "
                        "(default; a temperature alone cannot remove a head's shift in logit space); sts: the "
                        "paper's sequential temperature scaling (ECE grid search, no bias)")
    p.add_argument("--request-history", choices=("on", "off"), default="on",
                   help="on (default): also fit request-history weights, so that a request's own verified rounds "
                        "correct its confidences (a request accepting more or less than predicted so far moves all "
                        "its positions; algorithms.md section 6); off: the same map for every request")
    p.add_argument("--min-rounds", type=int, default=50,
                   help="positions with fewer fitting rounds keep t = 1, b = 0 (default 50)")
    p.add_argument("--dry-run", action="store_true", help="fit and report, but do not write calibration.json")
    p.add_argument("--save-rounds", default=None, metavar="FILE.npz",
                   help="also write the rollout rounds (raw confidence logits, proposed, accepted, prompt index) "
                        "here, to refit or study offline without running the models again")
    p.add_argument("--from-rounds", default=None, metavar="FILE.npz",
                   help="refit from the rounds a --save-rounds run wrote (another --method, all rounds with "
                        "--no-holdout) instead of running rollouts; no --dataset, no model is loaded")
    p.add_argument("--out", default=None, metavar="DIR",
                   help="directory to write calibration.json to (default: the drafter's install location: beside a "
                        "drafter of your own, $DSPARK_HOME/models/NAME for a shipped one; the commands and services "
                        "read it from there)")
    p.add_argument("--online", default=None, metavar="ROUNDS.jsonl",
                   help="refit from rounds a scheduler recorded while serving (`dspark serve ... --record-rounds`) "
                        "instead of running rollouts: the confidences it used and what the target accepted; "
                        "no --dataset, no model is loaded")
    p.set_defaults(func=run)


def _drafter_without_model(args, flag: str, value: str, what: str):
    """(path, config) of the drafter a model-free refit (`--online`, `--from-rounds`) is for; its config
    carries the calibration installed where the commands and services read it (what rounds were served with)."""
    from dspark_core.drafters.config import load_config

    from .models import find_generated, resolve_drafter_path

    if args.dataset or args.prompt_ids_file:
        raise InvalidArgument(flag, value, f"refits {what}; give no --dataset with it")
    path = resolve_drafter_path(args.drafter, args.drafter_path)
    if path is None:
        raise InvalidArgument("--drafter", None, "is required (a shipped name or --drafter-path DIR)")
    config = load_config(Path(path), find_generated(path, "calibration.json"))
    if not config.enable_confidence_head:
        raise InvalidArgument("--drafter", Path(path).name, "has no confidence head; only DSpark drafters calibrate")
    return path, config


def run_online(args) -> int:
    """`--online`: refit on served rounds, on top of the calibration they were served with."""
    from dspark_core import calibration as cal
    from dspark_core.monitoring import read_rounds, refit_calibration

    path, config = _drafter_without_model(args, "--online", args.online, "from recorded rounds")
    if not Path(args.online).is_file():
        raise InvalidArgument("--online", args.online, "must be a file of recorded rounds")
    name = Path(path).name
    records = read_rounds(args.online)
    mine = [r for r in records if r.drafter == name]
    if not mine:
        raise InvalidArgument("--online", args.online, f"holds no rounds of drafter {name!r} "
                              f"(found: {sorted({r.drafter for r in records})[:5]})")
    result = {"drafter": name, "drafter_path": str(path), "rounds_file": str(args.online), "regimes": {}}
    for greedy in (False, True):
        rows = [r for r in mine if r.greedy == greedy]
        if not rows or (greedy and not config.greedy_confidence_head):
            continue
        old = config.sts_temperatures_greedy if greedy else config.sts_temperatures
        old_b = config.calibration_bias_values_greedy if greedy else config.calibration_bias_values
        calib, table = refit_calibration(rows, old, old_b, method=args.method, min_rounds=args.min_rounds,
                                         history=config.confidence_history(greedy))
        temps = calib.temperatures
        regime = {"rounds": len(rows), "method": calib.method, "temperatures_before": list(old),
                  "biases_before": list(old_b), "temperatures": list(temps), "biases": calib.bias_list(),
                  "table": table}
        if not args.dry_run:
            meta = {"online_rounds": len(rows), "rounds_file": str(args.online),
                    "ece_survival_before": [r["ece_survival_raw"] for r in table],
                    "ece_survival_after": [r["ece_survival_sts"] for r in table]}
            out = Path(args.out) if args.out else generated_dir(path)
            regime["written"] = str(cal.write_calibration(out, calib, {"fitted_on": meta}, greedy=greedy,
                                                          base_dir=path))
        result["regimes"]["greedy" if greedy else "sampled"] = regime
    if args.json:
        print(json.dumps(result, default=float))
    else:
        for key, reg in result["regimes"].items():
            print(f"online {reg['method']} refit for {name} ({key}, {reg['rounds']} recorded rounds): temperatures "
                  + " ".join(f"{a:.3f}->{b:.3f}" for a, b in zip(reg["temperatures_before"], reg["temperatures"]))
                  + "; biases " + " ".join(f"{a:+.3f}->{b:+.3f}" for a, b in zip(reg["biases_before"], reg["biases"])))
            for row in reg["table"]:
                print(f"  k={row['position']} rounds {row['rounds']:6d}  ECE served {row['ece_survival_raw']:.3f}"
                      f"  refit {row['ece_survival_sts']:.3f}")
            if "written" in reg:
                print(f"wrote {reg['written']}")
    return 0


def run(args) -> int:
    if args.online:
        return run_online(args)
    if args.from_rounds:
        collected = load_saved_rounds(args)
    else:
        collected = collect_rounds(args)
    return fit_and_report(args, **collected)


# what a saved rounds file carries besides the arrays, so a refit from it reports like the run that made it
_RUN_KEYS = ("drafter", "datasets", "split", "num_prompts", "temperature", "max_new_tokens", "samples", "seeds",
             "drafter_matmul_dtype", "confidence_output")


def collect_rounds(args) -> dict:
    """Fixed-policy rollouts on the eval split: the records and what describes the run."""
    import torch

    from dspark_core import calibration as cal
    from dspark_core.drafters.layers import matmul_dtype_name
    from dspark_core.evaluation import run_rounds

    check_common(args)
    if args.samples < 1:
        raise InvalidArgument("--samples", args.samples, "must be >= 1")
    target, drafter, path = load_models(args)
    if not drafter.has_confidence:
        raise InvalidArgument("--drafter", Path(path).name, "has no confidence head; only DSpark drafters calibrate")
    sets = load_prompt_sets(args, target.tokenizer)
    prompts = [ids for s in sets for ids in s["prompts"]]
    torch.manual_seed(args.seed)
    # at temperature 0 a drafter with a greedy confidence output reports (and so calibrates) that output
    greedy = args.temperature == 0 and drafter.config.greedy_confidence_head
    samples = 1 if args.temperature == 0 else args.samples

    def rollouts(seed: int):
        return run_rounds(target, drafter, prompts, temperature=args.temperature, max_new_tokens=args.max_new_tokens,
                          seed=seed, concurrency=args.concurrency, stop_token_ids=target.eos_token_ids)

    log = rollouts(args.seed)
    request = list(log.prompt_index)  # one request per (rollout, prompt): rollout j's ids follow rollout j - 1's
    for j in range(1, samples):
        more = rollouts(args.seed + j)
        request += [j * len(prompts) + i for i in more.prompt_index]
        log.extend(more)
    records = cal.RolloutRecords.from_rounds(log.confidence_logits, log.accepted, log.proposed,
                                             gamma=drafter.block_size).with_requests(request)
    run_info = {"drafter": Path(path).name, "datasets": [s["dataset"] for s in sets], "split": sets[0]["split"],
                "num_prompts": len(prompts), "temperature": args.temperature, "max_new_tokens": args.max_new_tokens,
                "samples": samples, "seeds": list(range(args.seed, args.seed + samples)),
                "drafter_matmul_dtype": matmul_dtype_name(drafter),
                "confidence_output": "greedy" if greedy else "sampled"}
    prompt_index = np.asarray(log.prompt_index, dtype=np.int64)
    if args.save_rounds:
        out_rounds = Path(args.save_rounds)
        out_rounds.parent.mkdir(parents=True, exist_ok=True)
        np.savez_compressed(out_rounds, logits=records.logits, proposed=records.proposed,
                            accepted=records.accepted, prompt_index=prompt_index, request_index=records.request,
                            run=np.array(json.dumps(run_info)))
    return {"records": records, "prompt_index": prompt_index, "path": path, "greedy": greedy, "run_info": run_info}


def load_saved_rounds(args) -> dict:
    """The rounds a `--save-rounds` run wrote; no model is loaded. They must be this drafter's (its block)."""
    from dspark_core import calibration as cal

    path, config = _drafter_without_model(args, "--from-rounds", args.from_rounds, "saved rounds")
    try:
        with np.load(args.from_rounds, allow_pickle=False) as f:
            arrays = {k: f[k] for k in ("logits", "proposed", "accepted", "prompt_index", "run")}
            # files from before request ids were saved: their rounds come request by request
            request = f["request_index"] if "request_index" in f.files else cal.requests_from_runs(arrays["prompt_index"])
        run_info = json.loads(str(arrays["run"]))
        records = cal.RolloutRecords(arrays["logits"].astype(np.float64), arrays["proposed"].astype(np.int64),
                                     arrays["accepted"].astype(np.int64), np.asarray(request, dtype=np.int64))
    except (OSError, KeyError, ValueError, InvalidArgument) as exc:
        raise InvalidArgument("--from-rounds", args.from_rounds,
                              f"must be a rounds file written by --save-rounds ({exc})") from None
    if not isinstance(run_info, dict) or arrays["prompt_index"].shape != records.proposed.shape:
        raise InvalidArgument("--from-rounds", args.from_rounds, "must be a rounds file written by --save-rounds")
    if records.gamma != config.gamma:
        raise InvalidArgument("--from-rounds", args.from_rounds,
                              f"holds rounds of {records.gamma} positions; drafter {Path(path).name} drafts "
                              f"{config.gamma}")
    run_info = {k: run_info.get(k) for k in _RUN_KEYS}
    run_info["rounds_file"] = str(args.from_rounds)
    greedy = run_info.get("confidence_output") == "greedy"
    if greedy and not config.greedy_confidence_head:
        raise InvalidArgument("--from-rounds", args.from_rounds,
                              f"holds greedy-output rounds; drafter {Path(path).name} has no greedy output")
    return {"records": records, "prompt_index": arrays["prompt_index"].astype(np.int64), "path": path,
            "greedy": greedy, "run_info": run_info}


def fit_and_report(args, records, prompt_index, path, greedy: bool, run_info: dict) -> int:
    from dspark_core import calibration as cal

    odd = prompt_index % 2 == 1
    holdout = not args.no_holdout and odd.any() and (~odd).any()
    fit_on = records.subset(~odd) if holdout else records
    check_on = records.subset(odd) if holdout else records
    history = getattr(args, "request_history", "off") == "on"
    calib = cal.fit_calibration(fit_on, args.method, min_rounds=args.min_rounds, request_history=history)
    temps = calib.temperatures
    table = cal.calibration_table(check_on, None, calib)
    if holdout:
        # the other fold too (fit on odd prompts, check on even): the mean of both is the steadier estimate
        # of what unseen prompts will see, with twice the held-out rounds
        swapped = cal.calibration_table(fit_on, None, cal.fit_calibration(check_on, args.method,
                                                                          min_rounds=args.min_rounds,
                                                                          request_history=history))
        for row, other in zip(table, swapped):
            row["ece_survival_other_fold"] = other["ece_survival_sts"]
            row["ece_survival_cv"] = 0.5 * (row["ece_survival_sts"] + other["ece_survival_sts"])
    result = {
        "drafter": Path(path).name, "drafter_path": str(path), "method": calib.method,
        "temperatures": list(temps), "biases": calib.bias_list(),
        "request_history": None if calib.history is None else calib.history.to_dict(),
        "confidence_output": "greedy" if greedy else "sampled",
        "datasets": run_info["datasets"], "split": run_info["split"], "num_prompts": run_info["num_prompts"],
        "rounds_fit": len(fit_on), "rounds_check": len(check_on),
        "table_on": "held-out half (odd prompts)" if holdout else "all rollouts (in sample)",
        "min_rounds": args.min_rounds,
        "unfitted_positions": [k + 1 for k in range(records.gamma)
                               if int((fit_on.proposed >= k + 1).sum()) < max(args.min_rounds, 1)],
        "temperature": run_info["temperature"], "max_new_tokens": run_info["max_new_tokens"],
        "samples": run_info["samples"], "seeds": run_info["seeds"],
        "drafter_matmul_dtype": run_info["drafter_matmul_dtype"],
        "table": table,
    }
    if "rounds_file" in run_info:
        result["rounds_file"] = run_info["rounds_file"]
    if not args.dry_run:
        meta = {k: result[k] for k in ("datasets", "num_prompts", "rounds_fit", "rounds_check", "temperature",
                                       "max_new_tokens", "samples", "seeds", "drafter_matmul_dtype")}
        meta["ece_survival_raw"] = [r["ece_survival_raw"] for r in table]
        meta["ece_survival_sts"] = [r["ece_survival_sts"] for r in table]
        if holdout:
            meta["ece_survival_cv"] = [r["ece_survival_cv"] for r in table]
        meta["table_on"] = result["table_on"]
        out = Path(args.out) if args.out else generated_dir(path)
        result["written"] = str(cal.write_calibration(out, calib, {"fitted_on": meta}, greedy=greedy, base_dir=path))
    if args.plots:
        from dspark_core.report import plot_reliability

        label = calib.method + (" + request history" if calib.history is not None else "")
        before = cal.reliability_by_position(check_on, None)
        after = cal.reliability_by_position(check_on, calib)
        out = Path(args.plots)
        result["plots"] = [
            str(plot_reliability(before, None, out / "reliability_before.png",
                                 f"{result['drafter']}: raw ({result['table_on']})")),
            str(plot_reliability(before, after, out / "reliability_after.png",
                                 f"{result['drafter']}: {label} vs raw ({result['table_on']})",
                                 after_label=label)),
        ]
    if args.json:
        print(json.dumps(result, default=float))
    else:
        print(table_text(result))
    return 0


def table_text(r: dict) -> str:
    def f(x):
        return "   -  " if x is None or x != x else f"{x:6.3f}"

    hist = r.get("request_history")
    lines = [f"{r.get('method', 'sts')} calibration{' + request history' if hist else ''} for {r['drafter']}: {r['num_prompts']} prompts ({', '.join(r['datasets'])}; split {r['split']}), "
             f"{r['rounds_fit']} rounds fitted; table on {r['table_on']} ({r['rounds_check']} rounds)",
             "survival a_k = prod c_i vs prefix accepted | conditional c_k vs k-th accepted given < k accepted",
             "  k   t_k    b_k     rounds  rate   ECE raw  ECE cal  floor  AUC   | rounds  ECE raw  ECE cal  AUC"]
    for row, t, b in zip(r["table"], r["temperatures"], r.get("biases") or [0.0] * len(r["temperatures"])):
        lines.append(f"{row['position']:3d} {t:6.3f} {b:+6.3f} {row['rounds']:8d} {f(row['prefix_accept_rate'])} "
                     f"{f(row['ece_survival_raw'])}  {f(row['ece_survival_sts'])} {f(row.get('ece_survival_floor'))} "
                     f"{f(row['auc_survival'])} | "
                     f"{row['conditional_rounds']:6d} {f(row['ece_conditional_raw'])}  "
                     f"{f(row['ece_conditional_sts'])} {f(row['auc_conditional'])}")
    if hist:
        lines.append(f"request history (prior strength {hist['strength']:g}, mean {hist['prior']:.3f}): weights "
                     + " ".join(f"{w:+.3f}" for w in hist["weights"]))
    lines.append("floor: ECE a perfectly calibrated head with the calibrated confidences scores on these rounds "
                 "(noise)")
    if r["table"] and "ece_survival_cv" in r["table"][0]:
        lines.append("ECE cal, both folds (fit even / check odd and fit odd / check even), mean: "
                     + " ".join(f(row["ece_survival_cv"]).strip() for row in r["table"]))
    if r["unfitted_positions"]:
        lines.append(f"positions {r['unfitted_positions']} had < {r['min_rounds']} fitting rounds: t = 1, b = 0 kept")
    if "written" in r:
        lines.append(f"wrote {r['written']}")
    for p in r.get("plots", []):
        lines.append(f"wrote {p}")
    return "\n".join(lines)
