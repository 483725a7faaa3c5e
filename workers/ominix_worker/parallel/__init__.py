"""Tensor parallelism for model families: the group a rank belongs to, sharded layers, sliced weight reads."""

from ominix_worker.parallel.layers import (
    ColumnParallelLinear,
    PackableLinear,
    ParallelLMHead,
    ParallelModule,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from ominix_worker.parallel.tensor_parallel import SINGLE, MoeParallel, ShardRange, TensorParallel
from ominix_worker.parallel.weights import SafetensorsWeight, TensorWeight, WeightSource, as_weight_source

__all__ = [
    "SINGLE",
    "ColumnParallelLinear",
    "MoeParallel",
    "PackableLinear",
    "ParallelLMHead",
    "ParallelModule",
    "RowParallelLinear",
    "SafetensorsWeight",
    "ShardRange",
    "TensorParallel",
    "TensorWeight",
    "VocabParallelEmbedding",
    "WeightSource",
    "as_weight_source",
]
