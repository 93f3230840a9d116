"""Wiring shared by every service: server construction, error mapping, logging, metrics, tracing, Redis.

Knows gRPC, Redis and Prometheus; knows nothing about models beyond the proto <-> domain conversions.
"""
