#!/bin/bash
# Issue 14's fifth DSpark run (session 35): the shipped drafter widened to 16,384 draft ids, then 1,200 steps on the
# same 2,871 answers. ~17 + 12 min for the target cache (built once, reused), 2,300 s of training on 2 ranks.
# Resume an interrupted run: run this again with --resume.
set -e
cd "$(dirname "$0")/../../../.."
W=${WORK:-/work/scratch}
[ -f $W/dspark-16k/config.json ] || .venv/bin/python scripts/expand_draft_vocab.py models/smollm2/dspark $W/dspark-16k \
  --size 16384 --counts data/distill/smollm2-t0.jsonl data/distill/smollm2-t1.jsonl data/distill/smollm2-t0-c.jsonl \
  data/distill/smollm2-t1-c.jsonl data/distill/smollm2-t1-d.jsonl
COMMON="--target smollm2 --responses data/distill/smollm2-t0.jsonl data/distill/smollm2-t1.jsonl \
  data/distill/smollm2-t0-c.jsonl data/distill/smollm2-t1-c.jsonl data/distill/smollm2-t1-d.jsonl \
  --draft-layers 1 --markov-rank 64 --global-batch 8 --num-anchors 32 --lr 1e-3 --checkpoint-every 50 \
  --cache-dir ${CACHE:-/work/caches/smollm2-all}"
OMP_NUM_THREADS=1 .venv/bin/torchrun --standalone --nproc-per-node 2 -m dspark_cli.main train --kind dspark $COMMON \
  --greedy-confidence --init-from $W/dspark-16k --steps 1200 --out ${OUT:-/work/runs/dspark5} --no-progress "$@"
