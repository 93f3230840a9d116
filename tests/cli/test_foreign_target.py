"""A target the drafter was not trained for: `--drafter auto` decodes without it and says so; a named
drafter is refused in one line naming both (issue 20). The shipped drafters carry the record of their target."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from dspark_cli.main import main
from dspark_cli.models import models_dir
from tests.conftest import build_tiny_dspark, build_tiny_model

pytestmark = pytest.mark.usefixtures("one_torch_thread")
BUNDLED = models_dir() / "target"


@pytest.fixture(scope="module")
def qwen3_12_layers(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("own-qwen3-12"), layers=12)


@pytest.fixture(scope="module")
def two_layer_target(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("own-qwen3-2"), layers=2)


@pytest.fixture(scope="module")
def bundled_shape_other_weights(tmp_path_factory) -> Path:
    """The bundled target's architecture, vocabulary and tokenizer, with freshly initialised weights."""
    from transformers import AutoConfig, AutoModelForCausalLM

    out = tmp_path_factory.mktemp("same-shape")
    torch.manual_seed(1)
    AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(BUNDLED)).save_pretrained(out)
    for f in BUNDLED.iterdir():
        if f.name.startswith("tokenizer") or f.name in ("chat_template.jinja", "generation_config.json"):
            shutil.copy(f, out / f.name)
    return out


def _one_line_error(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err and "\n" not in err, err
    assert err.startswith("dspark generate: error: "), err
    return err


def test_auto_decodes_without_the_default_drafter_beside_another_target(qwen3_12_layers, capsys):
    rc = main(["generate", "--target", str(qwen3_12_layers), "--temperature", "0", "--max-new-tokens", "4",
               "--json", "hi"])
    cap = capsys.readouterr()
    assert rc == 0
    out = json.loads(cap.out)
    assert out["drafter"] is None and out["policy"] == "ar"
    assert "decoding without a drafter" in cap.err and "Traceback" not in cap.err


def test_named_drafter_beside_another_target_is_refused_naming_both(qwen3_12_layers, capsys):
    rc = main(["generate", "--target", str(qwen3_12_layers), "--drafter", "dspark", "hi"])
    err = _one_line_error(capsys)
    assert rc == 2
    assert str(models_dir() / "dspark") in err and str(qwen3_12_layers) in err
    assert "trained for target 'target'" in err and "vocab 4096" in err and "vocabulary differs" in err


def test_two_layer_target_is_refused_by_the_shape_check_not_an_internal_error(tiny_target_dir, two_layer_target,
                                                                              tmp_path, capsys):
    drafter = build_tiny_dspark(tiny_target_dir, tmp_path / "d")  # taps 0 and 2 of a 4-layer target
    rc = main(["generate", "--target", str(two_layer_target), "--drafter-path", str(drafter), "hi"])
    err = _one_line_error(capsys)
    assert rc == 2 and "number of layers differs" in err and "4 layers" in err and "2 layers" in err


def test_deepspec_config_without_record_gets_the_tap_check(tiny_target_dir, two_layer_target, tmp_path, capsys):
    drafter = build_tiny_dspark(tiny_target_dir, tmp_path / "d")
    cfg = json.loads((drafter / "config.json").read_text())
    del cfg["num_target_layers"]  # as some DeepSpec configs: only target_layer_ids says what it taps
    (drafter / "config.json").write_text(json.dumps(cfg))
    rc = main(["generate", "--target", str(two_layer_target), "--drafter-path", str(drafter), "hi"])
    err = _one_line_error(capsys)
    assert rc == 2 and "tapped layers [0, 2]" in err


def test_same_shape_other_weights_auto_drops_and_named_refuses(bundled_shape_other_weights, capsys):
    rc = main(["generate", "--target", str(bundled_shape_other_weights), "--temperature", "0",
               "--max-new-tokens", "3", "--json", "hi"])
    cap = capsys.readouterr()
    assert rc == 0 and json.loads(cap.out)["drafter"] is None
    assert "its embedding differs" in cap.err
    rc = main(["generate", "--target", str(bundled_shape_other_weights), "--drafter", "eagle3", "hi"])
    err = _one_line_error(capsys)
    assert rc == 2 and "embedding (weights) differs" in err


def test_trained_drafter_records_its_target_and_loads_beside_it(tiny_target_dir, tmp_path, capsys):
    """`dspark train` writes the record; the drafter then runs beside its own target."""
    data = tmp_path / "p.jsonl"
    data.write_text("".join(json.dumps({"id": str(i), "turns": [f"Write {w} in Python."]}) + "\n"
                            for i, w in enumerate(["a loop", "a list", "a class", "a dict", "a set", "a map"])))
    out = tmp_path / "run"
    assert main(["train", "--kind", "dspark", "--target", str(tiny_target_dir), "--data", str(data),
                 "--out", str(out), "--steps", "2", "--global-batch", "2", "--max-new-tokens", "8",
                 "--no-progress", "--eval-fraction", "0.2"]) == 0
    config = json.loads((out / "final" / "config.json").read_text())
    record = config["dspark_target"]
    assert record["name"] == tiny_target_dir.name and record["vocab_size"] > 0
    assert config["context_feature_dtype"] == "bfloat16"  # the cache's (default) precision: it reads them so
    assert record["hidden_size"] == 64 and record["num_hidden_layers"] == 4
    assert len(record["embedding_fingerprint"]) == 16
    capsys.readouterr()
    assert main(["generate", "--target", str(tiny_target_dir), "--drafter-path", str(out / "final"),
                 "--temperature", "0", "--max-new-tokens", "4", "--json", "hi"]) == 0
    assert json.loads(capsys.readouterr().out)["drafter"] == "final"


@pytest.mark.parametrize("name", ["dspark", "dspark-rnn", "dflash", "eagle3"])
def test_shipped_drafters_record_the_bundled_target(name):
    from dspark_core.drafters.config import load_config
    from dspark_core.drafters.target_record import fingerprint_mismatch, recorded_target
    from dspark_core.target import TargetConfig, TargetRuntime

    config = load_config(models_dir() / name)
    rec = recorded_target(config)
    assert rec["name"] == "target" and rec["tap_layer_ids"] == list(config.target_layer_ids)
    target = TargetRuntime(TargetConfig(str(BUNDLED), device="cpu", dtype="bfloat16"))  # any dtype matches
    assert not fingerprint_mismatch(config, target.input_embeddings.weight)


def test_train_from_responses_generated_elsewhere(tiny_target_dir, tmp_path, capsys):
    """`dspark train --responses`: answers from another server (text, chat messages or token ids) are cached
    as given (no distillation); held-out prompts are skipped; a bad line is one error naming file and line."""
    from transformers import AutoTokenizer

    from dspark_core.text import encode_prompt
    from dspark_core.training.data import Prompt, is_eval

    tok = AutoTokenizer.from_pretrained(tiny_target_dir)
    prompts = [f"Write {w} in Python." for w in ("a loop", "a list", "a class", "a dict", "a set", "a map",
                                                  "a tuple", "a function", "a lambda", "a string")]
    held = [p for p in prompts if is_eval(Prompt(p, "x", "other"))]
    assert held, "the fixed split holds some of these out"
    rows = [{"prompt": p, "response": f"Here is {p[6:-11]}: done."} for p in prompts]
    rows.append({"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"},
                              {"role": "assistant", "content": "hello"}]})
    rows.append({"prompt_ids": [5, 6, 7], "response_ids": [8, 9, 10, 11]})
    data = tmp_path / "answers.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "run"
    assert main(["train", "--kind", "dspark", "--target", str(tiny_target_dir), "--responses", str(data),
                 "--out", str(out), "--steps", "2", "--global-batch", "2", "--no-progress"]) == 0
    cached = [json.loads(line) for line in (out / "cache" / "samples.jsonl").read_text().splitlines()]
    assert len(cached) == len(rows) - len(held)
    eos = tok.eos_token_id
    first_kept = next(r for r in rows[:10] if r["prompt"] not in held)
    assert cached[0]["prompt_ids"] == encode_prompt(tok, first_kept["prompt"])
    assert cached[0]["response_ids"] == tok.encode(first_kept["response"], add_special_tokens=False) + [eos]
    assert cached[-2]["prompt_ids"] == encode_prompt(tok, "hi there")
    assert cached[-1] == {"prompt_ids": [5, 6, 7], "response_ids": [8, 9, 10, 11], "domain": "other"}
    card = json.loads((out / "training_card.json").read_text())
    assert card["data"]["responses"] == len(cached)
    assert "responses:" in capsys.readouterr().err
    data.write_text('{"prompt": "only a prompt"}\n')
    assert main(["train", "--target", str(tiny_target_dir), "--responses", str(data), "--out", str(tmp_path / "r2"),
                 "--steps", "1", "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert f"{data}:1" in err and "response" in err
    assert main(["train", "--target", str(tiny_target_dir), "--out", str(tmp_path / "r3")]) == 2
    assert "--responses" in capsys.readouterr().err


def test_measurement_commands_beside_another_target(qwen3_12_layers, tmp_path, capsys):
    """bench works without a drafter (and without the bundled HF assistant, whose vocabulary differs); eval,
    which measures a drafter, refuses in one line saying why."""
    data = tmp_path / "p.jsonl"
    data.write_text('{"turns": ["Write a loop in Python."]}\n{"turns": ["What is a list?"]}\n')
    rc = main(["bench", "--target", str(qwen3_12_layers), "--concurrency", "1", "--num-prompts", "1",
               "--max-new-tokens", "3", "--dataset", str(data), "--policy", "async_topk,ar", "--json"])
    cap = capsys.readouterr()
    assert rc == 0 and "Traceback" not in cap.err
    out = json.loads(cap.out)
    assert any("assist" in w for w in out["warnings"]), out["warnings"]
    assert main(["eval", "--target", str(qwen3_12_layers), "--dataset", str(data)]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "trained for another target (vocabulary differs" in err
