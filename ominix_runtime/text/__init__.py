"""Text processing at the engine's front edge: tokenizer, chat templates, incremental detokenization."""

from ominix_runtime.text.detokenizer import IncrementalDetokenizer, OutputText, StopMatch, StopStringMatcher
from ominix_runtime.text.tokenizer import Tokenizer, TokenizerError, load_tokenizer

__all__ = [
    "IncrementalDetokenizer",
    "OutputText",
    "StopMatch",
    "StopStringMatcher",
    "Tokenizer",
    "TokenizerError",
    "load_tokenizer",
]
