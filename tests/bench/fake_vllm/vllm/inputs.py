"""The stand-in's ``TokensPrompt``."""

from typing import Any


def TokensPrompt(prompt_token_ids: list[int]) -> dict[str, Any]:  # noqa: N802 (vLLM's name)
    return {"prompt_token_ids": prompt_token_ids}
