"""What the verifier, drafter and scheduler apps share: identity, Redis wiring and their run loop.

An app is started in-process (`await app.start()`, tests do this) or by its `main.py` (which then waits
for SIGTERM and drains). Knows nothing about models.
"""

from __future__ import annotations

import os
import socket


def default_pod_id(kind: str, port: int) -> str:
    """POD_NAME in Kubernetes (the entry point reads env and passes it), else host-kind-port."""
    return f"{socket.gethostname()}-{kind}-{port}-{os.getpid()}"


def advertise_address(host: str | None, port: int, address: str | None = None) -> str:
    """The host:port published in Redis: an explicit address (DSPARK_POD_ADDRESS) wins over host + port."""
    return address or f"{host or '127.0.0.1'}:{port}"
