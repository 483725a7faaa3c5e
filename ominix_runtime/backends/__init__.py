"""Backend adapters: the gRPC step-level worker client and the SGLang request-level client."""
