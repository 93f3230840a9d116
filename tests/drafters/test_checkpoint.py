"""load_drafter / save_drafter: DeepSpec names and format, exact round trip, clear errors."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from dspark_core.drafters import ProposeItem, load_drafter, save_drafter
from dspark_core.errors import ModelLoadError

ALL = ["dspark", "dspark-rnn", "dflash", "eagle3"]


def copy_checkpoint(fixtures_dir, name, dst):
    dst.mkdir()
    for f in ("config.json", "model.safetensors"):
        shutil.copy(fixtures_dir / name / f, dst / f)
    return dst


def first_round(d, ref):
    items = [ProposeItem(state=d.new_state(), new_features=ref.t(i, "context_features"), new_positions_start=0,
                         new_tokens=p["prompt_ids"], anchor=p["anchor_token"], anchor_pos=p["num_prompt_tokens"])
             for i, p in enumerate(ref.prompts)]
    return d.draft(items)


@pytest.mark.parametrize("name", ALL)
def test_state_dict_names_and_shapes_are_deepspecs(name, drafter, fixtures_dir):
    d = drafter(name)
    on_disk = load_file(str(fixtures_dir / name / "model.safetensors"))
    mine = d.state_dict()
    assert set(mine) == set(on_disk)
    for k, v in on_disk.items():
        assert mine[k].shape == v.shape and torch.equal(mine[k], v), k
    target = load_file(str(fixtures_dir / "target" / "model.safetensors"))
    assert torch.equal(mine["embed_tokens.weight"], target["model.embed_tokens.weight"])
    assert torch.equal(mine["lm_head.weight"], target["lm_head.weight"])
    assert not any(p.requires_grad for p in d.parameters())


@pytest.mark.parametrize("name", ALL)
def test_save_then_load_round_trips_exactly(name, drafter, reference, fixtures_dir, tmp_path):
    d = drafter(name)
    save_drafter(d, tmp_path / name)
    assert sorted(p.name for p in (tmp_path / name).iterdir()) == ["config.json", "model.safetensors"]
    assert json.loads((tmp_path / name / "config.json").read_text()) == \
        json.loads((fixtures_dir / name / "config.json").read_text())
    again = load_drafter(tmp_path / name)
    assert type(again) is type(d) and again.config == d.config
    saved = load_file(str(tmp_path / name / "model.safetensors"))
    for k, v in d.state_dict().items():
        assert torch.equal(saved[k], v), k
    a, b = first_round(d, reference(name)), first_round(again, reference(name))
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.logits, b.logits)


def test_loader_reads_only_model_safetensors(fixtures_dir, tmp_path):
    ckpt = copy_checkpoint(fixtures_dir, "dspark", tmp_path / "ckpt")
    (ckpt / "zz-broken.safetensors").write_bytes(b"not a safetensors file")
    save_file({"fc.weight": torch.zeros(1)}, str(ckpt / "aaa-extra.safetensors"))
    assert load_drafter(ckpt).kind == "dspark"  # the fixture folders also hold reference.safetensors


def test_load_to_dtype(fixtures_dir):
    d = load_drafter(fixtures_dir / "dflash", dtype=torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in d.parameters())


def _expect(path, *fragments):
    with pytest.raises(ModelLoadError) as err:
        load_drafter(path)
    msg = str(err.value)
    for frag in fragments:
        assert frag in msg, msg
    return msg


def test_missing_directory_and_files(fixtures_dir, tmp_path):
    _expect(tmp_path / "nope", str(tmp_path / "nope"), "does not exist")
    ckpt = copy_checkpoint(fixtures_dir, "dspark", tmp_path / "a")
    (ckpt / "config.json").unlink()
    _expect(ckpt, str(ckpt), "missing config.json")
    ckpt = copy_checkpoint(fixtures_dir, "dspark", tmp_path / "b")
    (ckpt / "model.safetensors").unlink()
    _expect(ckpt, str(ckpt), "missing model.safetensors")
    (ckpt / "model.safetensors.index.json").write_text("{}")
    _expect(ckpt, "sharded")


def edit_config(ckpt, **changes):
    cfg = json.loads((ckpt / "config.json").read_text())
    for k, v in changes.items():
        if v is None:
            cfg.pop(k)
        else:
            cfg[k] = v
    (ckpt / "config.json").write_text(json.dumps(cfg))


def test_bad_config_values(fixtures_dir, tmp_path):
    cases = [
        (dict(architectures=["LlamaForCausalLM"]), "architectures", "LlamaForCausalLM"),
        (dict(markov_head_type="lstm"), "markov_head_type", "lstm"),
        (dict(block_size=0), "block_size", "0"),
        (dict(block_size=None), "block_size", "required"),
        (dict(target_layer_ids=[2, 1]), "target_layer_ids", "increasing"),
        (dict(target_layer_ids=[0, 5]), "target_layer_ids", "last layer"),
        (dict(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4}), "rope_type", "yarn"),
    ]
    for i, (change, *fragments) in enumerate(cases):
        ckpt = copy_checkpoint(fixtures_dir, "dspark", tmp_path / f"c{i}")
        edit_config(ckpt, **change)
        _expect(ckpt, str(ckpt / "config.json"), *fragments)
    ckpt = copy_checkpoint(fixtures_dir, "dspark", tmp_path / "json")
    (ckpt / "config.json").write_text("{not json")
    _expect(ckpt, "cannot read JSON")


def test_missing_unexpected_and_misshaped_tensors(fixtures_dir, tmp_path):
    src = load_file(str(fixtures_dir / "dspark" / "model.safetensors"))

    def with_tensors(tag, tensors):
        ckpt = copy_checkpoint(fixtures_dir, "dspark", tmp_path / tag)
        save_file(tensors, str(ckpt / "model.safetensors"))
        return ckpt

    _expect(with_tensors("missing", {k: v for k, v in src.items() if k != "confidence_head.proj.bias"}),
            "missing tensor", "confidence_head.proj.bias")
    _expect(with_tensors("extra", {**src, "markov_head.joint_proj.bias": torch.zeros(48)}),
            "unexpected tensor", "markov_head.joint_proj.bias")
    _expect(with_tensors("shape", {**src, "fc.weight": torch.zeros(64, 191)}),
            "'fc.weight'", "[64, 191]", "[64, 192]")
    # a DFlash config pointed at DSpark weights: the heads are unexpected
    ckpt = copy_checkpoint(fixtures_dir, "dspark", tmp_path / "kind")
    edit_config(ckpt, markov_rank=0, enable_confidence_head=False)
    _expect(ckpt, "unexpected tensor", "markov_head.markov_w1.weight")
    ckpt = copy_checkpoint(fixtures_dir, "dspark", tmp_path / "garbage")
    (ckpt / "model.safetensors").write_bytes(b"\x00" * 16)
    _expect(ckpt, "cannot read safetensors")
