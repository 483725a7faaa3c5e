"""Where the Triton kernel tests run: on the GPU, or on the CPU through Triton's interpreter
(``TRITON_INTERPRET=1``: slowly, and 16-bit dots are not exact there). A test module calls ``triton_device()`` as
it is imported; anywhere else, or without triton installed, the module is skipped."""

from __future__ import annotations

import os

import pytest
import torch

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def triton_device(native: bool | None = None, needs: str = "CUDA") -> str:
    """``"cuda"`` when ``native`` (default: a CUDA device is present), else ``"cpu"`` under the interpreter;
    otherwise the calling module is skipped as needing ``needs`` (or the interpreter)."""
    if native is None:
        native = torch.cuda.is_available()
    if not (native or INTERPRET):
        pytest.skip(f"needs {needs} (or TRITON_INTERPRET=1)", allow_module_level=True)
    pytest.importorskip("triton")
    return "cuda" if native else "cpu"
