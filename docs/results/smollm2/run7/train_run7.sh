#!/bin/bash
# Issue 14's seventh DSpark run (session 37): the data lever tested properly. The shipped drafter (fourth run; 8,192
# draft ids, unchanged architecture, so its round costs what the shipped one does) trained 1,200 more steps on all
# seven distillation files together: 5,006 answers, 591,566 answer tokens (the five files the shipped drafters saw
# plus session 36's smollm2-t0-d / -t1-e). The target cache is built once (~1.8M tokens) and reused.
# Resume an interrupted run: run this again with --resume.
set -e
cd "$(dirname "$0")/../../../.."
D=data/distill
COMMON="--target smollm2 --responses $D/smollm2-t0.jsonl $D/smollm2-t1.jsonl $D/smollm2-t0-c.jsonl \
  $D/smollm2-t1-c.jsonl $D/smollm2-t1-d.jsonl $D/smollm2-t0-d.jsonl $D/smollm2-t1-e.jsonl \
  --draft-layers 1 --markov-rank 64 --global-batch 8 --num-anchors 32 --lr 1e-3 --checkpoint-every 50 \
  --cache-dir ${CACHE:-/work/caches/smollm2-run7}"
OMP_NUM_THREADS=1 .venv/bin/torchrun --standalone --nproc-per-node 2 -m dspark_cli.main train --kind dspark $COMMON \
  --greedy-confidence --init-from models/smollm2/dspark --steps ${STEPS:-1200} --out ${OUT:-/work/runs/dspark7} \
  --no-progress "$@"
