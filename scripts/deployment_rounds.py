"""Issue 21: do the embedded and the distributed deployment decide alike? Round by round, on the same prompts.

Starts both deployments as real processes on loopback (dspark_cli.bench_distributed.Cluster, as `dspark bench
--distributed` does), optionally drives each with the bench's untimed closed loop at --warm concurrency first, then
sends the prompts one at a time (batch 1) and records each round's verified draft length and accepted count
(streamed Generate) or, with --unary, each request's totals (GenerateUnary's summary). Prints, per deployment, the
rounds needed, the verified lengths' histogram with the mean accepted at each length, and where the two first
differ.

    python scripts/deployment_rounds.py --num-prompts 64 [--warm 8] [--unary] [--json out.json]
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import tempfile
import types
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="smollm2")
    ap.add_argument("--drafter", default="dspark")
    ap.add_argument("--policy", default="causal")
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--warm", type=int, default=0, help="concurrency of an untimed closed loop first (0: none)")
    ap.add_argument("--unary", action="store_true", help="GenerateUnary (request totals) instead of streaming")
    ap.add_argument("--json", default=None, help="write the rounds here")
    a = ap.parse_args(argv)

    import grpc

    from dspark_cli.bench import load_prompt_list
    from dspark_cli.bench_distributed import Client, Cluster, wait_ready
    from dspark_cli.models import resolve_drafter_path, resolve_target
    from dspark_core.target import load_tokenizer
    from dspark_protos.dspark.v1 import scheduler_service_pb2_grpc, types_pb2

    target = resolve_target(a.target)
    drafter = resolve_drafter_path(a.drafter, None, target)
    light = types.SimpleNamespace(tokenizer=load_tokenizer(target), max_context=2048)
    prompts, _ = load_prompt_list(types.SimpleNamespace(max_new_tokens=a.max_new_tokens, dataset=None, split="eval",
                                                        num_prompts=a.num_prompts), light)
    cluster = Cluster(target, drafter, a.policy, None, Path(tempfile.mkdtemp(prefix="dspark-rounds-")))
    out: dict[str, list] = {}
    try:
        deps = [cluster.start_embedded(), cluster.start_distributed()]
        for dep in deps:
            wait_ready(dep)
        for dep in deps:
            if a.warm:
                cl = Client(dep)
                cl.call(prompts[0], 4, 0.0, None)
                cl.load(sorted(prompts, key=len, reverse=True)[:a.warm], a.warm, a.max_new_tokens, 0.0, 0)
                cl.close()
            ch = grpc.insecure_channel(dep.address)
            stub = scheduler_service_pb2_grpc.SchedulerServiceStub(ch)
            rounds = []
            for i, p in enumerate([prompts[0], *prompts]):  # the first: a warm-up, not recorded
                ids = types_pb2.TokenIds(token_ids=p)
                sampling = types_pb2.SamplingParams(temperature=0, max_new_tokens=a.max_new_tokens)
                if a.unary:
                    s = stub.GenerateUnary(types_pb2.GenerateUnaryRequest(prompt_token_ids=ids, sampling=sampling),
                                           timeout=300).summary
                    rs = [[s.num_rounds, s.num_draft_tokens, s.num_accepted_tokens]]
                else:
                    rs = [[1, c.round.num_verified, c.round.num_accepted]
                          for c in stub.Generate(types_pb2.GenerateRequest(prompt_token_ids=ids, sampling=sampling),
                                                 timeout=300) if c.HasField("round")]
                if i:
                    rounds.append(rs)
            ch.close()
            out[dep.name] = rounds
    finally:
        cluster.stop()
    if a.json:
        Path(a.json).write_text(json.dumps(out))
    for name, rounds in out.items():
        flat = [r for rs in rounds for r in rs]
        n, ver, acc = (sum(r[k] for r in flat) for k in range(3))
        print(f"{name}: {n} rounds, {ver} draft tokens verified, {acc} accepted"
              f" ({acc / ver if ver else 0:.3f}), {(acc + n) / n if n else 0:.3f} tokens a round")
        if not a.unary:
            by_len = collections.defaultdict(list)
            for _, v, k in flat:
                by_len[v].append(k)
            print("  verified length: rounds, mean accepted  "
                  + "  ".join(f"{v}: {len(x)}, {sum(x) / len(x):.2f}" for v, x in sorted(by_len.items())))
    same = sum(a_ == b_ for a_, b_ in zip(out["embedded"], out["distributed"]))
    print(f"prompts whose rounds are identical in both: {same} / {len(prompts)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
