"""DeepSpec checkpoints through `dspark generate`: the recorded greedy traces, token for token and round for round."""

from __future__ import annotations

import json

import pytest

from dspark_cli.main import main

DRAFTERS = ["dspark", "dspark-rnn", "dflash", "eagle3"]


@pytest.mark.parametrize("name", DRAFTERS)
def test_generate_reproduces_reference_traces(shared_fixtures, name, capsys):
    ref = json.loads((shared_fixtures / name / "reference.json").read_text())
    for prompt in ref["prompts"]:
        rc = main(["generate", "--target", str(shared_fixtures / "target"), "--drafter-path",
                   str(shared_fixtures / name), "--prompt-ids", ",".join(map(str, prompt["prompt_ids"])),
                   "--temperature", "0", "--max-new-tokens", "64", "--json", "--device", "cpu"])
        assert rc == 0
        out = json.loads(capsys.readouterr().out)
        trace = prompt["trace"]
        assert out["token_ids"] == trace["new_tokens"][:64]
        assert out["accepted_per_round"] == trace["accepted_draft_lengths"]
        # the default (auto) drafter matmuls leave these small checkpoints exact on any CPU
        assert out["drafter_matmul_dtype"] == "float32"


@pytest.mark.parametrize("name", ["dspark", "dspark-rnn"])
def test_threshold_policy_reproduces_confidence_threshold_traces(shared_fixtures, name, capsys):
    ref = json.loads((shared_fixtures / name / "reference.json").read_text())
    for prompt in ref["prompts"]:
        main(["generate", "--target", str(shared_fixtures / "target"), "--drafter-path", str(shared_fixtures / name),
              "--prompt-ids", ",".join(map(str, prompt["prompt_ids"])), "--temperature", "0",
              "--max-new-tokens", "64", "--json", "--policy", "threshold", "--device", "cpu"])
        out = json.loads(capsys.readouterr().out)
        trace = prompt["trace_conf_threshold_0.5"]
        assert out["token_ids"] == trace["new_tokens"][:64]
        assert out["accepted_per_round"] == trace["accepted_draft_lengths"]
