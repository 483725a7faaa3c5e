"""The engine process edges: gRPC front service, application startup, metrics and logging setup."""
