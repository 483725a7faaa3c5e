"""Capability negotiation: can the described backends serve together, on the terms the server asks?

The one place where capabilities are checked. ``EngineCore.start`` calls :func:`negotiate` after every
backend's ``describe()`` and before any group starts (so before any Run stream opens); any mismatch stops
startup with ``OminixError(CAPABILITY_MISMATCH)`` naming the field, instead of failing on the first request.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from ominix_runtime.contract import BackendCapability, Granularity, OminixError, RuntimeErrorKind

# Stated by request-level backends whose server does not say (SGLang's native API reports neither).
UNSTATED_DTYPE = "auto"


@dataclass(frozen=True, slots=True)
class ServingTerms:
    """What the serving configuration asks of the backends; the defaults ask nothing beyond agreement."""

    # The model the step-level workers must serve; "" accepts any, one group per model they state.
    model_name: str = ""
    # Tokens the front end's tokenizer can produce: the step-level workers' vocabulary must cover them.
    tokenizer_vocab_size: int | None = None


def negotiate(capabilities: Sequence[BackendCapability], terms: ServingTerms | None = None) -> None:
    """Raise CAPABILITY_MISMATCH unless the backends can serve together on ``terms``.

    Every backend has its own worker_id. Step-level workers of one model form one group (requests fail over
    between them): with ``terms.model_name`` they must all serve that model; each group must pass
    :func:`check_group`. Each model served by request-level backends is a group of its own.
    """
    terms = terms or ServingTerms()
    seen: set[str] = set()
    for cap in capabilities:
        if cap.worker_id in seen:
            raise _mismatch(f"two backends state the same worker_id {cap.worker_id!r}")
        seen.add(cap.worker_id)
    for granularity in Granularity:
        caps = [c for c in capabilities if c.granularity == granularity]
        if granularity == Granularity.STEP and caps and terms.model_name:
            check_group(caps, terms.model_name)
            continue
        for name in sorted({c.model.name for c in caps}):
            check_group([c for c in caps if c.model.name == name], name)
    vocab = terms.tokenizer_vocab_size
    for cap in capabilities:
        if vocab is not None and cap.granularity == Granularity.STEP and vocab > cap.model.vocab_size:
            raise _mismatch(
                f"the tokenizer of {terms.model_name!r} has {vocab} tokens but worker {cap.worker_id}'s model "
                f"has a vocabulary of {cap.model.vocab_size}: engine and workers must load the same model"
            )


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
        if cap.granularity == Granularity.STEP:
            # A request resumed on another worker of the group must see the same tokenizer and limits.
            for attr in ("vocab_size", "max_model_len", "eos_token_ids"):
                mine, theirs = getattr(cap.model, attr), getattr(first.model, attr)
                if mine != theirs:
                    raise _mismatch(
                        f"{attr} mismatch within the group: {first.worker_id} has {theirs}, "
                        f"{cap.worker_id} has {mine}"
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


__all__ = ["UNSTATED_DTYPE", "ServingTerms", "check_group", "negotiate"]
