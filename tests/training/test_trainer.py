"""`dspark train` end to end on the tiny target, exact resume, checkpoint format, cache compatibility."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from dspark_cli.main import main
from dspark_core.drafters import DrafterConfig, build_drafter, load_drafter, save_drafter
from dspark_core.errors import InvalidArgument
from dspark_core.target import TargetConfig, TargetRuntime
from dspark_core.training.cache import TargetCache
from dspark_core.training.data import load_prompts, split
from dspark_core.training.distributed import DistConfig, init_distributed
from dspark_core.training.prepare import LOCK_FILE, DistillSettings, prepare_target_cache
from dspark_core.training.trainer import (TrainConfig, Trainer, default_target_layers, drafter_config_for_target,
                                          fresh_drafter, init_from_checkpoint, lr_factor, mask_token_for)

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPTS = ["def add(a, b):", "What is 12 * 7?", "Explain what a list is.", "for i in range(10):", "The answer is",
           "Write a function", "Compute 3 + 4", "What is Python?", "print hello", "Sum a list"]
TRAIN_ARGS = ["--max-new-tokens", "20", "--num-anchors", "12", "--block-size", "4", "--cache-dtype", "float32",
              "--device", "cpu", "--no-progress"]


def write_prompts(path, n=24):
    texts = [f"{PROMPTS[i % len(PROMPTS)]} ({i})" for i in range(n)]
    path.write_text("".join(json.dumps({"turns": [t]}) + "\n" for t in texts))
    return path


def losses(run_dir):
    return [json.loads(line)["loss"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def cli_run(tiny_target_dir, tmp_path_factory):
    """One real `dspark train` (distillation, cache, training), shared by the tests below."""
    root = tmp_path_factory.mktemp("train")
    data = write_prompts(root / "mbpp.jsonl")
    out = root / "run"
    rc = main(["train", "--kind", "dspark", "--target", str(tiny_target_dir), "--data", str(data), "--out", str(out),
               "--steps", "12", "--global-batch", "6", "--lr", "3e-3", "--checkpoint-every", "5", *TRAIN_ARGS])
    assert rc == 0
    return out, data


@pytest.fixture(scope="module")
def target(tiny_target_dir):
    return TargetRuntime(TargetConfig(str(tiny_target_dir), device="cpu", dtype="float32",
                                      tap_layer_ids=default_target_layers(4)))


@pytest.fixture(scope="module")
def ctx():
    return init_distributed(DistConfig(device="cpu"))


def test_dspark_train_end_to_end_lowers_the_loss_and_writes_a_loadable_drafter(cli_run):
    out, _ = cli_run
    curve = losses(out)
    assert len(curve) == 12
    assert sum(curve[-3:]) / 3 < curve[0] - 0.05
    drafter = load_drafter(out / "final")
    assert drafter.kind == "dspark" and drafter.block_size == 4 and drafter.has_confidence
    assert drafter.target_layer_ids == (0, 1, 2) and drafter.config.mask_token_id is not None
    steps = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert steps == ["step-000010", "step-000012"]  # every 5 steps + the end, newest 2 kept
    assert (out / "checkpoints" / "step-000012" / "trainer_state.pt").is_file()
    card = json.loads((out / "training_card.json").read_text())
    assert card["steps"] == 12 and card["tokens_processed"] > 0 and card["data"]["num_samples"] > 10
    assert set(card["final_losses"]) >= {"loss", "ce", "tv", "conf"}
    assert "tokens/s" in (out / "README.md").read_text()
    cache_dir = out / "cache"
    assert (cache_dir / "source.json").is_file() and (cache_dir / "samples.jsonl").is_file()


def test_frozen_embedding_and_head_are_the_targets(cli_run, target):
    drafter = load_drafter(cli_run[0] / "final")
    torch.testing.assert_close(drafter.embed_tokens.weight, target.model.get_input_embeddings().weight, rtol=0, atol=0)
    torch.testing.assert_close(drafter.lm_head.weight, target.model.get_output_embeddings().weight, rtol=0, atol=0)
    assert drafter.config.mask_token_id == target.tokenizer.get_vocab()["<|mask|>"]


class _Killed(Exception):
    pass


class _DiesAfter(Trainer):
    """A trainer whose process 'dies' when it starts step `die_at + 1`."""

    die_at = 3

    def train_step(self):
        if self.step == self.die_at:
            raise _Killed
        return super().train_step()


@pytest.mark.parametrize("kind", ["dspark", "eagle3"])
def test_resume_continues_exactly(cli_run, target, ctx, tmp_path, kind):
    cache = TargetCache(cli_run[0] / "cache")

    def config(out):
        return TrainConfig(kind=kind, out_dir=str(out), steps=6, global_batch=4, micro_batch=2, lr=3e-3,
                           num_anchors=8, block_size=3, checkpoint_every=3, target_layer_ids=(0, 1, 2))

    full = tmp_path / "full"
    Trainer(config(full), cache, fresh_drafter(target, config(full)), ctx, progress=False).train()
    cut = tmp_path / "cut"
    with pytest.raises(_Killed):
        _DiesAfter(config(cut), cache, fresh_drafter(target, config(cut)), ctx, progress=False).train()
    assert len(losses(cut)) == 3
    resumed = Trainer(config(cut), cache, fresh_drafter(target, config(cut)), ctx, resume=True, progress=False)
    assert resumed.step == 3 and resumed.position == 12
    resumed.train()
    a, b = load_file(str(full / "final" / "model.safetensors")), load_file(str(cut / "final" / "model.safetensors"))
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    assert losses(cut) == losses(full)


def test_a_second_job_waits_for_the_cache_another_job_is_building_then_reuses_it(cli_run, target, ctx):
    import fcntl
    import threading
    out, data = cli_run
    train, _ = split(load_prompts(data))
    settings = DistillSettings(max_new_tokens=20, dtype="float32")
    said, opened = [], []
    job = threading.Thread(target=lambda: opened.append(
        prepare_target_cache(target, train, out / "cache", ctx, settings, progress=False, log=said.append)))
    with (out / "cache" / LOCK_FILE).open("a") as other:
        fcntl.flock(other, fcntl.LOCK_EX)  # another job holds the cache directory
        job.start()
        job.join(1.0)
        assert job.is_alive() and not opened
        assert said and said[0].startswith("waiting for another process") and str(out / "cache") in said[0]
        fcntl.flock(other, fcntl.LOCK_UN)
    job.join(60)
    built = json.loads((out / "cache" / "manifest.json").read_text())["num_samples"]
    assert not job.is_alive() and len(opened[0]) == built
    assert said[-1].startswith("reusing target cache")


def test_cache_refuses_a_drafter_with_other_layers_or_hidden_size(cli_run, target, ctx, tmp_path):
    cache = TargetCache(cli_run[0] / "cache")
    cfg = TrainConfig(out_dir=str(tmp_path), steps=1, global_batch=1, block_size=3, target_layer_ids=(0, 1))
    with pytest.raises(InvalidArgument, match="target_layer_ids"):
        Trainer(cfg, cache, fresh_drafter(target, cfg), ctx, progress=False)
    narrow = DrafterConfig(architecture="Qwen3DSparkModel", vocab_size=target.vocab_size, hidden_size=32,
                           intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                           num_hidden_layers=1, target_layer_ids=(0, 1, 2), block_size=3, mask_token_id=0,
                           markov_rank=8, enable_confidence_head=True)
    with pytest.raises(InvalidArgument, match="hidden_size"):
        Trainer(TrainConfig(out_dir=str(tmp_path), steps=1, global_batch=1), cache, build_drafter(narrow), ctx,
                progress=False)


def test_a_cache_dir_built_from_other_prompts_is_not_reused(cli_run, target, ctx):
    out, data = cli_run
    train, _ = split(load_prompts(data))
    settings = DistillSettings(max_new_tokens=20, dtype="float32")
    cache = prepare_target_cache(target, train, out / "cache", ctx, settings, progress=False)  # same inputs: reused
    assert len(cache) == json.loads((out / "cache" / "manifest.json").read_text())["num_samples"]
    with pytest.raises(InvalidArgument, match="cache_dir"):
        prepare_target_cache(target, train[:-1], out / "cache", ctx, settings, progress=False)


def test_drafter_shape_defaults_for_a_target(target):
    assert default_target_layers(36) == (1, 9, 17, 25, 33)  # DeepSpec's Qwen3-4B choice
    assert default_target_layers(4) == (0, 1, 2) and default_target_layers(2) == (0,)
    dspark = drafter_config_for_target(target, TrainConfig(target_layer_ids=(0, 1, 2)))
    assert (dspark.block_size, dspark.num_hidden_layers, dspark.markov_rank) == (7, 1, 16)
    assert dspark.hidden_size == target.hidden_size and dspark.vocab_size == target.vocab_size
    eagle = drafter_config_for_target(target, TrainConfig(kind="eagle3", block_size=5))
    assert eagle.kind == "eagle3" and eagle.ttt_length == 5
    dflash = drafter_config_for_target(target, TrainConfig(kind="dflash"))
    assert dflash.kind == "dflash"
    assert mask_token_for(None, 100) == 99


def test_lr_warms_up_then_decays_to_zero():
    f = [lr_factor(s, 100, 0.04) for s in range(100)]
    assert f[:4] == pytest.approx([0.25, 0.5, 0.75, 1.0]) and f[4] == pytest.approx(1.0)
    assert all(a >= b for a, b in zip(f[3:], f[4:])) and f[-1] < 0.001


def test_train_config_names_the_bad_field():
    with pytest.raises(InvalidArgument, match="global_batch"):
        TrainConfig(global_batch=0)
    with pytest.raises(InvalidArgument, match="kind"):
        TrainConfig(kind="medusa")
    with pytest.raises(InvalidArgument, match="target_layer_ids"):
        TrainConfig(target_layer_ids=(3, 1))
    with pytest.raises(InvalidArgument, match="draft_layers"):
        TrainConfig(kind="eagle3", draft_layers=2)


def test_a_fresh_run_refuses_an_output_directory_with_checkpoints(cli_run, target, ctx):
    out = cli_run[0]
    cfg = TrainConfig(out_dir=str(out), steps=12, global_batch=6, block_size=4, target_layer_ids=(0, 1, 2))
    with pytest.raises(InvalidArgument, match="out_dir"):
        Trainer(cfg, TargetCache(out / "cache"), fresh_drafter(target, cfg), ctx, progress=False)


def test_init_from_copies_a_checkpoint_and_keeps_the_targets_frozen_rows(cli_run, target):
    final = cli_run[0] / "final"
    saved = load_file(str(final / "model.safetensors"))
    for block in (4, 6):  # the run's block size, and another one (no weight depends on it)
        cfg = TrainConfig(block_size=block, target_layer_ids=(0, 1, 2))
        drafter = init_from_checkpoint(fresh_drafter(target, cfg), final)
        assert drafter.config.block_size == block
        for k, v in drafter.state_dict().items():
            if k in ("embed_tokens.weight", "lm_head.weight"):
                continue
            assert torch.equal(v, saved[k].float()), k
        assert torch.equal(drafter.lm_head.weight, target.model.get_output_embeddings().weight.float())
    with pytest.raises(InvalidArgument, match="init_from"):  # other taps
        init_from_checkpoint(fresh_drafter(target, TrainConfig(block_size=4, target_layer_ids=(0, 1))), final)
    with pytest.raises(InvalidArgument, match="init_from"):  # other kind
        init_from_checkpoint(fresh_drafter(target, TrainConfig(kind="dflash", target_layer_ids=(0, 1, 2))), final)


def test_init_from_grows_a_deeper_drafter_that_starts_out_computing_the_same(cli_run, target, tmp_path):
    final = cli_run[0] / "final"
    shallow = init_from_checkpoint(fresh_drafter(target, TrainConfig(block_size=4, target_layer_ids=(0, 1, 2))), final)
    deep = init_from_checkpoint(fresh_drafter(target, TrainConfig(block_size=4, target_layer_ids=(0, 1, 2),
                                                                  draft_layers=3)), final)
    assert len(deep.layers) == 3
    for i in (1, 2):  # copies of the last layer whose output projections are zero
        assert not deep.layers[i].self_attn.o_proj.weight.any() and not deep.layers[i].mlp.down_proj.weight.any()
        assert torch.equal(deep.layers[i].mlp.gate_proj.weight, shallow.layers[0].mlp.gate_proj.weight)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, target.vocab_size, (1, 24), generator=g)
    feats = torch.randn(1, 24, shallow.config.feature_size, generator=g)
    anchors = torch.tensor([[0, 5, 11, 19]])
    with torch.no_grad():
        a, b = shallow.training_forward(ids, feats, anchors), deep.training_forward(ids, feats, anchors)
    assert torch.allclose(a.logits, b.logits, atol=1e-5) and torch.allclose(a.confidence_logits, b.confidence_logits,
                                                                          atol=1e-5)
    save_drafter(deep, tmp_path / "deep")
    with pytest.raises(InvalidArgument, match="draft layers"):  # shallower than the checkpoint
        init_from_checkpoint(fresh_drafter(target, TrainConfig(block_size=4, target_layer_ids=(0, 1, 2))),
                             tmp_path / "deep")


def test_cli_init_from_continues_training_a_checkpoint(cli_run, tiny_target_dir, tmp_path):
    out, data = cli_run
    run = tmp_path / "ft"
    rc = main(["train", "--kind", "dspark", "--target", str(tiny_target_dir), "--data", str(data), "--out", str(run),
               "--cache-dir", str(out / "cache"), "--steps", "2", "--global-batch", "6", "--lr", "1e-3",
               "--init-from", str(out / "final"), "--confidence-support", "8", *TRAIN_ARGS])
    assert rc == 0
    card = json.loads((run / "training_card.json").read_text())
    assert card["config"]["init_from"] == str(out / "final") and card["config"]["confidence_support"] == 8
    # the first step starts from the checkpoint, not from a fresh drafter: its loss is near the run's last
    first = losses(run)[0]
    assert first < losses(out)[0] - 0.05


def test_cli_init_from_a_missing_directory_is_one_line(cli_run, tiny_target_dir, tmp_path, capsys):
    _, data = cli_run
    rc = main(["train", "--target", str(tiny_target_dir), "--data", str(data), "--out", str(tmp_path / "x"),
               "--init-from", str(tmp_path / "nope"), *TRAIN_ARGS])
    assert rc == 2
    assert "--init-from" in capsys.readouterr().err


def test_trainable_confidence_moves_only_the_confidence_head(cli_run, target, ctx, tmp_path):
    final = cli_run[0] / "final"
    cfg = TrainConfig(out_dir=str(tmp_path / "conf"), steps=2, global_batch=4, lr=1e-2, num_anchors=8, block_size=4,
                      target_layer_ids=(0, 1, 2), trainable="confidence", init_from=str(final))
    drafter = init_from_checkpoint(fresh_drafter(target, cfg), final)
    before = {k: v.clone() for k, v in drafter.state_dict().items()}
    Trainer(cfg, TargetCache(cli_run[0] / "cache"), drafter, ctx, progress=False).train()
    after = load_file(str(tmp_path / "conf" / "final" / "model.safetensors"))
    moved = {k for k in before if not torch.equal(before[k], after[k].to(before[k].dtype))}
    assert moved and all(k.startswith("confidence_head.") for k in moved), moved
    with pytest.raises(InvalidArgument, match="trainable"):
        TrainConfig(kind="dflash", trainable="confidence")
    with pytest.raises(InvalidArgument, match="trainable"):
        TrainConfig(trainable="backbone")


def test_cli_distills_at_several_temperatures_and_trains_on_all(cli_run, tiny_target_dir, tmp_path, capsys):
    _, data = cli_run
    run = tmp_path / "mix"
    rc = main(["train", "--kind", "dflash", "--target", str(tiny_target_dir), "--data", str(data), "--out", str(run),
               "--distill-temperature", "0,1", "--steps", "2", "--global-batch", "4", *TRAIN_ARGS])
    assert rc == 0
    greedy, sampled = TargetCache(run / "cache" / "T0"), TargetCache(run / "cache" / "T1")
    card = json.loads((run / "training_card.json").read_text())
    assert card["data"]["distill"]["temperature"] == [0.0, 1.0]
    assert card["data"]["num_samples"] == len(greedy) + len(sampled) == 2 * len(greedy)
    # the T = 0 cache holds the target's own greedy answers: the same prompt, a different response than at T = 1
    assert [greedy[i]["input_ids"].shape for i in range(3)] != [sampled[i]["input_ids"].shape for i in range(3)] or \
        any(not torch.equal(greedy[i]["input_ids"], sampled[i]["input_ids"]) for i in range(3))
    with pytest.raises(SystemExit) as exit_:
        main(["train", "--target", str(tiny_target_dir), "--data", str(data), "--out", str(tmp_path / "bad"),
              "--distill-temperature", "0,-1", *TRAIN_ARGS])
    assert exit_.value.code == 2 and "--distill-temperature" in capsys.readouterr().err


def test_concat_cache_reads_its_parts_in_order(cli_run):
    from dspark_core.training.cache import ConcatCache

    part = TargetCache(cli_run[0] / "cache")
    both = ConcatCache([part, part], cli_run[0])
    assert len(both) == 2 * len(part) and both.manifest.num_tokens == 2 * part.manifest.num_tokens
    last = len(part) - 1
    assert torch.equal(both[len(part) + last]["features"], part[last]["features"])
    assert torch.equal(both[0]["input_ids"], part[0]["input_ids"])
    with pytest.raises(IndexError):
        both[2 * len(part)]


def test_cli_greedy_confidence_adds_a_trained_greedy_output(cli_run, tiny_target_dir, tmp_path):
    out, data = cli_run
    run = tmp_path / "greedy"
    rc = main(["train", "--kind", "dspark", "--target", str(tiny_target_dir), "--data", str(data), "--out", str(run),
               "--cache-dir", str(out / "cache"), "--steps", "3", "--global-batch", "6", "--lr", "3e-3",
               "--init-from", str(out / "final"), "--greedy-confidence", *TRAIN_ARGS])
    assert rc == 0
    assert "gconf" in json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])
    before = load_file(str(out / "final" / "model.safetensors"))
    after = load_file(str(run / "final" / "model.safetensors"))
    assert after["confidence_head.greedy.weight"].shape == before["confidence_head.proj.weight"].shape
    drafter = load_drafter(run / "final")
    assert drafter.config.greedy_confidence_head and drafter.confidence_head.greedy is not None
    # it started as a copy of the confidence head (init_from) and then trained on its own label
    assert not torch.equal(after["confidence_head.greedy.weight"], after["confidence_head.proj.weight"])
    with pytest.raises(InvalidArgument, match="greedy_confidence"):
        TrainConfig(kind="dflash", greedy_confidence=True)


def test_trainable_one_confidence_output_leaves_the_other_alone(cli_run, target, ctx, tmp_path):
    final = cli_run[0] / "final"
    for which, prefix in (("confidence-sampled", "confidence_head.proj."),
                          ("confidence-greedy", "confidence_head.greedy.")):
        cfg = TrainConfig(out_dir=str(tmp_path / which), steps=2, global_batch=4, lr=1e-2, num_anchors=8,
                          block_size=4, target_layer_ids=(0, 1, 2), trainable=which, init_from=str(final),
                          greedy_confidence=True)
        drafter = init_from_checkpoint(fresh_drafter(target, cfg), final)
        before = {k: v.clone() for k, v in drafter.state_dict().items()}
        Trainer(cfg, TargetCache(cli_run[0] / "cache"), drafter, ctx, progress=False).train()
        after = load_file(str(tmp_path / which / "final" / "model.safetensors"))
        moved = {k for k in before if not torch.equal(before[k], after[k].to(before[k].dtype))}
        assert moved and all(k.startswith(prefix) for k in moved), (which, moved)


@pytest.mark.parametrize("kind", ["dspark", "eagle3"])
def test_cli_draft_vocab_trains_ships_referencing_the_target_and_decodes_exactly(cli_run, tiny_target_dir, target,
                                                                                 tmp_path, capsys, kind):
    from dspark_core.drafters.checkpoint import read_target_tensors
    from dspark_core.engine import Engine, EngineConfig
    from dspark_core.errors import ModelLoadError
    from dspark_core.sampling import SamplingParams
    from dspark_core.training.cache import LSE_SUFFIX

    out, data = cli_run
    run = tmp_path / kind
    rc = main(["train", "--kind", kind, "--target", str(tiny_target_dir), "--data", str(data), "--out", str(run),
               "--cache-dir", str(out / "cache"), "--steps", "4", "--global-batch", "6", "--lr", "3e-3",
               "--draft-vocab", "64", *TRAIN_ARGS])
    assert rc == 0
    assert "draft vocabulary: 64 of" in capsys.readouterr().err
    assert list((out / "cache").glob("*" + LSE_SUFFIX))  # the log-partition pass, beside the shards
    assert all(torch.isfinite(torch.tensor(v)) for v in losses(run))
    drafter = load_drafter(run / "final")
    ids = drafter.draft_vocab_ids
    assert drafter.config.draft_vocab_size == 64 and ids.shape == (64,) and bool((ids[1:] > ids[:-1]).all())
    embed, head = read_target_tensors(tiny_target_dir)
    assert torch.equal(drafter.lm_head.weight, head.float()[ids])
    # the most frequent labels of the training data are in it
    counts = TargetCache(out / "cache").label_counts(target.vocab_size)
    assert int(counts.argmax()) in set(ids.tolist())

    # shipped with only its own tensors: it needs the target to load, and then computes the same
    from dspark_core.drafters.checkpoint import save_drafter as save

    shipped = tmp_path / "shipped"
    save(drafter, shipped, reference_target=True)
    stored = load_file(str(shipped / "model.safetensors"))
    assert "lm_head.weight" not in stored and "embed_tokens.weight" not in stored and "draft_vocab_ids" in stored
    with pytest.raises(ModelLoadError, match="beside the target"):
        load_drafter(shipped)
    again = load_drafter(shipped, target=str(tiny_target_dir))
    assert torch.equal(again.lm_head.weight, drafter.lm_head.weight)
    assert torch.equal(again.embed_tokens.weight, drafter.embed_tokens.weight)

    # continuing it (--init-from) keeps its draft vocabulary
    more = tmp_path / f"{kind}-more"
    assert main(["train", "--kind", kind, "--target", str(tiny_target_dir), "--data", str(data), "--out", str(more),
                 "--cache-dir", str(out / "cache"), "--steps", "1", "--global-batch", "6",
                 "--init-from", str(run / "final"), *TRAIN_ARGS]) == 0
    assert "kept from" in capsys.readouterr().err
    assert torch.equal(load_drafter(more / "final").draft_vocab_ids, ids)

    # greedy speculative decoding with it equals the target's own decoding; every draft is a draft-vocab id
    prompts = [[5, 9, 12, 30, 41], [7, 7, 8], [100, 3, 19, 22, 23, 24, 60, 61, 90]]
    tapped = TargetRuntime(TargetConfig(str(tiny_target_dir), device="cpu", dtype="float32",
                                        tap_layer_ids=again.target_layer_ids))
    params = SamplingParams(temperature=0, max_new_tokens=16)
    ar = Engine(tapped, None, EngineConfig(policy="ar"))
    want = [ar.generate(p, params).output_ids for p in prompts]
    spec = Engine(tapped, again, EngineConfig(policy="fixed"))
    got = [spec.generate(p, params) for p in prompts]
    assert [r.output_ids for r in got] == want
    st = again.new_state()
    from dspark_core.drafters.base import ProposeItem

    feats = torch.randn(3, again.config.feature_size)
    prop = again.propose([ProposeItem(state=st, new_features=feats, new_positions_start=0, new_tokens=[5, 9, 12],
                                      anchor=30, anchor_pos=3, temperature=1.0,
                                      generator=torch.Generator().manual_seed(0))])[0]
    assert set(prop.tokens) <= set(ids.tolist()) and set(prop.support_ids.flatten().tolist()) <= set(ids.tolist())


def test_cli_add_cache_trains_on_earlier_caches_too(cli_run, tiny_target_dir, tmp_path, capsys):
    out, data = cli_run
    run = tmp_path / "added"
    rc = main(["train", "--kind", "dflash", "--target", str(tiny_target_dir), "--data", str(data), "--out", str(run),
               "--cache-dir", str(out / "cache"), "--add-cache", str(out / "cache"), "--steps", "1",
               "--global-batch", "4", *TRAIN_ARGS])
    assert rc == 0 and "adding target cache" in capsys.readouterr().err
    card = json.loads((run / "training_card.json").read_text())
    assert card["data"]["num_samples"] == 2 * len(TargetCache(out / "cache"))
    assert card["data"]["added_caches"] == [str(out / "cache")]
    capsys.readouterr()
    rc = main(["train", "--kind", "dflash", "--target", str(tiny_target_dir), "--data", str(data), "--out",
               str(tmp_path / "bad"), "--cache-dir", str(out / "cache"), "--add-cache", str(tmp_path), *TRAIN_ARGS])
    assert rc == 2 and "--add-cache must be a complete target cache" in capsys.readouterr().err


@pytest.mark.parametrize("kind", ["dspark", "eagle3"])
def test_layer_init_target_copies_the_targets_last_layers_and_keeps_the_deepest_tap(target, kind):
    cfg = TrainConfig(kind=kind, layer_init="target", target_layer_ids=(0, 1, 2))
    drafter = fresh_drafter(target, cfg)
    src = list(target.model.model.layers)[-1]
    mine = drafter.layers[-1]
    h = target.hidden_size
    for name in ("q_proj", "k_proj", "v_proj"):
        w = getattr(src.self_attn, name).weight.float()
        assert torch.equal(getattr(mine.self_attn, name).weight[:, -w.shape[1]:], w)
    assert torch.equal(mine.mlp.down_proj.weight, src.mlp.down_proj.weight.float())
    assert torch.equal(mine.self_attn.o_proj.weight, src.self_attn.o_proj.weight.float())
    features = torch.randn(3, 3 * h)
    # the context starts as the deepest tapped layer's features alone
    assert torch.allclose(drafter.fc(features), features[:, -h:])
    random = fresh_drafter(target, TrainConfig(kind=kind, target_layer_ids=(0, 1, 2)))
    assert not torch.equal(random.layers[-1].mlp.down_proj.weight, mine.mlp.down_proj.weight)
    with pytest.raises(InvalidArgument, match="layer_init"):
        TrainConfig(layer_init="zeros")
