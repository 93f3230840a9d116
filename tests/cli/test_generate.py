"""`dspark generate`: JSON contract, streaming, and one-line errors with exit code 2 for bad input."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from dspark_cli.main import main


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dspark_cli.main", *args], capture_output=True, text=True, timeout=300)


def test_json_output_has_the_contract_fields(tiny_target_dir, capsys):
    rc = main(["generate", "--target", str(tiny_target_dir), "--drafter", "none", "--temperature", "0",
               "--max-new-tokens", "8", "--json", "def add(a, b):"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    for key in ("text", "token_ids", "num_rounds", "accepted_per_round", "tokens_per_second"):
        assert key in out
    assert 1 <= len(out["token_ids"]) <= 8
    assert out["num_rounds"] == len(out["accepted_per_round"]) == len(out["token_ids"]) - 1
    assert out["accepted_per_round"] == [0] * out["num_rounds"]  # autoregressive: nothing to accept
    assert out["drafter"] is None and out["drafter_matmul_dtype"] is None


def test_prompt_ids_and_text_agree(tiny_target_dir, capsys):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_target_dir))
    ids = tok.encode("for i in range", add_special_tokens=False)
    main(["generate", "--target", str(tiny_target_dir), "--drafter", "none", "--temperature", "0",
          "--max-new-tokens", "6", "--json", "--raw", "for i in range"])
    by_text = json.loads(capsys.readouterr().out)
    main(["generate", "--target", str(tiny_target_dir), "--drafter", "none", "--temperature", "0",
          "--max-new-tokens", "6", "--json", "--prompt-ids", ",".join(map(str, ids))])
    by_ids = json.loads(capsys.readouterr().out)
    assert by_text["token_ids"] == by_ids["token_ids"]


def test_streams_text_without_json(tiny_target_dir, capsys):
    assert main(["generate", "--target", str(tiny_target_dir), "--drafter", "none", "--temperature", "0",
                 "--max-new-tokens", "5", "hello"]) == 0
    out = capsys.readouterr().out
    assert out.endswith("\n") and not out.lstrip().startswith("{")


@pytest.mark.parametrize("args,needle", [
    (["--target", "/nonexistent/model", "hi"], "model directory not found: /nonexistent/model"),
    (["   "], "prompt"),
    (["--temperature", "-1", "hi"], "temperature"),
    (["--top-p", "0", "hi"], "top_p"),
    (["--top-k", "-2", "hi"], "top_k"),
    (["--max-new-tokens", "0", "hi"], "max_new_tokens"),
    (["--temperature", "hot", "hi"], "--temperature"),
    (["--prompt-ids", "1,x,3"], "--prompt-ids"),
])
def test_bad_input_is_one_line_exit_2(tiny_target_dir, args, needle):
    if "--target" not in args:
        args = ["--target", str(tiny_target_dir), *args]
    proc = run_cli("generate", "--drafter", "none", *args)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert needle in lines[0] and "Traceback" not in proc.stderr


def test_prompt_longer_than_context_is_refused(tiny_target_dir):
    ids = ",".join(["5"] * 200)  # the tiny model's window is 128 tokens
    proc = run_cli("generate", "--target", str(tiny_target_dir), "--drafter", "none", "--prompt-ids", ids)
    assert proc.returncode == 2
    assert "context window" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


def test_invalid_model_dir_is_refused(tmp_path):
    bad = tmp_path / "broken"
    bad.mkdir()
    (bad / "config.json").write_text("{not json")
    proc = run_cli("generate", "--target", str(bad), "--drafter", "none", "hi")
    assert proc.returncode == 2 and str(bad) in proc.stderr and "Traceback" not in proc.stderr
