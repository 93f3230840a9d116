"""`dspark bench`: the JSON contract, plots, the HF peer, skipped policies, and one-line exit-2 errors."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from dspark_cli.main import main
from dspark_core.scheduling import DRAFT_WINDOW

from conftest import build_tiny_dspark, build_tiny_model

POINT_KEYS = ("policy", "concurrency", "aggregate_tokens_per_s", "per_user_tokens_per_s", "mean_verify_len")
TOP_KEYS = ("results", "speedup_vs_ar_batch1", "speedup_vs_hf_assisted_batch1", "hf", "causal_vs_best_static",
            "per_user_speedup_vs_gamma1_at_matched_throughput")


@pytest.fixture(scope="module")
def tiny_stack(tiny_target_dir, tmp_path_factory):
    """A random DSpark drafter (with a confidence head) and a tiny assistant for the tiny target."""
    root = tmp_path_factory.mktemp("bench")
    build_tiny_dspark(tiny_target_dir, root / "drafter")
    build_tiny_model(root / "assistant", layers=1, seed=5)
    data = root / "prompts.jsonl"
    data.write_text("".join(json.dumps({"turns": [f"What is {i} + {i}?"]}) + "\n" for i in range(5)))
    return {"target": str(tiny_target_dir), "drafter": str(root / "drafter"), "assistant": str(root / "assistant"),
            "data": str(data), "root": root}


def test_json_contract_plots_and_hf_peer(tiny_stack, capsys):
    s = tiny_stack
    plot = s["root"] / "plots" / "pareto.png"
    rc = main(["bench", "--target", s["target"], "--drafter-path", s["drafter"], "--dataset", s["data"], "--split", "all",
               "--hf-assistant", s["assistant"], "--concurrency", "1,2", "--policy", "causal,fixed,gamma1,ar",
               "--num-prompts", "3", "--max-new-tokens", "6", "--json", "--plot", str(plot)])
    assert rc == 0
    captured = capsys.readouterr()
    r = json.loads(captured.out)  # exactly one JSON object on stdout
    for key in TOP_KEYS:
        assert key in r
    # the tiny target has no sps.json: causal is skipped, and said so
    assert "causal" in captured.err and any("causal" in w for w in r["warnings"])
    assert {(x["policy"], x["concurrency"]) for x in r["results"]} == {
        (p, c) for p in ("fixed", "gamma1", "ar") for c in (1, 2)}
    for x in r["results"]:
        assert all(k in x for k in POINT_KEYS)
        assert x["outputs_match_ar"] is True  # greedy: every policy writes the autoregressive output
    assert set(r["hf"]) == {"greedy", "assisted", "prompt_lookup"}
    assert r["speedup_vs_ar_batch1"] > 0 and r["speedup_vs_hf_assisted_batch1"] > 0
    assert r["hf_outputs_match_ar"] == {"greedy": True, "assisted": True, "prompt_lookup": True}
    assert r["config"]["prompts"]["num_prompts"] == 3 and r["config"]["draft_window"] == DRAFT_WINDOW
    assert plot.stat().st_size > 0 and (plot.parent / "pareto_by_concurrency.png").stat().st_size > 0


def test_profile_sps_runs_causal_and_async_and_text_output(tiny_stack, capsys):
    s = tiny_stack
    rc = main(["bench", "--target", s["target"], "--drafter-path", s["drafter"], "--dataset", s["data"], "--split", "all",
               "--no-hf", "--profile-sps", "--concurrency", "2", "--policy", "causal,async,fixed,gamma1",
               "--num-prompts", "2", "--max-new-tokens", "5"])
    assert rc == 0
    out = capsys.readouterr().out
    assert "causal" in out and "async" in out and "batch-1 speedup" in out
    assert "causal / best static aggregate: c=2" in out
    assert "skipped" not in out  # the quick table is used; nothing skipped (2 prompts at c = 2: flagged, not skipped)


def test_draft_gate_both_runs_each_cost_policy_without_the_gate_and_in_request_scope_too(tiny_stack, capsys):
    s = tiny_stack
    rc = main(["bench", "--target", s["target"], "--drafter-path", s["drafter"], "--dataset", s["data"], "--split", "all",
               "--no-hf", "--profile-sps", "--concurrency", "1,2", "--policy", "causal,fixed,ar", "--draft-gate", "both",
               "--draft-gate-scope", "both", "--num-prompts", "2", "--max-new-tokens", "5", "--json"])
    assert rc == 0
    r = json.loads(capsys.readouterr().out)
    points = {(x["policy"], x["concurrency"]): x for x in r["results"]}
    # only the cost-reading policy has a gate to turn off, or to scope
    assert set(points) == {(p, c) for p in ("causal", "causal/no-gate", "causal/request-scope", "fixed", "ar")
                           for c in (1, 2)}
    assert all(x["outputs_match_ar"] is True for x in r["results"])
    for key in ("draft_gate_vs_off", "draft_gate_batch_vs_request_scope"):
        assert set(r[key]) == {"causal"} and set(r[key]["causal"]) == {"1", "2"}
        assert all(v > 0 for v in r[key]["causal"].values())
    assert r["config"]["draft_gate"] == "both" and r["config"]["draft_gate_scope"] == "both"


def test_slot_correction_both_runs_each_confidence_policy_with_and_without_it(tiny_stack, capsys):
    s = tiny_stack
    rc = main(["bench", "--target", s["target"], "--drafter-path", s["drafter"], "--dataset", s["data"], "--split", "all",
               "--no-hf", "--profile-sps", "--concurrency", "1,2", "--policy", "causal,fixed,ar", "--slot-correction",
               "both", "--num-prompts", "2", "--max-new-tokens", "24", "--json"])
    assert rc == 0
    r = json.loads(capsys.readouterr().out)
    points = {(x["policy"], x["concurrency"]): x for x in r["results"]}
    # only the confidence-reading policy has confidences to correct
    assert set(points) == {(p, c) for p in ("causal", "causal/no-correction", "fixed", "ar") for c in (1, 2)}
    assert all(x["outputs_match_ar"] is True for x in r["results"])
    assert set(r["slot_correction_vs_off"]) == {"causal"} and set(r["slot_correction_vs_off"]["causal"]) == {"1", "2"}
    assert all(v > 0 for v in r["slot_correction_vs_off"]["causal"].values())
    assert r["config"]["slot_correction"] == "both"
    # what the correction learned is reported on the points that ran it, and only there
    learned = points[("causal", 1)]["slot_offsets"]
    assert learned["greedy"]["observed"][0] > 0 and learned["sampled"]["observed"] == [0] * len(learned["sampled"]["observed"])
    assert all("slot_offsets" not in points[(p, c)] for p in ("causal/no-correction", "fixed", "ar") for c in (1, 2))


def test_a_dataset_gives_its_held_out_split_unless_split_all(tiny_target_dir, tmp_path):
    """The prompts `dspark train` distils are the other 80%: a bench on a dev file must not time a drafter on
    prompts it was trained on, so `--dataset` takes the held-out split (`--split all`: the file as given)."""
    from types import SimpleNamespace

    from dspark_cli.bench import load_prompt_list
    from dspark_core.target import load_tokenizer
    from dspark_core.text import encode_prompt
    from dspark_core.training.data import load_prompts, split

    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"turns": [f"Question number {i}: what is {i} + {i}?"]}) + "\n"
                            for i in range(60)))
    target = SimpleNamespace(tokenizer=load_tokenizer(tiny_target_dir), max_context=512)
    held = [encode_prompt(target.tokenizer, p.text) for p in split(load_prompts(str(data)), 0.2)[1]]
    assert 0 < len(held) < 60
    args = SimpleNamespace(dataset=[str(data)], split="eval", num_prompts=100, max_new_tokens=8)
    prompts, source = load_prompt_list(args, target)
    assert prompts == held and source["split"].startswith("eval")
    args.split = "all"
    prompts, source = load_prompt_list(args, target)
    assert len(prompts) == 60 and source["split"] == "none (used as given)"


@pytest.mark.parametrize("args,flag", [
    (["--concurrency", "0"], "--concurrency"),
    (["--concurrency", "1,x"], "--concurrency"),
    (["--concurrency", ""], "--concurrency"),
    (["--policy", "turbo"], "--policy"),
    (["--policy", "fixed,causal,fixed"], "--policy"),
    (["--num-prompts", "0"], "--num-prompts"),
    (["--repeats", "0"], "--repeats"),
    (["--draft-window", "-1"], "--draft-window"),
    (["--dataset", "/nonexistent.jsonl"], "--dataset"),
])
def test_bad_flags_are_one_line_exit_2(tiny_target_dir, capsys, args, flag):
    rc = main(["bench", "--target", str(tiny_target_dir), *args])
    assert rc == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and flag in err[0] and err[0].startswith("dspark bench: error:")


@pytest.mark.parametrize("args,flag", [
    (["--policy", "fixed,causal"], "--policy"),  # one scheduler runs one policy
    (["--plot", "x.png"], "--plot"),
    (["--profile-sps"], "--profile-sps"),
    (["--concurrency", "0"], "--concurrency"),
    (["--max-new-tokens", "0"], "--max-new-tokens"),
    (["--draft-gate", "both"], "--draft-gate"),  # the services' gate is the engine default
    (["--slot-correction", "on"], "--slot-correction"),  # the scheduler's own flag decides there
    (["--draft-gate-scope", "both"], "--draft-gate-scope"),
])
def test_distributed_bad_flags_are_one_line_exit_2(tiny_target_dir, capsys, args, flag):
    rc = main(["bench", "--distributed", "--target", str(tiny_target_dir), *args])
    assert rc == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and flag in err[0] and err[0].startswith("dspark bench: error:")


@pytest.mark.slow
def test_distributed_bench_over_real_processes_json_contract(tiny_stack, capsys):
    """Both deployments as real processes (redis, verifier, drafter, scheduler; serve all), same prompts."""
    s = tiny_stack
    rc = main(["bench", "--distributed", "--target", s["target"], "--drafter-path", s["drafter"],
               "--dataset", s["data"], "--split", "all", "--concurrency", "1,2", "--num-prompts", "3", "--max-new-tokens", "8",
               "--json"])
    assert rc == 0
    r = json.loads(capsys.readouterr().out)
    assert set(r["distributed_vs_embedded"]) == {"1", "2"} and all(v > 0 for v in r["distributed_vs_embedded"].values())
    assert r["outputs_match"] is True  # greedy: the same tokens in both modes
    assert {(x["mode"], x["concurrency"]) for x in r["results"]} == {
        (m, c) for m in ("embedded", "distributed") for c in (1, 2)}
    dist, emb = r["stage_breakdown"]["distributed"]["1"], r["stage_breakdown"]["embedded"]["1"]
    assert dist["steps"] > 0 and emb["steps"] > 0
    for stage in ("verify.rpc", "verifier.forward", "verify.transport"):
        assert dist["seconds_per_step"][stage] > 0
    assert "verify.rpc" not in emb["seconds_per_step"] and not emb["pod_idle_share"]
    # the drafter here is random: the draft gate soon stops paying for its passes (the stage breakdown with a
    # drafter that drafts is tests/services/test_critical_path.py's); where a window did verify drafts, its
    # passes are in the breakdown
    for mode in ("distributed", "embedded"):
        for b in r["stage_breakdown"][mode].values():
            if b["speculation"]["draft_tokens_per_step"] > 0:
                assert b["seconds_per_step"]["propose.rpc" if mode == "distributed" else "draft"] > 0
    assert 0 <= dist["pod_idle_share"].get("drafter", 0) < 1
    # both made the same tokens (3 requests x 8); what their steps decided is read from the same /metrics
    for b in (dist, emb):
        assert b["speculation"]["tokens_per_step"] * b["steps"] == pytest.approx(24, abs=0.05)
        assert b["speculation"]["rounds_per_step"] >= 1
        assert b["speculation"]["acceptance"] is None or 0 <= b["speculation"]["acceptance"] <= 1
    assert r["config"]["policy"] == "fixed"


def test_bad_policy_exits_2_from_the_command_line():
    proc = subprocess.run([sys.executable, "-m", "dspark_cli.main", "bench", "--policy", "fast,ar"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "--policy" in lines[0] and "'fast,ar'" in lines[0] and "Traceback" not in proc.stderr
