"""Startup check that the backends of one worker group can serve one model together.

The engine calls :func:`check_group` once per group after ``describe()``; any mismatch stops startup with
``OminixError(CAPABILITY_MISMATCH)`` naming the field, instead of failing later on the first request.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from ominix_runtime.contract import BackendCapability, Granularity, OminixError, RuntimeErrorKind

# Stated by request-level backends whose server does not say (SGLang's native API reports neither).
UNSTATED_DTYPE = "auto"


def _mismatch(message: str) -> OminixError:
    return OminixError(RuntimeErrorKind.CAPABILITY_MISMATCH, message)


def _own_problems(cap: BackendCapability) -> list[str]:
    """``cap.problems()``, except tokenizer facts a request-level backend keeps to itself.

    A request-level backend (SGLang) tokenizes, detokenizes and stops by itself, so an unstated vocabulary
    or EOS list is no defect there; a step-level worker must state both.
    """
    if cap.granularity != Granularity.REQUEST:
        return cap.problems()
    model = cap.model
    eos = model.eos_token_ids or (0,)
    stand_in = replace(model, eos_token_ids=eos, vocab_size=max(model.vocab_size, max(eos) + 1, 1))
    return replace(cap, model=stand_in).problems()


def check_group(
    capabilities: Sequence[BackendCapability],
    model_name: str,
    required_max_model_len: int | None = None,
    dtype: str | None = None,
) -> None:
    """Raise CAPABILITY_MISMATCH unless every capability is sound and they agree with each other and the
    configuration: model name, KV block size, granularity, max_model_len and dtype."""
    if not capabilities:
        raise _mismatch("the worker group has no backends")
    for cap in capabilities:
        problems = _own_problems(cap)
        if problems:
            raise _mismatch(
                f"backend {cap.worker_id or '?'} states an inconsistent capability: {'; '.join(problems)}"
            )

    first = capabilities[0]
    for cap in capabilities:
        if model_name and cap.model.name and cap.model.name != model_name:
            raise _mismatch(
                f"model mismatch: backend {cap.worker_id} serves {cap.model.name!r}, expected {model_name!r}"
            )
        if cap.model.name != first.model.name:
            raise _mismatch(
                f"model mismatch within the group: {first.worker_id} serves {first.model.name!r}, "
                f"{cap.worker_id} serves {cap.model.name!r}"
            )
        if cap.granularity != first.granularity:
            raise _mismatch(
                f"granularity mismatch within the group: {first.worker_id} is {first.granularity.name}, "
                f"{cap.worker_id} is {cap.granularity.name}"
            )
        if cap.kv_block_size != first.kv_block_size:
            raise _mismatch(
                f"kv_block_size mismatch within the group: {first.worker_id} uses {first.kv_block_size}, "
                f"{cap.worker_id} uses {cap.kv_block_size}"
            )
        if cap.model.vocab_size != first.model.vocab_size and cap.granularity == Granularity.STEP:
            raise _mismatch(
                f"vocab_size mismatch within the group: {first.worker_id} has {first.model.vocab_size}, "
                f"{cap.worker_id} has {cap.model.vocab_size}"
            )
        if required_max_model_len is not None and cap.model.max_model_len < required_max_model_len:
            raise _mismatch(
                f"max_model_len too small: backend {cap.worker_id} supports {cap.model.max_model_len} tokens, "
                f"the configuration needs {required_max_model_len}"
            )
        if dtype and cap.dtype != UNSTATED_DTYPE and cap.dtype != dtype:
            raise _mismatch(
                f"dtype mismatch: backend {cap.worker_id} runs {cap.dtype}, the configuration asks for {dtype}"
            )
        if dtype and cap.supported_dtypes and dtype not in cap.supported_dtypes:
            raise _mismatch(
                f"dtype mismatch: backend {cap.worker_id} supports {', '.join(cap.supported_dtypes)}, not {dtype}"
            )


__all__ = ["UNSTATED_DTYPE", "check_group"]
