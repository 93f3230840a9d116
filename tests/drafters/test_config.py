"""DrafterConfig reads and writes DeepSpec's config.json; STS calibration from config or sidecar."""

import dataclasses
import json
import shutil

import pytest
import torch

from dspark_core.drafters import DrafterConfig, ProposeItem, load_config, load_drafter
from dspark_core.errors import InvalidArgument, ModelLoadError


@pytest.mark.parametrize("name,kind,gamma", [("dspark", "dspark", 4), ("dspark-rnn", "dspark", 4),
                                             ("dflash", "dflash", 4), ("eagle3", "eagle3", 4)])
def test_fixture_configs_parse_and_round_trip(name, kind, gamma, fixtures_dir):
    raw = json.loads((fixtures_dir / name / "config.json").read_text())
    cfg = load_config(fixtures_dir / name)
    assert cfg.kind == kind and cfg.gamma == gamma
    assert cfg.num_hidden_layers == raw["num_hidden_layers"]  # the draft depth
    assert cfg.target_layer_ids == tuple(raw["target_layer_ids"]) and cfg.num_target_layers == 6
    assert (cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads) == (64, 16, 4, 2)
    assert cfg.rope_theta == 10000.0 and cfg.rms_norm_eps == 1e-6
    assert cfg.sts_temperatures == (1.0,) * gamma
    assert cfg.to_dict() == raw
    assert DrafterConfig.from_dict(cfg.to_dict()) == cfg


def test_dspark_specific_fields(fixtures_dir):
    cfg = load_config(fixtures_dir / "dspark-rnn")
    assert (cfg.block_size, cfg.mask_token_id, cfg.markov_rank, cfg.markov_head_type) == (4, 509, 16, "rnn")
    assert cfg.enable_confidence_head and cfg.confidence_head_with_markov and cfg.num_anchors == 32
    e3 = load_config(fixtures_dir / "eagle3")
    assert (e3.ttt_length, e3.step_loss_decay, e3.draft_num_hidden_layers) == (4, 0.8, 1)
    assert e3.extra["target_model_name_or_path"] == "../target"


def test_transformers4_style_rope_theta(fixtures_dir):
    raw = json.loads((fixtures_dir / "dspark" / "config.json").read_text())
    raw.pop("rope_parameters")
    raw.update(rope_theta=1e6, rope_scaling=None)
    cfg = DrafterConfig.from_dict(raw)
    assert cfg.rope_theta == 1e6 and cfg.to_dict() == raw


def test_invalid_values_raise_invalid_argument(fixtures_dir):
    cfg = load_config(fixtures_dir / "dspark")
    for field, value in [("block_size", 0), ("mask_token_id", 512), ("markov_rank", -1),
                         ("markov_head_type", "lstm"), ("num_key_value_heads", 3), ("target_layer_ids", ()),
                         ("calibration_temperatures", (1.0, 1.0)), ("calibration_temperatures", (1.0, 0.0, 1.0, 1.0))]:
        with pytest.raises(InvalidArgument):
            dataclasses.replace(cfg, **{field: value})


def _item(d, ref, i=0):
    p = ref.prompts[i]
    return ProposeItem(state=d.new_state(), new_features=ref.t(i, "context_features"), new_positions_start=0,
                       new_tokens=p["prompt_ids"], anchor=p["anchor_token"], anchor_pos=p["num_prompt_tokens"])


def test_calibration_from_config_block_and_sidecar(fixtures_dir, reference, tmp_path):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    shutil.copy(fixtures_dir / "dspark" / "model.safetensors", ckpt)
    raw = json.loads((fixtures_dir / "dspark" / "config.json").read_text())
    raw["calibration"] = {"method": "sts", "temperatures": [2.0, 1.0, 0.5, 1.5]}
    (ckpt / "config.json").write_text(json.dumps(raw))
    d = load_drafter(ckpt)
    assert d.config.sts_temperatures == (2.0, 1.0, 0.5, 1.5)
    (prop,) = d.propose([_item(d, reference("dspark"))])
    torch.testing.assert_close(prop.confidences, torch.sigmoid(prop.confidence_logits / torch.tensor([2.0, 1, 0.5, 1.5])))

    (ckpt / "calibration.json").write_text(json.dumps({"method": "sts", "temperatures": [3.0, 3.0, 3.0, 3.0]}))
    assert load_config(ckpt).sts_temperatures == (3.0,) * 4  # the sidecar wins
    (ckpt / "calibration.json").write_text(json.dumps({"method": "sts", "temperatures": [1.0]}))
    with pytest.raises(ModelLoadError, match="calibration.json"):
        load_config(ckpt)

    d.set_calibration(None)
    (prop,) = d.propose([_item(d, reference("dspark"))])
    torch.testing.assert_close(prop.confidences, torch.sigmoid(prop.confidence_logits))
