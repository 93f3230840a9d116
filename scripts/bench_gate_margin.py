"""`dspark bench` with EngineConfig.draft_gate_margin set to $MARGIN for every engine it builds (an A/B of the
draft gate's margin, which is not a CLI flag):

    MARGIN=0.75 OMP_NUM_THREADS=1 python scripts/bench_gate_margin.py bench --target smollm2 --policy causal,ar \
        --concurrency 1 --dataset data/dev/mbpp.jsonl --dataset data/dev/math500.jsonl --num-prompts 24 \
        --max-new-tokens 128 --temperature 1 --no-hf --no-llamacpp --json
"""
import dataclasses
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import dspark_core.engine as E  # noqa: E402

orig = E.Engine
M = float(os.environ["MARGIN"])


class Patched(orig):
    def __init__(self, target, drafter, config, *a, **k):
        super().__init__(target, drafter, dataclasses.replace(config, draft_gate_margin=M), *a, **k)


E.Engine = Patched
from dspark_cli.main import main  # noqa: E402

sys.exit(main(sys.argv[1:]))
