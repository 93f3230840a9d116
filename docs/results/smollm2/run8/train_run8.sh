#!/bin/bash
# Issue 14's eighth DSpark run (session 39): the data lever again. The shipped drafter (seventh run; 8,192 draft ids,
# unchanged architecture, so its round costs what the shipped one does) trained 1,200 more steps on all eight
# distillation files: 6,592 answers to 1,586 prompts, 779,894 answer tokens (the seventh run's seven files plus
# session 38's smollm2-t1-f). The target cache (~2.34M tokens, each prompt computed once) is built once and reused.
# Resume an interrupted run: run this again with --resume.
set -e
cd "$(dirname "$0")/../../../.."
D=data/distill
COMMON="--target smollm2 --responses $D/smollm2-t0.jsonl $D/smollm2-t1.jsonl $D/smollm2-t0-c.jsonl \
  $D/smollm2-t1-c.jsonl $D/smollm2-t1-d.jsonl $D/smollm2-t0-d.jsonl $D/smollm2-t1-e.jsonl $D/smollm2-t1-f.jsonl \
  --draft-layers 1 --markov-rank 64 --global-batch 8 --num-anchors 32 --lr 1e-3 --checkpoint-every 50 \
  --cache-dir ${CACHE:-/work/caches/smollm2-run8}"
OMP_NUM_THREADS=1 .venv/bin/torchrun --standalone --nproc-per-node 2 -m dspark_cli.main train --kind dspark $COMMON \
  --greedy-confidence --init-from models/smollm2/dspark --steps ${STEPS:-1200} --out ${OUT:-/work/runs/dspark8} \
  --no-progress "$@"
