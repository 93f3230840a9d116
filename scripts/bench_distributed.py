"""Usage: python scripts/bench_distributed.py [PROMPT_DIR]

Aggregate tokens/s at concurrency 8: distributed (redis + verifier + drafter + scheduler processes)
vs embedded (`dspark serve all`), same prompts, same run, greedy, 64 new tokens."""
import json, os, signal, socket, subprocess, sys, time, statistics
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
from dspark_protos.dspark.v1 import types_pb2, scheduler_service_pb2_grpc
from dspark_core.training.data import load_prompts, split

REPO = Path(__file__).resolve().parents[1]
DATA = Path(sys.argv[1]) if len(sys.argv) > 1 else REPO / "data" / "dev"
BIN = str(Path(sys.executable).parent / "dspark")
def port():
    s = socket.socket(); s.bind(("127.0.0.1", 0)); p = s.getsockname()[1]; s.close(); return p

prompts = []
for ds in ("mbpp", "math500", "arena-hard-v2"):
    _, held = split(load_prompts(DATA / f"{ds}.jsonl"))
    prompts += [p.text[:400] for p in held[:8]]

def call(stub, text):
    req = types_pb2.GenerateUnaryRequest(prompt_text=text, sampling=types_pb2.SamplingParams(temperature=0.0, max_new_tokens=64))
    r = stub.GenerateUnary(req, timeout=300)
    return r.summary.completion_tokens if r.HasField("summary") else len(r.token_ids)

def wait_ready(stub, deadline=240):
    t = time.time()
    while time.time() - t < deadline:
        try:
            call(stub, "hello"); return
        except grpc.RpcError:
            time.sleep(1)
    raise SystemExit("not ready")

def load(addr, reps=3):
    ch = grpc.insecure_channel(addr, options=[("grpc.max_receive_message_length", 64 << 20)])
    stub = scheduler_service_pb2_grpc.SchedulerServiceStub(ch)
    wait_ready(stub)
    rates = []
    for _ in range(reps):
        t = time.time()
        with ThreadPoolExecutor(8) as ex:
            toks = sum(ex.map(lambda p: call(stub, p), prompts))
        rates.append(toks / (time.time() - t))
    return rates

procs = []
def spawn(*args):
    p = subprocess.Popen([BIN, *args], stdout=subprocess.DEVNULL, stderr=open("/tmp/bench_dist.err", "a"))
    procs.append(p); return p
def stop_all():
    for p in procs: p.send_signal(signal.SIGTERM)
    for p in procs:
        try: p.wait(30)
        except subprocess.TimeoutExpired: p.kill()
    procs.clear()

results = {}
e = port()
spawn("serve", "all", "--port", str(e), "--http-port", str(port()))
results["embedded"] = load(f"127.0.0.1:{e}")
stop_all()
rp = port()
redis = subprocess.Popen(["redis-server", "--port", str(rp), "--save", "", "--appendonly", "no"], stdout=subprocess.DEVNULL)
url = f"redis://127.0.0.1:{rp}/0"
v, d, s = port(), port(), port()
spawn("serve", "verifier", "--port", str(v), "--redis-url", url, "--metrics-port", str(port()), "--drafter-path", str(REPO / "models" / "dspark"))
spawn("serve", "drafter", "--port", str(d), "--redis-url", url, "--metrics-port", str(port()), "--drafter-path", str(REPO / "models" / "dspark"))
time.sleep(5)
spawn("serve", "scheduler", "--port", str(s), "--http-port", str(port()), "--metrics-port", str(port()), "--redis-url", url, "--target", str(REPO / "models" / "target"))
try:
    results["distributed"] = load(f"127.0.0.1:{s}")
finally:
    stop_all(); redis.terminate()

emb, dist = statistics.median(results["embedded"]), statistics.median(results["distributed"])
print(json.dumps({"prompts": len(prompts), "concurrency": 8, "embedded_tok_s": results["embedded"],
                  "distributed_tok_s": results["distributed"], "ratio_of_medians": round(dist / emb, 3)}))
