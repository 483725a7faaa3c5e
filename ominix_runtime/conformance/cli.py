"""``ominix-runtime conformance``: run the conformance suite against a backend and print a table."""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Sequence

from ominix_runtime.cli.flags import by_name
from ominix_runtime.conformance.checks import ALL_CHECKS, BackendFactory
from ominix_runtime.conformance.runner import all_passed, format_json, format_table, run_checks


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="ominix-runtime conformance",
        description="Backend conformance suite: event order, one terminal event, abort (also twice), KV "
        "capacity, KV exhaustion, unsupported model, deadline, capability declaration, seeded determinism "
        "(the same request alone twice, the same batch twice; an SGLang server needs "
        "--enable-deterministic-inference for the batch). A check that cannot apply to the "
        "backend reports SKIP. Exits 0 when no check fails and at least one passes.",
    )
    p.add_argument(
        "--backend",
        choices=("fake", "fake-broken", "sglang"),
        default="fake",
        help="fake: in-process step-level fake; fake-broken: a request-level fake that breaks the event "
        "contract (shows what failures look like); sglang: an SGLang server (--url)",
    )
    p.add_argument(
        "--worker",
        action="append",
        default=[],
        metavar="HOST:PORT",
        help="check running ominix workers over gRPC instead (repeatable)",
    )
    # How to reach a secured worker, as the engine does (the engine's flags, read the same way).
    for name in ("--tls-ca", "--tls-cert", "--tls-key", "--engine-secret-file"):
        flag = by_name(name)
        p.add_argument(
            *flag.names, dest=flag.dest, type=flag.read, metavar=flag.metavar, help=f"--worker: {flag.help}"
        )
    p.add_argument("--url", help="SGLang server URL for --backend sglang")
    p.add_argument("--sglang-api-key", default=None, help="bearer token of the SGLang server (its --api-key)")
    p.add_argument("--vocab-size", type=int, help="state the vocabulary size SGLang does not report")
    p.add_argument(
        "--eos-token-id",
        type=int,
        action="append",
        default=[],
        help="state an eos token id SGLang does not report (repeatable)",
    )
    p.add_argument(
        "--check", action="append", choices=sorted(ALL_CHECKS), help="run only this check (repeatable)"
    )
    p.add_argument("--timeout", type=float, default=120.0, help="seconds per check (default 120)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument(
        "--log-level",
        default="warning",
        choices=("debug", "info", "warning", "error"),
        help="engine log level (logs go to stderr)",
    )
    return p


def _factory(args: argparse.Namespace, parser: argparse.ArgumentParser) -> BackendFactory:
    if args.worker:
        from ominix_runtime.backends.grpc_worker import GrpcWorkerBackend
        from ominix_runtime.config import TLSConfig
        from ominix_runtime.server.app import read_secret, worker_credentials

        addresses = list(args.worker)
        tls = TLSConfig(cert=args.tls_cert, key=args.tls_key, ca=args.tls_ca)
        secret = read_secret(args.engine_secret_file)
        return lambda: [
            GrpcWorkerBackend(a, tls=worker_credentials(tls), engine_secret=secret) for a in addresses
        ]
    if args.backend == "sglang":
        if not args.url:
            parser.error("--backend sglang needs --url")
        from ominix_runtime.backends.sglang import SGLangBackend

        url = args.url
        vocab_size: int | None = args.vocab_size or None  # unset: the server's own statement stands
        eos_token_ids: list[int] | None = list(args.eos_token_id) if args.eos_token_id else None
        api_key: str | None = args.sglang_api_key
        return lambda: [
            SGLangBackend(url, vocab_size=vocab_size, eos_token_ids=eos_token_ids, api_key=api_key)
        ]
    from ominix_runtime.testing.fake_backend import FakeConfig, FakeRequestBackend, FakeStepBackend

    if args.backend == "fake-broken":
        return lambda: [FakeRequestBackend(FakeConfig(worker_id="fake-broken-0"), broken=True)]
    return lambda: [FakeStepBackend()]


def main(argv: Sequence[str] | None = None, configure_logs: bool = True) -> int:
    """Run the suite; ``configure_logs=False`` leaves logging as the caller set it up (tests)."""
    parser = _parser()
    args = parser.parse_args(list(argv) if argv is not None else None)
    if configure_logs:
        from ominix_runtime.server.logging import configure_logging

        configure_logging(args.log_level)
    factory = _factory(args, parser)
    results = asyncio.run(run_checks(factory, args.check, args.timeout))
    print(format_json(results) if args.json else format_table(results))
    sys.stdout.flush()
    return 0 if all_passed(results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
