"""One vocabulary across commands (issue 20): shared flag names, choices and help; policy names of the
library; `auto` / `none` wherever a drafter is chosen; generated tables and calibrations never written into
tracked files."""

from __future__ import annotations

import argparse
import json
import subprocess
from pathlib import Path

import pytest

from dspark_cli import options
from dspark_cli.main import build_parser, main
from dspark_cli.models import SOURCE_ROOT, generated_dir, models_dir
from tests.conftest import build_tiny_dspark

pytestmark = pytest.mark.usefixtures("one_torch_thread")
FIXTURES = SOURCE_ROOT / "tests" / "fixtures" / "deepspec-tiny-a"


def _commands(parser=None, name="dspark"):
    """(name, parser) of every command and subcommand."""
    parser = parser or build_parser()
    for a in parser._actions:
        if isinstance(a, argparse._SubParsersAction):
            helps = {c.dest: c.help for c in a._choices_actions}
            for n, sp in a.choices.items():
                yield f"{name} {n}", sp, helps.get(n)
                yield from _commands(sp, f"{name} {n}")


def test_every_command_has_help_and_a_description_and_every_flag_help():
    missing = []
    for name, sp, help_ in _commands():
        if not help_:
            missing.append(f"{name}: no help line")
        if not sp.description:
            missing.append(f"{name}: no description")
        for a in sp._actions:
            if a.help is None and a.dest != "help" and not isinstance(a, argparse._SubParsersAction):
                missing.append(f"{name} {'/'.join(a.option_strings) or a.dest}: no help")
    assert missing == []


def test_shared_choices_equal_the_library_and_each_other():
    from dspark_core.drafters.checkpoint import MATMUL_DTYPES
    from dspark_core.scheduling import POLICY_NAMES

    assert options.POLICY_NAMES == POLICY_NAMES and options.MATMUL_DTYPES == MATMUL_DTYPES
    drafter_choices, policy_types, temperatures = {}, set(), {}
    for name, sp, _ in _commands():
        for a in sp._actions:
            if "--drafter" in a.option_strings:
                drafter_choices[name] = tuple(a.choices)
            if "--policy" in a.option_strings and name != "dspark bench":  # bench takes a comma list
                policy_types.add(a.type)
            if "--temperature" in a.option_strings:
                temperatures[name] = a.default
            assert "--matmul-dtype" not in a.option_strings or a.help == argparse.SUPPRESS, name
    # the distributed scheduler finds its drafters as pods: auto / none; everywhere else also the shipped names
    assert drafter_choices.pop("dspark serve scheduler") == ("auto", "none")
    assert set(drafter_choices.values()) == {options.DRAFTER_CHOICES}, drafter_choices
    assert policy_types == {options.policy_name}
    interactive = {k: v for k, v in temperatures.items() if k in ("dspark generate", "dspark client generate")}
    assert set(interactive.values()) == {options.INTERACTIVE_TEMPERATURE}


def test_matmul_dtype_alias_and_policy_alias_parse():
    p = build_parser()
    a = p.parse_args(["serve", "drafter", "--matmul-dtype", "float32"])
    b = p.parse_args(["serve", "drafter", "--drafter-matmul-dtype", "float32"])
    assert a.drafter_matmul_dtype == b.drafter_matmul_dtype == "float32"
    assert p.parse_args(["generate", "--policy", "async_topk", "hi"]).policy == "async"
    assert p.parse_args(["serve", "all", "--policy", "async_topk"]).policy == "async"
    assert p.parse_args(["serve", "all", "--served-model-name", "mine"]).served_model_name == "mine"
    assert p.parse_args(["serve", "scheduler", "--no-drafter"]).drafter == "none"  # the old spelling


def test_unknown_policy_is_one_line(capsys):
    with pytest.raises(SystemExit) as e:
        main(["generate", "--policy", "bogus", "hi"])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and "\n" not in err and "'bogus'" in err and "causal" in err


def test_cost_table_policy_without_sps_decodes_fixed_and_says_so(tiny_target_dir, tmp_path, capsys):
    drafter = build_tiny_dspark(tiny_target_dir, tmp_path / "d")
    rc = main(["generate", "--target", str(tiny_target_dir), "--drafter-path", str(drafter), "--policy", "causal",
               "--temperature", "0", "--max-new-tokens", "4", "--json", "hi"])
    cap = capsys.readouterr()
    assert rc == 0 and json.loads(cap.out)["policy"] == "fixed"
    assert "policy causal needs the target's SPS cost table" in cap.err


def test_eval_with_drafter_none_is_one_line(capsys):
    assert main(["eval", "--prompt-ids-file", "x.jsonl", "--drafter", "none"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "--drafter" in err and "'none'" in err


def _tracked_changes() -> str:
    return subprocess.run(["git", "status", "--porcelain", "--", "models", "tests/fixtures"], cwd=SOURCE_ROOT,
                          capture_output=True, text=True).stdout


def test_generated_dir_is_the_install_location_for_shipped_models(tmp_path, monkeypatch):
    monkeypatch.setenv("DSPARK_HOME", str(tmp_path))
    assert generated_dir(models_dir() / "target") == tmp_path / "models" / "target"
    assert generated_dir(FIXTURES / "dspark") == tmp_path / "models" / "fixtures-deepspec-tiny-a-dspark"
    assert generated_dir(tmp_path / "mine") == tmp_path / "mine"  # one's own model: beside it
    assert generated_dir(SOURCE_ROOT / "runs" / "x" / "final") == SOURCE_ROOT / "runs" / "x" / "final"  # a run


def test_profile_and_calibrate_write_to_the_install_location_not_tracked_files(tmp_path, monkeypatch, capsys):
    from dspark_cli.models import calibration_of, load_sps, load_stack

    monkeypatch.setenv("DSPARK_HOME", str(tmp_path))
    before = _tracked_changes()
    target, drafter = FIXTURES / "target", FIXTURES / "dspark"
    assert main(["profile", "--target", str(target), "--max-batch", "4", "--repeats", "1", "--requests", "none",
                 "--context-length", "8", "--block", "2", "--threads", "1"]) == 0
    written = tmp_path / "models" / "fixtures-deepspec-tiny-a-target" / "sps.json"
    assert written.is_file() and not (target / "sps.json").exists()
    assert load_sps(target)[1] == written  # what the commands and services read
    ids = tmp_path / "ids.jsonl"
    ids.write_text("".join(json.dumps({"prompt_ids": [5 + i, 9, 12, 30, 41, 77, 3, 8]}) + "\n" for i in range(4)))
    capsys.readouterr()
    assert main(["calibrate", "--prompt-ids-file", str(ids), "--drafter-path", str(drafter), "--target", str(target),
                 "--max-new-tokens", "8", "--samples", "1", "--min-rounds", "1", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    cal = Path(result["written"])
    assert cal.parent == tmp_path / "models" / "fixtures-deepspec-tiny-a-dspark" and cal.is_file()
    assert not (drafter / "calibration.json").exists() and calibration_of(drafter) == cal
    _, loaded = load_stack(str(target), str(drafter), device="cpu", dtype="float32")
    assert loaded.config.sts_temperatures == tuple(result["temperatures"])
    assert _tracked_changes() == before
