#!/bin/bash
# Issue 14's sixth DSpark run (session 36): the shipped drafter (fourth run; 8,192 draft ids, unchanged architecture)
# trained 400 more steps on *new* answers only: greedy answers to the 549 train-split prompts of 320-640 tokens that
# had only sampled ones (smollm2-t0-d), and a second T = 1 sample of every train-split prompt of <= 640 tokens with
# other seeds (smollm2-t1-e). The target cache is built once (~52 min on 2 ranks here) and reused.
# Resume an interrupted run: run this again with --resume.
set -e
cd "$(dirname "$0")/../../../.."
COMMON="--target smollm2 --responses data/distill/smollm2-t0-d.jsonl data/distill/smollm2-t1-e.jsonl \
  --draft-layers 1 --markov-rank 64 --global-batch 8 --num-anchors 32 --lr 1e-3 --checkpoint-every 50 \
  --cache-dir ${CACHE:-/work/caches/smollm2-run6}"
OMP_NUM_THREADS=1 .venv/bin/torchrun --standalone --nproc-per-node 2 -m dspark_cli.main train --kind dspark $COMMON \
  --greedy-confidence --init-from models/smollm2/dspark --steps ${STEPS:-400} --out ${OUT:-/work/runs/dspark6} \
  --no-progress "$@"
