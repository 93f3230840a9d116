"""DrafterConfig reads and writes DeepSpec's config.json; STS calibration from config or sidecar."""

import dataclasses
import json
import shutil

import pytest
import torch

from dspark_core.drafters import DrafterConfig, ProposeItem, load_config, load_drafter
from dspark_core.drafters.base import DEFAULT_SUPPORT_SIZE
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


def _with_greedy_head(fixtures_dir, tmp_path):
    """The dspark fixture plus a greedy confidence output whose weights differ from the T-label head's."""
    from safetensors.torch import load_file, save_file

    ckpt = tmp_path / "greedy"
    ckpt.mkdir()
    raw = json.loads((fixtures_dir / "dspark" / "config.json").read_text())
    raw["greedy_confidence_head"] = True
    (ckpt / "config.json").write_text(json.dumps(raw))
    tensors = load_file(str(fixtures_dir / "dspark" / "model.safetensors"))
    tensors["confidence_head.greedy.weight"] = -2.0 * tensors["confidence_head.proj.weight"]
    tensors["confidence_head.greedy.bias"] = tensors["confidence_head.proj.bias"] + 1.0
    save_file(tensors, str(ckpt / "model.safetensors"))
    return ckpt, raw


def test_greedy_confidence_output_serves_temperature_zero_requests(fixtures_dir, reference, tmp_path):
    ckpt, raw = _with_greedy_head(fixtures_dir, tmp_path)
    assert load_config(ckpt).to_dict() == raw  # the extension key round-trips
    d = load_drafter(ckpt)
    plain = load_drafter(fixtures_dir / "dspark")
    ref = reference("dspark")
    greedy_item, sampled_item = _item(d, ref), dataclasses.replace(_item(d, ref), temperature=1.0, generator=torch.Generator().manual_seed(3))
    (g, s) = d.propose([greedy_item, sampled_item])
    (g0,) = plain.propose([_item(plain, ref)])
    # the drafts are the plain drafter's; the T = 0 request's confidences come from the greedy output
    assert g.tokens == g0.tokens
    assert not torch.allclose(g.confidence_logits, g0.confidence_logits)
    (s0,) = plain.propose([dataclasses.replace(_item(plain, ref), temperature=1.0, generator=torch.Generator().manual_seed(3))])
    torch.testing.assert_close(s.confidence_logits, s0.confidence_logits)
    # each output has its own STS temperatures
    (ckpt / "calibration.json").write_text(json.dumps(
        {"method": "sts", "temperatures": [2.0] * 4, "greedy": {"temperatures": [0.5, 1.0, 4.0, 1.0]}}))
    d = load_drafter(ckpt)
    assert d.config.sts_temperatures == (2.0,) * 4 and d.config.sts_temperatures_greedy == (0.5, 1.0, 4.0, 1.0)
    g, s = d.propose([_item(d, ref), dataclasses.replace(_item(d, ref), temperature=1.0, generator=torch.Generator().manual_seed(3))])
    torch.testing.assert_close(g.confidences, torch.sigmoid(g.confidence_logits / torch.tensor([0.5, 1, 4, 1])))
    torch.testing.assert_close(s.confidences, torch.sigmoid(s.confidence_logits / 2.0))
    d.set_calibration([1.0] * 4)  # a sampled-regime change keeps the greedy temperatures
    assert d.config.sts_temperatures_greedy == (0.5, 1.0, 4.0, 1.0)
    (ckpt / "calibration.json").write_text(json.dumps(
        {"method": "sts", "temperatures": [2.0] * 4, "greedy": {"temperatures": [0.0, 1, 1, 1]}}))
    with pytest.raises(ModelLoadError, match="calibration.greedy.temperatures"):
        load_config(ckpt)


def test_platt_biases_are_applied_per_regime_and_validated(fixtures_dir, reference, tmp_path):
    """calibration.json's Platt biases: c_k = sigmoid(logit_k / t_k + b_k), each regime its own; a bad list
    is refused naming the field; `to_dict` writes them back."""
    ckpt, raw = _with_greedy_head(fixtures_dir, tmp_path)
    ref = reference("dspark")
    (ckpt / "calibration.json").write_text(json.dumps(
        {"method": "platt", "temperatures": [2.0] * 4, "biases": [-0.5, 0.0, 0.25, 1.0],
         "greedy": {"method": "platt", "temperatures": [0.5, 1.0, 4.0, 1.0], "biases": [1.0, -1.0, 0.0, 0.5]}}))
    d = load_drafter(ckpt)
    assert d.config.calibration_bias_values == (-0.5, 0.0, 0.25, 1.0)
    g, s = d.propose([_item(d, ref), dataclasses.replace(_item(d, ref), temperature=1.0,
                                                         generator=torch.Generator().manual_seed(3))])
    torch.testing.assert_close(g.confidences, torch.sigmoid(g.confidence_logits / torch.tensor([0.5, 1, 4, 1])
                                                            + torch.tensor([1.0, -1.0, 0.0, 0.5])))
    torch.testing.assert_close(s.confidences, torch.sigmoid(s.confidence_logits / 2.0
                                                            + torch.tensor([-0.5, 0.0, 0.25, 1.0])))
    block = d.config.to_dict()["calibration"]
    assert block["method"] == "platt" and block["biases"] == [-0.5, 0.0, 0.25, 1.0]
    assert block["greedy"]["biases"] == [1.0, -1.0, 0.0, 0.5]
    d.set_calibration([1.0] * 4)  # a new sampled calibration without biases: STS, the greedy one is kept
    assert d.config.calibration_bias_values == (0.0,) * 4
    assert d.config.calibration_bias_values_greedy == (1.0, -1.0, 0.0, 0.5)
    for bad, field in (({"biases": [0.0, 1.0]}, "calibration.biases"),
                       ({"biases": [0.0, "x", 0.0, 0.0]}, "calibration.biases"),
                       ({"biases": [0.0, float("nan"), 0.0, 0.0]}, "calibration.biases"),
                       ({"greedy": {"temperatures": [1.0] * 4, "biases": [True, 0, 0, 0]}}, "calibration.greedy.biases"),
                       ({"method": "isotonic"}, "calibration.method")):
        (ckpt / "calibration.json").write_text(json.dumps({"method": "platt", "temperatures": [1.0] * 4, **bad}))
        with pytest.raises(ModelLoadError, match=field.replace(".", r"\.")):
            load_config(ckpt)


def test_write_calibration_keeps_the_other_regime(tmp_path):
    from dspark_core.calibration import write_calibration

    write_calibration(tmp_path, [0.5] * 4, {"fitted_on": {"temperature": 0.0}}, greedy=True)
    body = json.loads((tmp_path / "calibration.json").read_text())
    assert body["temperatures"] == [1.0] * 4 and body["greedy"]["temperatures"] == [0.5] * 4
    write_calibration(tmp_path, [2.0] * 4, {"fitted_on": {"temperature": 1.0}})
    body = json.loads((tmp_path / "calibration.json").read_text())
    assert body["temperatures"] == [2.0] * 4 and body["greedy"]["temperatures"] == [0.5] * 4
    assert body["fitted_on"]["temperature"] == 1.0 and body["greedy"]["fitted_on"]["temperature"] == 0.0


def test_greedy_confidence_head_needs_a_confidence_head(fixtures_dir):
    cfg = load_config(fixtures_dir / "dflash")
    with pytest.raises(InvalidArgument, match="greedy_confidence_head"):
        dataclasses.replace(cfg, greedy_confidence_head=True)


def test_a_drafters_config_sets_its_sampled_support_and_a_caller_may_override_it(fixtures_dir, reference, tmp_path):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    shutil.copy(fixtures_dir / "dspark" / "model.safetensors", ckpt)
    raw = json.loads((fixtures_dir / "dspark" / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps({**raw, "draft_support_size": 16}))
    assert load_config(ckpt).to_dict()["draft_support_size"] == 16  # round-trips
    ref = reference("dspark")
    for d, k in ((load_drafter(ckpt), 16), (load_drafter(ckpt, support_size=40), 40),
                 (load_drafter(fixtures_dir / "dspark"), DEFAULT_SUPPORT_SIZE)):
        assert d.support_size == min(k, d.vocab_size)
        (p,) = d.propose([dataclasses.replace(_item(d, ref), temperature=1.0, generator=torch.Generator().manual_seed(3))])
        assert tuple(p.support_ids.shape) == (len(p.tokens), min(k, d.vocab_size))
        for tok, ids, probs in zip(p.tokens, p.support_ids, p.support_probs):
            assert tok in ids.tolist() and abs(float(probs.sum()) - 1.0) < 1e-4
    cfg = load_config(fixtures_dir / "dspark")
    for bad in (-1, cfg.vocab_size + 1, 2.5):
        with pytest.raises(InvalidArgument, match="draft_support_size"):
            dataclasses.replace(cfg, draft_support_size=bad)


@pytest.mark.parametrize("name", ["dspark", "eagle3"])
def test_context_feature_dtype_rounds_the_features_as_training_saw_them(name, fixtures_dir, reference, tmp_path):
    """A drafter trained on a bf16 target cache (`context_feature_dtype`) drafts the same from float32 features as
    from the bf16 ones a verifier pod sends (the rounding is its own), and differently from the same checkpoint
    reading them unrounded: the field is what decides."""
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    shutil.copy(fixtures_dir / name / "model.safetensors", ckpt)
    raw = json.loads((fixtures_dir / name / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps({**raw, "context_feature_dtype": "bfloat16"}))
    assert load_config(ckpt).to_dict()["context_feature_dtype"] == "bfloat16"  # round-trips
    assert "context_feature_dtype" not in load_config(fixtures_dir / name).to_dict()  # absent stays absent
    ref = reference(name)
    # features with more bits than bf16 keeps: rounding them moves the drafter's inputs
    noisy = ref.t(0, "context_features") * 1.001 + 1e-3

    def draft(path, feats):  # sampled, seeded: the support probabilities show every input bit that matters
        d = load_drafter(path)
        (p,) = d.propose([dataclasses.replace(_item(d, ref), new_features=feats, temperature=1.0,
                                              generator=torch.Generator().manual_seed(5))])
        return p.tokens, p.support_probs.tolist()

    rounded = draft(ckpt, noisy)
    assert rounded == draft(ckpt, noisy.to(torch.bfloat16))  # bf16 on the wire: the same drafts
    assert rounded == draft(fixtures_dir / name, noisy.to(torch.bfloat16).float())  # what it computes
    assert rounded != draft(fixtures_dir / name, noisy)  # unrounded: other numbers
    cfg = load_config(fixtures_dir / name)
    for bad in ("int8", "fp32", 16):
        with pytest.raises(InvalidArgument, match="context_feature_dtype"):
            dataclasses.replace(cfg, context_feature_dtype=bad)
