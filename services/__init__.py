"""DSpark services: the engine's round split across processes as thin gRPC adapters over dspark_core.

`common` holds the wiring every service shares (gRPC server, errors, logs, metrics, traces, Redis,
proto conversions); `verifier`, `drafter` and `scheduler` each have `main.py` (flags, env, signals),
`server.py` (grpc.aio server) and `servicer.py` (proto -> domain -> dspark_core -> proto).
"""
