"""``ominix-runtime generate``: send one prompt to a running engine and stream the answer."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ominix_runtime.config import RuntimeConfig


def model_name(model: str | None) -> str:
    """The name to send: a model given as a path (.gguf, folder, dummy:) is named as the engine names it;
    anything else is a served name already."""
    if not model:
        return ""
    if model.startswith("dummy:") or Path(model).expanduser().exists():
        from ominix_runtime.contract import InvalidArgument
        from ominix_runtime.models import resolve_model

        try:
            return resolve_model(model).name
        except InvalidArgument:
            return model
    return model


def run_generate(config: RuntimeConfig, options: argparse.Namespace) -> int:
    import grpc
    from google.protobuf import json_format

    from ominix_runtime.client import ClientOptions, EngineClient, generate_request
    from ominix_runtime.pb import common_pb2

    request = generate_request(
        None if options.chat else options.prompt,
        messages=[("user", options.prompt)] if options.chat else (),
        model=model_name(config.model.path),
        max_tokens=options.max_tokens,
        temperature=options.temperature,
        top_p=options.top_p,
        top_k=options.top_k,
        seed=options.seed,
        stop=options.stop,
        priority=options.priority,
        request_id=options.request_id,
    )
    client_options = ClientOptions(
        api_key=config.front.api_keys[0] if config.front.api_keys else None,
        root_certificates=config.tls.ca,
        timeout=options.timeout,
    )
    exit_code = 1
    with EngineClient(options.address, client_options) as client:
        try:
            for event in client.generate(request):
                kind = event.WhichOneof("event")
                if options.json:
                    line = json_format.MessageToJson(event, indent=None, preserving_proto_field_name=True)
                    print(line, flush=True)
                elif kind == "token":
                    sys.stdout.write(event.token.text)
                    sys.stdout.flush()
                if kind == "done":
                    exit_code = 0
                    if not options.json:
                        reason = common_pb2.FinishReason.Name(event.done.finish_reason)
                        print(f"\n[{reason.removeprefix('FINISH_REASON_').lower()}]", file=sys.stderr)
                elif kind == "error" and not options.json:
                    print(f"\nerror: {event.error.message}", file=sys.stderr)
        except grpc.RpcError as exc:
            print(f"ominix-runtime generate: {exc.code().name}: {exc.details()}", file=sys.stderr)
            return 1
    return exit_code
