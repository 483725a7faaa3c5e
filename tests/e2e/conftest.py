"""Module-scoped daemons with real worker processes (tiny random model, embedded SmolLM2)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from e2e_procs import REFERENCE_TEXTS, REFERENCE_TOKENS, Daemon, run_server

from ominix_runtime.models import embedded_model_path
from ominix_runtime.text import Tokenizer


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from ominix_worker.testing import write_tiny_hf_model

    # The helper writes a byte-level tokenizer of the same vocabulary next to the weights.
    return write_tiny_hf_model(
        tmp_path_factory.mktemp("tiny-llama") / "tiny-llama", arch="llama", vocab_size=320
    )


def _model_and_tokenizer(kind: str, tiny_model_dir: Path) -> tuple[str, Tokenizer]:
    if kind == "tiny":
        return str(tiny_model_dir), Tokenizer.from_hf_folder(tiny_model_dir)
    return "", Tokenizer.from_gguf(embedded_model_path())


# "tiny-fronts": the tiny model again, its clients served by two front processes (--front-procs 2).
@pytest.fixture(scope="module", params=["tiny", "smollm2", "tiny-fronts"])
def daemon(
    request: pytest.FixtureRequest, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Daemon]:
    kind = request.param.removesuffix("-fronts")
    model, tokenizer = _model_and_tokenizer(kind, tiny_model_dir)
    prompts = [tokenizer.encode(t) for t in REFERENCE_TEXTS]
    logs = tmp_path_factory.mktemp(f"logs-{request.param}")
    with run_server(
        model or "SmolLM2-135M-Instruct",
        logs,
        reference_prompts=prompts,
        reference_tokens=REFERENCE_TOKENS,
        kv_cache_memory="16MiB" if kind == "tiny" else "96MiB",
        extra_serve_args=["--front-procs", "2"] if request.param.endswith("-fronts") else [],
    ) as running:
        running.tokenizer = tokenizer
        running.kind = kind
        yield running
