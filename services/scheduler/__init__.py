"""The scheduler service: the front door (gRPC Generate, OpenAI-compatible HTTP) driving the engine's rounds."""
