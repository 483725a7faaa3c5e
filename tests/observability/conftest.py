"""Session fixture: a real daemon that served requests (see obs_daemon.py)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from obs_daemon import Scraped, served_daemon


@pytest.fixture(scope="session")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Scraped]:
    from ominix_worker.testing import write_tiny_hf_model

    model = write_tiny_hf_model(tmp_path_factory.mktemp("tiny") / "tiny-llama", arch="llama", vocab_size=320)
    with served_daemon(model, tmp_path_factory.mktemp("logs")) as scraped:
        yield scraped
