"""Named targets and their shipped drafters: models/<kind> for tiny, models/<target>/<kind> for another."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from dspark_core import stack
from dspark_core.errors import ModelLoadError

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def roots(tmp_path):
    models, home = tmp_path / "models", tmp_path / "home"
    (models / "target").mkdir(parents=True)
    shutil.copy(REPO / "models" / "target" / "config.json", models / "target" / "config.json")
    for kind in ("dspark", "eagle3"):
        (models / kind).mkdir()
        shutil.copy(REPO / "models" / kind / "config.json", models / kind / "config.json")
    smol = home / "models" / "smollm2-135m-instruct"
    smol.mkdir(parents=True)
    (smol / "config.json").write_text("{}")
    (models / "smollm2" / "dspark").mkdir(parents=True)
    cfg = json.loads((REPO / "models" / "dspark" / "config.json").read_text())
    cfg[stack.NOT_AUTO_KEY] = "still in training"
    (models / "smollm2" / "dspark" / "config.json").write_text(json.dumps(cfg))
    return models, home, smol


def test_each_named_target_has_its_own_drafters(roots):
    models, home, smol = roots
    assert stack.target_name(str(models / "target"), models, home) == "tiny"
    assert stack.target_name(str(smol), models, home) == "smollm2"
    assert stack.target_name(str(models), models, home) is None
    assert stack.drafters_dir(str(models / "target"), models, home) == models
    assert stack.drafters_dir(str(smol), models, home) == models / "smollm2"
    assert stack.resolve_drafter_path("eagle3", None, models, str(models / "target"), home=home) == \
        str(models / "eagle3")
    assert stack.resolve_drafter_path("dspark", None, models, str(smol), home=home) == \
        str(models / "smollm2" / "dspark")
    with pytest.raises(ModelLoadError, match="not installed"):
        stack.resolve_drafter_path("eagle3", None, models, str(smol), home=home)


def test_auto_passes_over_a_drafter_marked_not_default_and_says_why(roots):
    models, home, smol = roots
    said = []
    assert stack.resolve_drafter_path("auto", None, models, str(smol), say=said.append, home=home) is None
    assert "still in training" in said[0] and "--drafter dspark" in said[0]
    assert stack.resolve_drafter_path("auto", None, models, str(models / "target"), home=home) == \
        str(models / "dspark")


def test_the_default_target_is_a_named_one(roots, monkeypatch):
    models, home, smol = roots
    assert stack.resolve_target(None, models, home) == str(stack.target_dirs(models, home)[stack.DEFAULT_TARGET])
    monkeypatch.setattr(stack, "DEFAULT_TARGET", "smollm2")
    assert stack.resolve_target(None, models, home) == str(smol)
    shutil.rmtree(smol)
    with pytest.raises(ModelLoadError, match="dspark models install smollm2"):
        stack.resolve_target(None, models, home)
