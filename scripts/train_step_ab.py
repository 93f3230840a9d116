"""CPU seconds per `dspark train` step on a target cache: the slot-by-slot heads vs the teacher-forced heads,
float32 vs bf16 autocast, in one process with the variants' steps alternating (so outside load hits them alike).

    OMP_NUM_THREADS=1 python scripts/train_step_ab.py --target smollm2 --cache CACHE_DIR --steps 5

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
    p.add_argument("--kind", default="dspark", choices=("dspark", "dspark-rnn", "dflash"))
    args = p.parse_args()
    torch.set_num_threads(1)

    from dspark_cli.models import resolve_target
    from dspark_core.drafters.dspark import DSparkDrafter
    from dspark_core.target import TargetConfig, TargetRuntime
    from dspark_core.training.cache import TargetCache
    from dspark_core.training.distributed import DistConfig, init_distributed
    from dspark_core.training.trainer import TrainConfig, Trainer, fresh_drafter

    cache = TargetCache(args.cache)
    taps = tuple(cache.manifest.tap_layer_ids)
    target = TargetRuntime(TargetConfig(model_dir=resolve_target(args.target), device="cpu", tap_layer_ids=taps))
    ctx = init_distributed(DistConfig(device="cpu"))
    teacher_forced = DSparkDrafter.teacher_forced_heads

    def slot_by_slot(self, hidden, base_logits, teacher_prev):
        return self.run_heads(hidden, base_logits, teacher_prev[:, 0], teacher_prev=teacher_prev)

    variants = {"slot-by-slot fp32": (slot_by_slot, False), "teacher-forced fp32": (teacher_forced, False),
                "teacher-forced bf16": (teacher_forced, True)}
    out = Path(tempfile.mkdtemp(prefix="train-ab-"))
    trainers = {}
    for name, (_, bf16) in variants.items():
        cfg = TrainConfig(kind=args.kind, out_dir=str(out / name.replace(" ", "-")), steps=10_000, global_batch=8,
                          num_anchors=32, draft_layers=1, markov_rank=64, target_layer_ids=taps, block_size=7,
                          seed=0, bf16=bf16)
        torch.manual_seed(0)
        trainers[name] = Trainer(cfg, cache, fresh_drafter(target, cfg), ctx, progress=False)
    del target
    cpu = {k: [] for k in trainers}
    try:
        for rep in range(args.steps):
            for name, tr in trainers.items():
                DSparkDrafter.teacher_forced_heads = variants[name][0]
                t = time.process_time()
                m = tr.train_step()
                cpu[name].append(time.process_time() - t)
                print(f"{name:22s} step {rep}: {cpu[name][-1]:6.2f} CPU s, loss {m['loss']:.4f}", flush=True)
    finally:
        DSparkDrafter.teacher_forced_heads = teacher_forced
        shutil.rmtree(out, ignore_errors=True)
    base = None
    for name, v in cpu.items():
        v = sorted(v[1:] or v)
        med = v[len(v) // 2]
        base = base or med
        print(f"{name:22s} median {med:6.2f} CPU s per step ({med / base:.2f}x the slot-by-slot path)")


if __name__ == "__main__":
    main()
