"""`--weights` on the CLI: the served format is reported, formats that cannot run fail in one line (exit 2)."""

from __future__ import annotations

import json

import pytest

from dspark_cli.main import main
from dspark_core.packed_weights import packed_kernels_available


@pytest.mark.skipif(not packed_kernels_available(), reason="no int8/int4 CPU weight kernels")
def test_generate_serves_the_asked_format(tiny_llama_dir, capsys):
    outs = {}
    for weights in ("float32", "int4"):
        rc = main(["generate", "--target", str(tiny_llama_dir), "--drafter", "none", "--temperature", "0",
                   "--device", "cpu", "--max-new-tokens", "6", "--json", "--weights", weights, "--prompt-ids",
                   "5,9,12,30"])
        assert rc == 0
        outs[weights] = json.loads(capsys.readouterr().out)
    assert outs["float32"]["weights"] == "float32" and outs["int4"]["weights"] == "int4"
    assert len(outs["int4"]["token_ids"]) == 6


def test_gguf_weights_on_a_target_not_imported_from_gguf_is_one_line(tiny_target_dir, capsys):
    rc = main(["generate", "--target", str(tiny_target_dir), "--drafter", "none", "--device", "cpu",
               "--weights", "gguf", "--prompt-ids", "1,2,3"])
    err = capsys.readouterr().err.strip()
    assert rc == 2
    assert len(err.splitlines()) == 1 and "weights" in err and "gguf_source.json" in err


def test_unknown_format_is_refused_by_argparse(tiny_target_dir, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["generate", "--target", str(tiny_target_dir), "--weights", "int3", "--prompt-ids", "1"])
    assert exc.value.code == 2
    assert "--weights" in capsys.readouterr().err
