"""One GGUF tokenizer per session (parsing the embedded model's metadata takes a second or two)."""

from __future__ import annotations

import pytest

from ominix_runtime.models import embedded_model_path
from ominix_runtime.text import Tokenizer


@pytest.fixture(scope="session")
def smollm2_tokenizer() -> Tokenizer:
    return Tokenizer.from_gguf(embedded_model_path())
