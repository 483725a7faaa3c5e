"""An admin call a front process forwards to the engine process, refused there, reaches the client with the
engine's status, message and trailing metadata: the same answer as from an engine serving its clients itself
(the fixture runs both, see conftest.py)."""

from __future__ import annotations

import grpc
import pytest
from server_harness import RunningDaemon

from ominix_runtime.pb import engine_pb2
from ominix_runtime.server.engine_service import ERROR_KIND_METADATA_KEY, RETRYABLE_METADATA_KEY


@pytest.mark.parametrize("call", ["Drain", "Undrain"])
def test_drain_of_an_unknown_worker_is_not_found_with_its_error_kind(
    fake_daemon: RunningDaemon, call: str
) -> None:
    with pytest.raises(grpc.RpcError) as refused:
        getattr(fake_daemon.stub, call)(engine_pb2.DrainRequest(worker_id="no-such-worker"), timeout=10)
    error = refused.value
    # Through a front this was UNKNOWN: the forwarded trailing metadata made context.abort raise a TypeError.
    assert error.code() == grpc.StatusCode.NOT_FOUND, error.details()
    assert "no-such-worker" in (error.details() or "")
    metadata = dict(error.trailing_metadata() or ())
    # The kind is the engine's to choose (the contract has no NOT_FOUND kind); it must arrive, and a call
    # naming no worker is never worth a retry.
    assert metadata.get(ERROR_KIND_METADATA_KEY), metadata
    assert metadata.get(RETRYABLE_METADATA_KEY) == "false", metadata
