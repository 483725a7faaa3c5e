"""Backend adapters: gRPC step-level worker client, SGLang request-level client, deterministic fakes."""
