"""dspark_core: the DSpark algorithm library.

Target runtime, drafters, lossless verification, calibration, scheduling and the multi-request engine.
It knows nothing about networking, gRPC, environment variables or argument parsing: entry points
(`dspark_cli`, `services/`) do that and call in here.
"""

__version__ = "0.1.0"
