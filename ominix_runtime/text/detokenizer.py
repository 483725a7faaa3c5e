"""Incremental detokenization and stop-string matching for one request's output stream.

Decoding token by token is wrong for byte-level BPE (one character may span tokens) and for SentencePiece
(a token's leading space depends on its left neighbour). The detokenizer keeps two offsets into the output
ids: text is produced by decoding a short window ``[prefix_offset:]`` and subtracting what the window's
already-emitted part ``[prefix_offset:read_offset]`` decodes to; nothing is emitted while the window still
ends in an incomplete character (U+FFFD).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

REPLACEMENT_CHAR = "\ufffd"
# Prompt tokens kept as left context so the first output token decodes with the right leading space.
PROMPT_CONTEXT_TOKENS = 4


class Decoder(Protocol):
    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas."""

    __slots__ = ("_tokenizer", "_ids", "_prefix_offset", "_read_offset", "_skip_special_tokens", "_text")

    def __init__(
        self, tokenizer: Decoder, prompt_token_ids: Sequence[int] = (), skip_special_tokens: bool = True
    ) -> None:
        self._tokenizer = tokenizer
        context = list(prompt_token_ids[-PROMPT_CONTEXT_TOKENS:])
        self._ids: list[int] = context
        self._prefix_offset = 0
        self._read_offset = len(context)
        self._skip_special_tokens = skip_special_tokens
        self._text: list[str] = []

    @property
    def text(self) -> str:
        """Text emitted so far."""
        return "".join(self._text)

    def push(self, token_ids: Sequence[int]) -> str:
        """Add new tokens; return the text they complete (may be empty while a character is pending)."""
        self._ids.extend(token_ids)
        decode = self._tokenizer.decode
        prefix_text, at_boundary = self._emitted_part(decode)
        window_text = decode(self._ids[self._prefix_offset :], self._skip_special_tokens)
        if len(window_text) <= len(prefix_text) or window_text.endswith(REPLACEMENT_CHAR):
            return ""
        delta = window_text[len(prefix_text) :]
        if at_boundary:  # else the next window would start inside the character just completed
            self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        self._text.append(delta)
        return delta

    def _emitted_part(self, decode: Callable[..., str]) -> tuple[str, bool]:
        """The window's already-emitted part as text, and whether it ends at a character boundary. Only the
        prompt's context can end inside a character (text is never emitted while it does): that partial
        character is the output's to complete, so it is left out here and the completed character is part
        of the output's delta."""
        text = decode(self._ids[self._prefix_offset : self._read_offset], self._skip_special_tokens)
        whole = text.rstrip(REPLACEMENT_CHAR)
        return whole, len(whole) == len(text)

    def flush(self) -> str:
        """At the end of the stream: whatever is still pending (an incomplete character decodes as U+FFFD)."""
        if self._read_offset >= len(self._ids):
            return ""
        decode = self._tokenizer.decode
        prefix_text, _ = self._emitted_part(decode)
        window_text = decode(self._ids[self._prefix_offset :], self._skip_special_tokens)
        self._prefix_offset = self._read_offset = len(self._ids)
        delta = window_text[len(prefix_text) :] if window_text.startswith(prefix_text) else ""
        if delta:
            self._text.append(delta)
        return delta


@dataclass(slots=True)
class StopMatch:
    text: str  # text that may be released (everything before the stop string)
    matched_stop: str | None  # the stop string found, or None


@dataclass(slots=True)
class StopStringMatcher:
    """Finds stop strings in streamed text, holding back any tail that could still become one.

    Text fed ``protected`` (that of the first ``min_tokens`` output tokens) ends no match: as in vLLM, a stop
    string counts only where it ends after those tokens, though it may begin inside them."""

    stops: tuple[str, ...]
    _pending: str = ""
    _stopped: bool = field(default=False)
    _protected: int = 0  # leading characters of _pending no match may end in

    def feed(self, delta: str, protected: bool = False) -> StopMatch:
        if self._stopped:
            return StopMatch("", None)
        if not self.stops:
            return StopMatch(delta, None)
        buffer = self._pending + delta
        if not protected:
            best_index = -1
            best_stop = ""
            for stop in self.stops:
                index = buffer.find(stop, max(0, self._protected - len(stop) + 1))
                if index != -1 and (best_index == -1 or index < best_index):
                    best_index, best_stop = index, stop
            if best_index != -1:
                self._stopped = True
                self._pending = ""
                return StopMatch(buffer[:best_index], best_stop)
        hold = self._held_suffix_length(buffer)
        self._pending = buffer[len(buffer) - hold :] if hold else ""
        self._protected = len(self._pending) if protected else 0
        return StopMatch(buffer[: len(buffer) - hold], None)

    def flush(self) -> str:
        """Release the held-back tail (the stream ended without a match)."""
        tail, self._pending = self._pending, ""
        return "" if self._stopped else tail

    def cut(self, stop: str) -> str:
        """The stream ended on ``stop`` matched elsewhere: release the held text before its start."""
        pending, self._pending = self._pending, ""
        self._stopped = True
        for length in range(min(len(stop) - 1, len(pending)), 0, -1):
            if pending.endswith(stop[:length]):
                return pending[: len(pending) - length]
        return pending

    @property
    def stopped(self) -> bool:
        return self._stopped

    def _held_suffix_length(self, buffer: str) -> int:
        """Longest suffix of ``buffer`` that is a proper prefix of some stop string."""
        longest = 0
        for stop in self.stops:
            for length in range(min(len(stop) - 1, len(buffer)), longest, -1):
                if buffer.endswith(stop[:length]):
                    longest = length
                    break
        return longest


class OutputText:
    """Detokenizer plus stop strings: what the front API streams as ``token.text`` and ``done.text``. Neither
    holds a matched stop string nor the text of the stop token id that ended the request."""

    __slots__ = ("_detokenizer", "_matcher", "_released", "_min_tokens", "_num_tokens")

    def __init__(
        self,
        tokenizer: Decoder | None,
        stops: Sequence[str] = (),
        prompt_token_ids: Sequence[int] = (),
        skip_special_tokens: bool = True,
        min_tokens: int = 0,
    ) -> None:
        self._detokenizer = (
            IncrementalDetokenizer(tokenizer, prompt_token_ids, skip_special_tokens) if tokenizer else None
        )
        self._matcher = StopStringMatcher(tuple(stops))
        self._released: list[str] = []
        # A stop string ends the output only after the first min_tokens tokens (vLLM's rule).
        self._min_tokens = min_tokens
        self._num_tokens = 0

    @property
    def text(self) -> str:
        return "".join(self._released)

    @property
    def stopped(self) -> bool:
        return self._matcher.stopped

    @property
    def _within_min_tokens(self) -> bool:
        return self._min_tokens > 0 and self._num_tokens <= self._min_tokens

    def push(self, token_ids: Sequence[int], text: str = "", ended_by_stop_token: bool = False) -> StopMatch:
        """New tokens (or, from a backend that detokenizes itself, their ``text``) → releasable text.

        ``ended_by_stop_token``: the last of ``token_ids`` is a stop token (a ``stop_token_ids`` entry or an eos)
        that ended the request.
        Like a matched stop string, its text is not output; the text before it is, here and at ``finish``. A
        backend's own ``text`` is taken as sent (such a backend leaves the stop token's text out itself).
        """
        if self._matcher.stopped:
            return StopMatch("", None)
        shown = token_ids[:-1] if ended_by_stop_token else token_ids
        before = self._num_tokens
        self._num_tokens += len(token_ids)
        if self._detokenizer is None:
            # A backend's own text: protected while its chunk ends within min_tokens.
            match = self._matcher.feed(text, protected=self._within_min_tokens)
        else:
            match = self._feed_ids(self._detokenizer, shown, before)
        if match.text:
            self._released.append(match.text)
        return match

    def _feed_ids(self, detokenizer: IncrementalDetokenizer, ids: Sequence[int], before: int) -> StopMatch:
        """Decode ``ids`` (the chunk after ``before`` earlier tokens) into the matcher: those up to min_tokens
        protected, the rest not."""
        split = min(max(self._min_tokens - before, 0), len(ids))
        if not split:
            return self._matcher.feed(detokenizer.push(ids))
        head = self._matcher.feed(detokenizer.push(ids[:split]), protected=True)
        if split == len(ids):
            return head
        tail = self._matcher.feed(detokenizer.push(ids[split:]))
        return StopMatch(head.text + tail.text, tail.matched_stop)

    def finish(self, backend_matched_stop: str | None = None) -> StopMatch:
        """The stream ended: release pending characters and any held-back partial stop string.

        ``backend_matched_stop``: a stop string the backend itself matched (request-level backends apply
        stop strings too); the part of it still held back is dropped instead of released.
        """
        if self._matcher.stopped:
            return StopMatch("", None)
        tail = self._detokenizer.flush() if self._detokenizer is not None else ""
        match = self._matcher.feed(tail, protected=self._within_min_tokens)
        if match.matched_stop:
            released, matched = match.text, match.matched_stop
        elif backend_matched_stop and backend_matched_stop in self._matcher.stops:
            released, matched = self._matcher.cut(backend_matched_stop), backend_matched_stop
            released = match.text + released
        else:
            released, matched = match.text + self._matcher.flush(), None
        if released:
            self._released.append(released)
        return StopMatch(released, matched)
