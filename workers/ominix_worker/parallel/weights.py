"""Checkpoint tensors read lazily, so each tensor-parallel rank reads only its slice.

A ``WeightSource`` states a tensor's shape and reads any contiguous range of one dimension. Safetensors
files are memory-mapped: ``SafetensorsWeight`` reads the requested rows or columns and nothing else.
Formats that must decode whole tensors (GGUF dequantization) wrap the result in ``TensorWeight``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import torch


class WeightSource(ABC):
    """One checkpoint tensor, read in slices."""

    @property
    @abstractmethod
    def shape(self) -> tuple[int, ...]: ...

    @abstractmethod
    def read(self, dim: int = 0, start: int = 0, length: int | None = None) -> torch.Tensor:
        """Elements [start, start + length) along ``dim`` (all of it by default), on the CPU."""


class TensorWeight(WeightSource):
    """A tensor already in memory."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self._tensor = tensor

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self._tensor.shape)

    def read(self, dim: int = 0, start: int = 0, length: int | None = None) -> torch.Tensor:
        if start == 0 and (length is None or length == self._tensor.shape[dim]):
            return self._tensor
        return self._tensor.narrow(dim, start, self._tensor.shape[dim] - start if length is None else length)


class SafetensorsWeight(WeightSource):
    """A tensor in a memory-mapped safetensors file (``safe_open(...).get_slice(name)``)."""

    def __init__(self, tensor_slice: Any, name: str = "") -> None:
        self.name = name
        self._slice = tensor_slice
        self._shape = tuple(int(d) for d in tensor_slice.get_shape())

    @property
    def shape(self) -> tuple[int, ...]:
        return self._shape

    def read(self, dim: int = 0, start: int = 0, length: int | None = None) -> torch.Tensor:
        if not self._shape:  # a scalar (e.g. an FP8 per-tensor scale) is read whole
            return self._slice[()]
        stop = self._shape[dim] if length is None else start + length
        index = tuple(slice(start, stop) if d == dim else slice(None) for d in range(len(self._shape)))
        return self._slice[index]


def as_weight_source(weight: torch.Tensor | WeightSource) -> WeightSource:
    return weight if isinstance(weight, WeightSource) else TensorWeight(weight)
