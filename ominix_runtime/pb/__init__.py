"""Generated protobuf and gRPC modules (``make proto``); do not edit by hand."""
