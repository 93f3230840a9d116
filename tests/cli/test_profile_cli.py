"""`dspark profile`: writes the SPS table and plot where asked; bad flags are one-line errors (exit 2)."""

from __future__ import annotations

import json

import pytest
import torch

from dspark_cli.main import main
from dspark_core.cost_model import SpsTable


def test_profile_writes_table_plot_and_json(tiny_target_dir, tmp_path, capsys):
    threads = torch.get_num_threads()
    out = tmp_path / "sps.json"
    rc = main(["profile", "--target", str(tiny_target_dir), "--max-batch", "5", "--repeats", "2",
               "--context-length", "16", "--block", "2", "--threads", "1", "--out", str(out), "--json"])
    torch.set_num_threads(threads)
    assert rc == 0
    printed = json.loads(capsys.readouterr().out)
    table = SpsTable.load(out)
    assert table.batch_sizes == (1, 2, 3, 4, 5) == tuple(printed["batch_sizes"])
    assert all(s > 0 for s in table.steps_per_second)
    assert table.context_length == 16 and table.device == "cpu"
    assert (tmp_path / "sps.png").stat().st_size > 0


def test_sizes_are_dense_then_strided(tiny_target_dir, tmp_path, capsys):
    threads = torch.get_num_threads()
    out = tmp_path / "sps.json"
    rc = main(["profile", "--target", str(tiny_target_dir), "--max-batch", "13", "--dense-until", "4", "--stride", "4",
               "--repeats", "1", "--context-length", "8", "--block", "4", "--threads", "1", "--out", str(out)])
    torch.set_num_threads(threads)
    assert rc == 0
    assert SpsTable.load(out).batch_sizes == (1, 2, 3, 4, 8, 12, 13)


@pytest.mark.parametrize("flag, value", [("--threads", "0"), ("--max-batch", "0"), ("--stride", "0")])
def test_bad_values_name_the_flag(tiny_target_dir, capsys, flag, value):
    assert main(["profile", "--target", str(tiny_target_dir), flag, value]) == 2
    err = capsys.readouterr().err
    assert flag in err and value in err and len(err.strip().splitlines()) == 1


def test_requests_rows_are_profiled_and_saved(tiny_target_dir, tmp_path, capsys):
    threads = torch.get_num_threads()
    out = tmp_path / "sps.json"
    rc = main(["profile", "--target", str(tiny_target_dir), "--max-batch", "4", "--repeats", "1", "--context-length",
               "8", "--block", "3", "--requests", "1,2", "--threads", "1", "--out", str(out)])
    torch.set_num_threads(threads)
    assert rc == 0
    table = SpsTable.load(out)
    assert [(r, row.batch_sizes) for r, row in table.by_requests] == [(1, (1, 2, 3)), (2, (2, 3, 4, 5, 6))]
    assert json.loads(out.read_text())["by_requests"]["2"]["batch_sizes"] == [2, 3, 4, 5, 6]
    assert main(["profile", "--target", str(tiny_target_dir), "--max-batch", "2", "--repeats", "1",
                 "--context-length", "8", "--requests", "none", "--threads", "1", "--out", str(out)]) == 0
    torch.set_num_threads(threads)
    assert SpsTable.load(out).by_requests is None
    assert main(["profile", "--target", str(tiny_target_dir), "--requests", "0,2"]) == 2
    assert "--requests" in capsys.readouterr().err
