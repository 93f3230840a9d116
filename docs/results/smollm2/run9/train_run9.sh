#!/bin/bash
# Issue 14's ninth DSpark run (session 40): more distinct prompts. The shipped drafter (eighth run; 8,192 draft ids,
# unchanged architecture, so its round costs what the shipped one does) trained 1,200 more steps on all twelve
# distillation files: the eighth run's eight plus session 39's smollm2-t{0,1}-{g,h} (838 answers to the 419 train-split
# prompts no file had yet, 641-1,600 prompt tokens, mostly code). The target cache (each prompt computed once) is built
# once and reused. Resume an interrupted run: run this again with --resume.
set -e
cd "$(dirname "$0")/../../../.."
D=data/distill
COMMON="--target smollm2 --responses $D/smollm2-t0.jsonl $D/smollm2-t1.jsonl $D/smollm2-t0-c.jsonl \
  $D/smollm2-t1-c.jsonl $D/smollm2-t1-d.jsonl $D/smollm2-t0-d.jsonl $D/smollm2-t1-e.jsonl $D/smollm2-t1-f.jsonl \
  $D/smollm2-t0-g.jsonl $D/smollm2-t1-g.jsonl $D/smollm2-t0-h.jsonl $D/smollm2-t1-h.jsonl \
  --draft-layers 1 --markov-rank 64 --global-batch 8 --num-anchors 32 --lr 1e-3 --checkpoint-every 50 \
  --cache-dir ${CACHE:-/work/caches/smollm2-run9}"
OMP_NUM_THREADS=1 .venv/bin/torchrun --standalone --nproc-per-node 2 -m dspark_cli.main train --kind dspark $COMMON \
  --greedy-confidence --init-from models/smollm2/dspark --steps ${STEPS:-1200} --out ${OUT:-/work/runs/dspark9} \
  --no-progress "$@"
