"""Write the `dspark_target` record (dspark_core/drafters/target_record.py) into drafters' config.json,
weights untouched: for drafters trained before `dspark train` wrote it (the shipped ones).

    python scripts/record_target.py models/target models/dspark models/dspark-rnn models/dflash models/eagle3

Refuses a drafter that does not fit the target's shape; the embedding fingerprint is the target's.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def main() -> None:
    from dspark_core.drafters.config import CONFIG_FILE, load_config
    from dspark_core.drafters.target_record import RECORD_KEY, check_shapes, target_record
    from dspark_core.target import TargetConfig, TargetRuntime

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("target", help="the target model directory the drafters were trained for")
    p.add_argument("drafters", nargs="+", help="drafter checkpoint directories to record it in")
    args = p.parse_args()
    target = TargetRuntime(TargetConfig(args.target, device="cpu", dtype="float32"))
    for d in map(Path, args.drafters):
        config = load_config(d)
        check_shapes(config, str(d), args.target)
        raw = json.loads((d / CONFIG_FILE).read_text())
        raw[RECORD_KEY] = target_record(target, config.target_layer_ids)
        (d / CONFIG_FILE).write_text(json.dumps(raw, indent=2, sort_keys=True) + "\n")
        print(f"recorded {target.name} in {d / CONFIG_FILE}")


if __name__ == "__main__":
    main()
