"""`dspark eval`, `dspark calibrate` and `dspark report`: JSON contracts on real tiny models, one-line errors."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from dspark_cli.main import main

from conftest import build_tiny_dspark

pytestmark = pytest.mark.usefixtures("one_torch_thread")

CONTRACT = ("tau", "rounds", "conditional_acceptance", "survival", "dataset", "domain", "drafter", "block_size",
            "num_prompts", "tokens", "support_size", "support_note")
PROMPT_IDS = [[5, 9, 12, 30, 41, 77, 3, 8], [7, 7, 8, 100, 200, 300, 11, 12, 13], [400, 3, 19, 22, 23, 24, 60, 61]]


@pytest.fixture(scope="module")
def ids_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("prompts") / "tiny-ids.jsonl"
    path.write_text("".join(json.dumps({"prompt_ids": p}) + "\n" for p in PROMPT_IDS))
    return path


@pytest.mark.parametrize("name", ["dspark", "eagle3"])
def test_eval_json_on_fixture_drafters(shared_fixtures, ids_file, tmp_path, capsys, name):
    out = tmp_path / "res.json"
    rc = main(["eval", "--prompt-ids-file", str(ids_file), "--drafter-path", str(shared_fixtures / name),
               "--target", str(shared_fixtures / "target"), "--max-new-tokens", "10", "--json", "--out", str(out)])
    assert rc == 0
    r = json.loads(capsys.readouterr().out)
    assert all(k in r for k in CONTRACT), sorted(r)
    assert r == json.loads(out.read_text())
    assert r["block_size"] == 4 and len(r["survival"]) == 4 and r["num_prompts"] == 3 and r["tokens"] == 30
    assert 1.0 <= r["tau"] <= 5.0 and r["temperature"] == 1.0 and r["policy"] == "fixed"
    assert r["conditional_acceptance"][0] == pytest.approx(r["survival"][0])
    assert r["support_size"] == 512 and r["vocab_size"] == 512 and "split" in r
    has_conf = name == "dspark"
    assert (r["rollouts"]["confidence_logits"] is not None) == has_conf
    assert len(r["rollouts"]["accepted"]) == r["rounds"]


def test_eval_truncation_cost_and_support_size(shared_fixtures, ids_file, capsys):
    rc = main(["eval", "--prompt-ids-file", str(ids_file), "--drafter-path", str(shared_fixtures / "dflash"),
               "--target", str(shared_fixtures / "target"), "--max-new-tokens", "8", "--limit", "2",
               "--support-size", "8", "--truncation-cost", "--no-rollouts", "--json"])
    assert rc == 0
    r = json.loads(capsys.readouterr().out)
    assert r["support_size"] == 8 and "rollouts" not in r and r["num_prompts"] == 2
    t = r["truncation"]
    assert t["support_size"] == 8 and t["tau_truncated"] == r["tau"] and t["tau_full_vocab"] >= 1.0


def test_eval_text_dataset_on_tiny_model_with_random_drafter(tiny_target_dir, tmp_path, capsys):
    build_tiny_dspark(tiny_target_dir, tmp_path / "random-dspark")
    data = tmp_path / "gsm8k.jsonl"
    data.write_text("".join(json.dumps({"turns": [f"What is {i} + {i}?"]}) + "\n" for i in range(40)))
    rc = main(["eval", "--dataset", str(data), "--drafter-path", str(tmp_path / "random-dspark"),
               "--target", str(tiny_target_dir), "--max-new-tokens", "6", "--limit", "2", "--json"])
    assert rc == 0
    r = json.loads(capsys.readouterr().out)
    assert all(k in r for k in CONTRACT)
    assert r["dataset"] == "gsm8k" and r["domain"] == "math" and r["split"].startswith("eval")
    assert r["num_prompts"] == 2 and r["block_size"] == 3 and r["drafter"] == "random-dspark"
    rc = main(["eval", "--dataset", str(data), "--drafter-path", str(tmp_path / "random-dspark"), "--name", "mine",
               "--target", str(tiny_target_dir), "--max-new-tokens", "6", "--limit", "1", "--json"])
    assert rc == 0 and json.loads(capsys.readouterr().out)["drafter"] == "mine"


def test_split_all_takes_the_file_as_given(tiny_target_dir, tmp_path, capsys):
    from dspark_core.training.data import load_prompts, split

    build_tiny_dspark(tiny_target_dir, tmp_path / "random-dspark")
    data = tmp_path / "held.jsonl"
    data.write_text("".join(json.dumps({"turns": [f"What is {i} + {i}?"]}) + "\n" for i in range(12)))
    n_eval = len(split(load_prompts(str(data)), 0.2)[1])
    counts = {}
    for which in ("eval", "all"):
        assert main(["eval", "--dataset", str(data), "--drafter-path", str(tmp_path / "random-dspark"),
                     "--target", str(tiny_target_dir), "--max-new-tokens", "2", "--split", which, "--json",
                     "--no-rollouts"]) == 0
        r = json.loads(capsys.readouterr().out)
        counts[which] = r["num_prompts"]
        assert r["split"].startswith(which)
    assert counts == {"eval": n_eval, "all": 12} and n_eval < 12


def test_a_training_runs_checkpoint_is_named_after_the_run(tmp_path):
    from dspark_cli.eval import drafter_label
    assert drafter_label(tmp_path / "exp-l2" / "final") == "exp-l2"
    assert drafter_label(tmp_path / "exp-l2" / "checkpoints" / "step-000600") == "exp-l2@step-000600"
    assert drafter_label(tmp_path / "models" / "dspark") == "dspark"


def test_calibrate_writes_sidecar_table_and_plots(shared_fixtures, ids_file, tmp_path, capsys):
    from dspark_core.drafters import load_drafter

    d = tmp_path / "dspark"
    d.mkdir()
    for f in ("config.json", "model.safetensors"):
        shutil.copy(shared_fixtures / "dspark" / f, d / f)
    rc = main(["calibrate", "--prompt-ids-file", str(ids_file), "--drafter-path", str(d),
               "--target", str(shared_fixtures / "target"), "--max-new-tokens", "16", "--plots", str(tmp_path / "p"),
               "--min-rounds", "5", "--json"])
    assert rc == 0
    r = json.loads(capsys.readouterr().out)
    assert len(r["temperatures"]) == 4 and len(r["table"]) == 4 and r["rounds_fit"] >= 5
    assert r["unfitted_positions"] == [] and r["table_on"].startswith("held-out")
    assert {"ece_survival_raw", "ece_survival_sts", "auc_survival", "auc_conditional"} <= set(r["table"][0])
    assert all(0 <= row["ece_survival_floor"] <= 1 for row in r["table"] if row["rounds"])
    assert r["method"] == "platt" and len(r["biases"]) == 4
    assert load_drafter(d).config.sts_temperatures == tuple(r["temperatures"])
    assert load_drafter(d).config.calibration_bias_values == tuple(r["biases"])
    # the request history is fitted by default and installed with the rest
    hist = r["request_history"]
    assert len(hist["weights"]) == 4 and hist["strength"] == 4.0 and 0 < hist["prior"] < 1
    assert load_drafter(d).config.calibration_history.to_dict() == hist
    assert all((tmp_path / "p" / f).stat().st_size > 0
               for f in ("reliability_before.png", "reliability_after.png"))
    assert r["samples"] == 2 and r["seeds"] == [0, 1]
    meta = json.loads((d / "calibration.json").read_text())["fitted_on"]
    assert meta["samples"] == 2 and meta["rounds_check"] == r["rounds_check"]
    # one sample per prompt: fewer rounds on the same prompts; the halves stay split by prompt either way
    main(["calibrate", "--prompt-ids-file", str(ids_file), "--drafter-path", str(d), "--samples", "1",
          "--target", str(shared_fixtures / "target"), "--max-new-tokens", "16", "--min-rounds", "5", "--json",
          "--dry-run"])
    single = json.loads(capsys.readouterr().out)
    assert single["samples"] == 1 and single["rounds_fit"] < r["rounds_fit"]
    # the paper's STS: temperatures alone; the rounds saved for offline study hold what was fitted and checked
    main(["calibrate", "--prompt-ids-file", str(ids_file), "--drafter-path", str(d), "--samples", "1",
          "--target", str(shared_fixtures / "target"), "--max-new-tokens", "16", "--min-rounds", "5", "--json",
          "--method", "sts", "--save-rounds", str(tmp_path / "rounds.npz"), "--out", str(tmp_path / "sts")])
    sts = json.loads(capsys.readouterr().out)
    assert sts["method"] == "sts" and sts["biases"] == [0.0] * 4
    assert "biases" not in json.loads((tmp_path / "sts" / "calibration.json").read_text())
    saved = np.load(tmp_path / "rounds.npz")
    assert saved["logits"].shape == (sts["rounds_fit"] + sts["rounds_check"], 4)
    # one request id per (rollout, prompt), rows in round order within each
    assert saved["request_index"].shape == saved["prompt_index"].shape
    assert len(np.unique(saved["request_index"])) == sts["num_prompts"]
    assert (saved["accepted"] <= saved["proposed"]).all() and saved["prompt_index"].shape == saved["accepted"].shape
    # refit from the saved rounds, no model loaded: the same fit as the run that saved them, or another method
    assert main(["calibrate", "--from-rounds", str(tmp_path / "rounds.npz"), "--drafter-path", str(d),
                 "--min-rounds", "5", "--method", "sts", "--json", "--dry-run"]) == 0
    again = json.loads(capsys.readouterr().out)
    assert again["temperatures"] == sts["temperatures"] and again["rounds_check"] == sts["rounds_check"]
    assert again["num_prompts"] == sts["num_prompts"] and again["rounds_file"] == str(tmp_path / "rounds.npz")
    assert all("ece_survival_cv" in row for row in again["table"])
    assert main(["calibrate", "--from-rounds", str(tmp_path / "rounds.npz"), "--drafter-path", str(d),
                 "--min-rounds", "5", "--no-holdout", "--json", "--dry-run"]) == 0
    everything = json.loads(capsys.readouterr().out)
    assert everything["method"] == "platt" and everything["rounds_fit"] == saved["accepted"].size
    # a file from before request ids were saved (rounds request by request): the same fit, ids from the runs
    old = {k: saved[k] for k in saved.files if k != "request_index"}
    np.savez(tmp_path / "old.npz", **old)
    assert main(["calibrate", "--from-rounds", str(tmp_path / "old.npz"), "--drafter-path", str(d),
                 "--min-rounds", "5", "--no-holdout", "--json", "--dry-run"]) == 0
    assert json.loads(capsys.readouterr().out)["request_history"] == everything["request_history"]
    assert main(["calibrate", "--from-rounds", str(tmp_path / "rounds.npz"), "--drafter-path", str(d),
                 "--min-rounds", "5", "--no-holdout", "--json", "--dry-run", "--request-history", "off"]) == 0
    assert json.loads(capsys.readouterr().out)["request_history"] is None
    (tmp_path / "junk.npz").write_bytes(b"not a rounds file")
    assert main(["calibrate", "--from-rounds", str(tmp_path / "junk.npz"), "--drafter-path", str(d)]) == 2
    assert "--from-rounds" in capsys.readouterr().err
    assert main(["calibrate", "--prompt-ids-file", str(ids_file), "--drafter-path", str(d), "--samples", "0",
                 "--target", str(shared_fixtures / "target")]) == 2
    assert "--samples" in capsys.readouterr().err


def _result(drafter, kind, dataset, domain, tau, block=4, rollouts=None):
    cond = [max(0.1, 0.8 - 0.1 * k) for k in range(block)]
    return {"drafter": drafter, "drafter_kind": kind, "dataset": dataset, "domain": domain, "tau": tau,
            "block_size": block, "temperature": 1.0, "rounds": 10, "tokens": 30, "num_prompts": 2,
            "conditional_acceptance": cond, "survival": cond, "rollouts": rollouts,
            "calibration_temperatures": [1.0] * block if kind == "dspark" else None}


def test_report_renders_table_and_plots(tmp_path, capsys):
    rollouts = {"accepted": [0, 2, 4], "proposed": [4, 4, 4], "committed": [1, 3, 5],
                "confidence_logits": [[-1.0, 0.0, 0.0, 0.0], [2.0, 1.0, -1.0, 0.0], [3.0, 3.0, 2.0, 2.0]]}
    res = tmp_path / "results"
    res.mkdir()
    rows = [("dspark", "dspark", 2.0, 3.0, 2.4, rollouts), ("dflash", "dflash", 1.6, 2.5, 2.0, None),
            ("eagle3", "eagle3", 1.5, 2.0, 2.0, None)]
    for name, kind, code, math_, chat, ro in rows:
        for ds, dom, t in (("mbpp", "code", code), ("gsm8k", "math", math_), ("mt-bench", "chat", chat)):
            (res / f"{name}-{ds}.json").write_text(json.dumps(_result(name, kind, ds, dom, t, rollouts=ro)))
        (res / f"{name}-mbpp-b8.json").write_text(json.dumps(_result(name, kind, "mbpp", "code", code + 0.3, 8)))
    (res / "unrelated.json").write_text("{\"x\": 1}")
    rc = main(["report", "--results", str(res), "--out", str(tmp_path / "out"), "--json"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    md = (tmp_path / "out" / "report.md").read_text()
    assert "| mbpp | code | 2.00 | 1.60 | 1.50 | +25.0% | +33.3% |" in md
    # macro average over domains: dspark (2 + 3 + 2.4) / 3 = 2.467, dflash 2.033 -> +21.3%
    assert "**2.47**" in md and "**+21.3%**" in md
    names = {p.rsplit("/", 1)[-1] for p in out["plots"]}
    assert names == {"conditional_acceptance.png", "tau_vs_block_size.png", "threshold_sweep.png"}
    assert all((tmp_path / "out" / n).stat().st_size > 0 for n in names)


@pytest.mark.parametrize("args,needle", [
    (["eval", "--drafter", "dspark"], "--dataset"),
    (["eval", "--dataset", "a.jsonl", "--prompt-ids-file", "b.jsonl", "--drafter", "dspark"], "--dataset"),
    (["eval", "--prompt-ids-file", "b.jsonl", "--drafter", "none"], "--drafter"),  # eval measures a drafter
    (["eval", "--prompt-ids-file", "b.jsonl", "--drafter", "dspark", "--support-size", "x"], "--support-size"),
    (["eval", "--prompt-ids-file", "b.jsonl", "--drafter", "dspark", "--block-size", "40"], "--block-size"),
    (["eval", "--prompt-ids-file", "b.jsonl", "--drafter", "dspark", "--limit", "0"], "--limit"),
    (["report", "--out", "x"], "--results"),
    (["report", "--results", "/nonexistent/r.json", "--out", "x"], "results"),
])
def test_bad_input_is_one_line_exit_2(args, needle, capsys):
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and needle in err[0], err


def test_report_table1_keeps_the_trained_block_size_when_a_sweep_ties_it(tmp_path, capsys):
    from dspark_core.report import table1

    results = []
    for block, tau in ((7, 1.8), (4, 1.7)):
        for name, kind in (("dspark", "dspark"), ("dflash", "dflash")):
            r = _result(name, kind, "mbpp", "code", tau if kind == "dspark" else 1.5, block=block)
            r["trained_block_size"] = 7
            results.append(r)
    assert table1(results)["block_size"] == 7


def test_report_keeps_temperatures_apart(tmp_path, capsys):
    res = tmp_path / "results"
    res.mkdir()
    for t, taus in ((1.0, (2.0, 1.6)), (0.0, (5.0, 4.0))):
        for (name, kind), tau in zip((("dspark", "dspark"), ("dflash", "dflash")), taus):
            r = _result(name, kind, "mbpp", "code", tau)
            r["temperature"] = t
            (res / f"{name}-mbpp-t{t:g}.json").write_text(json.dumps(r))
    assert main(["report", "--results", str(res), "--out", str(tmp_path / "out"), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    md = (tmp_path / "out" / "report.md").read_text()
    main_table, greedy_table = md.split("## Table 1 at T = 0")
    assert "| mbpp | code | 2.00 | 1.60 | +25.0% |" in main_table and "5.00" not in main_table
    assert "| mbpp | code | 5.00 | 4.00 | +25.0% |" in greedy_table
    assert any(p.endswith("conditional_acceptance_t0.png") for p in out["plots"])


def test_scripts_take_a_shipped_drafter_name_or_a_checkpoint_directory(tmp_path):
    from dspark_cli.models import drafter_dir, models_dir
    from dspark_core.errors import ModelLoadError
    assert drafter_dir("dspark") == str(models_dir() / "dspark")
    assert drafter_dir(str(tmp_path)) == str(tmp_path)
    with pytest.raises(ModelLoadError, match="not installed"):
        drafter_dir("no-such-drafter")
