"""CPU seconds per `dspark train` step on a target cache: the whole vocabulary vs draft vocabularies of N ids
(and bf16 autocast where the CPU has native bf16), in one process with the variants' steps alternating (so
outside load hits them alike).

    OMP_NUM_THREADS=1 python scripts/train_step_ab.py --target smollm2 --cache CACHE_DIR --steps 5 --draft-vocab 8192,4096

CACHE_DIR: a cache `dspark train` built (e.g. with --limit-prompts 8 --steps 1). Medians skip the first step.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path

import torch


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", default="smollm2", help="target name or directory")
    p.add_argument("--cache", required=True, help="target cache directory built by dspark train")
    p.add_argument("--steps", type=int, default=5, help="steps per variant")
    p.add_argument("--kind", default="dspark", choices=("dspark", "dspark-rnn", "dflash", "eagle3"))
    p.add_argument("--draft-vocab", default="8192", help="comma-separated draft vocabulary sizes to compare")
    p.add_argument("--bf16", action="store_true", help="also bf16 autocast (native bf16 CPUs only)")
    args = p.parse_args()
    torch.set_num_threads(1)

    from dspark_cli.models import resolve_target
    from dspark_core.target import TargetConfig, TargetRuntime
    from dspark_core.training.cache import TargetCache
    from dspark_core.training.distributed import DistConfig, init_distributed
    from dspark_core.training.trainer import TrainConfig, Trainer, choose_draft_vocab, fresh_drafter

    cache = TargetCache(args.cache)
    taps = tuple(cache.manifest.tap_layer_ids)
    target = TargetRuntime(TargetConfig(model_dir=resolve_target(args.target), device="cpu", tap_layer_ids=taps,
                                        weights="float32"))
    ctx = init_distributed(DistConfig(device="cpu"))
    sizes = [int(x) for x in args.draft_vocab.split(",") if x.strip()]
    variants = {"whole vocabulary": (0, False)}
    variants.update({f"draft vocab {n}": (n, False) for n in sizes})
    if args.bf16:
        variants["whole vocabulary bf16"] = (0, True)
    if sizes:
        cache.ensure_target_lse(target.model.get_output_embeddings().weight.detach().float(), progress=False)
    counts = cache.label_counts(target.vocab_size)
    out = Path(tempfile.mkdtemp(prefix="train-ab-"))
    trainers = {}
    for name, (n, bf16) in variants.items():
        cfg = TrainConfig(kind=args.kind, out_dir=str(out / name.replace(" ", "-")), steps=10_000, global_batch=8,
                          num_anchors=32, draft_layers=1, markov_rank=64, target_layer_ids=taps, block_size=7,
                          seed=0, bf16=bf16, draft_vocab_size=n)
        torch.manual_seed(0)
        vocab = choose_draft_vocab(counts, n) if n else None
        if n:
            print(f"{name}: covers {float(counts[vocab].sum()) / float(counts.sum()):.1%} of the label tokens")
        trainers[name] = Trainer(cfg, cache, fresh_drafter(target, cfg, vocab), ctx, progress=False)
    del target
    cpu = {k: [] for k in trainers}
    try:
        for rep in range(args.steps):
            for name, tr in trainers.items():
                t = time.process_time()
                m = tr.train_step()
                cpu[name].append(time.process_time() - t)
                print(f"{name:24s} step {rep}: {cpu[name][-1]:6.2f} CPU s, loss {m['loss']:.4f}, "
                      f"accept {m.get('accept', float('nan')):.3f}", flush=True)
    finally:
        shutil.rmtree(out, ignore_errors=True)
    base = None
    for name, v in cpu.items():
        v = sorted(v[1:] or v)
        med = v[len(v) // 2]
        base = base or med
        print(f"{name:24s} median {med:6.2f} CPU s per step ({base / med:.2f}x faster than the whole vocabulary)")


if __name__ == "__main__":
    main()
