"""`python -m services.common.probe --port N`: exit 0 when the local gRPC health service says SERVING.

The Kubernetes probe of a pod whose port serves mutual TLS (kubelet's own gRPC probes speak plaintext):
it presents the pod's own certificate from DSPARK_TLS_DIR. Imports grpc only, so it starts fast.
"""

from __future__ import annotations

import argparse
import os
import sys


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="probe", description=__doc__.split("\n\n")[0])
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--tls-dir", default=os.environ.get("DSPARK_TLS_DIR"))
    p.add_argument("--timeout", type=float, default=4.0)
    args = p.parse_args(argv)
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from .security import load_tls, secure_channel

    try:
        with secure_channel(f"127.0.0.1:{args.port}", load_tls(args.tls_dir), []) as ch:
            status = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=args.timeout).status
    except grpc.RpcError as exc:
        print(f"probe: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return 1
    if status != health_pb2.HealthCheckResponse.SERVING:
        print(f"probe: {health_pb2.HealthCheckResponse.ServingStatus.Name(status)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
