"""Incremental detokenization (multi-byte characters split across tokens) and stop strings."""

from __future__ import annotations

import random

import pytest

from ominix_runtime.text import IncrementalDetokenizer, OutputText, StopStringMatcher, Tokenizer

TEXTS = [
    "Plain ASCII text, nothing special.",
    "emoji 😀👍🏽 family 👨‍👩‍👧 flag 🇯🇵 done",
    "中文测试，日本語のテキスト、한국어 mixed with English",
    "accents: naïve café — résumé; math: ∑∫√∞",
]


@pytest.fixture(scope="module")
def tokenizer(smollm2_tokenizer: Tokenizer) -> Tokenizer:
    return smollm2_tokenizer


@pytest.mark.parametrize("text", TEXTS)
def test_one_token_at_a_time_rebuilds_the_text(tokenizer: Tokenizer, text: str) -> None:
    ids = tokenizer.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, prompt_token_ids=tokenizer.encode("Prompt:"))
    deltas = [detok.push([t]) for t in ids]
    deltas.append(detok.flush())
    assert "".join(deltas) == text
    assert all("\ufffd" not in d for d in deltas)
    if any(ord(c) > 0x7F for c in text):
        # Some tokens carry only part of a character: their delta must be empty, not a broken character.
        assert "" in deltas[:-1]


@pytest.mark.parametrize("text", TEXTS)
def test_random_chunking_rebuilds_the_text(tokenizer: Tokenizer, text: str) -> None:
    ids = tokenizer.encode(text, add_special_tokens=False)
    rng = random.Random(len(text))
    detok = IncrementalDetokenizer(tokenizer)
    out, i = [], 0
    while i < len(ids):
        n = rng.randint(1, 3)
        out.append(detok.push(ids[i : i + n]))
        i += n
    out.append(detok.flush())
    assert "".join(out) == text


def test_special_tokens_are_skipped(tokenizer: Tokenizer) -> None:
    detok = IncrementalDetokenizer(tokenizer)
    ids = tokenizer.encode("Hi there", add_special_tokens=False) + [2]
    assert "".join(detok.push([t]) for t in ids) + detok.flush() == "Hi there"


def test_incomplete_character_at_the_end_is_flushed_as_replacement(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("a😀", add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer)
    text = "".join(detok.push([t]) for t in ids[:-1])
    assert text == "a"
    assert detok.flush() == "\ufffd"


def test_stop_matcher_holds_back_partial_matches() -> None:
    m = StopStringMatcher(("STOP",))
    assert m.feed("abc S").text == "abc "  # "S" could start "STOP"
    r = m.feed("TO")
    assert r.text == "" and r.matched_stop is None
    r = m.feed("Pxyz")
    assert r.text == "" and r.matched_stop == "STOP"
    assert m.stopped and m.feed("more").text == ""


def test_stop_matcher_releases_a_false_start() -> None:
    m = StopStringMatcher(("STOP",))
    assert m.feed("ST").text == ""
    assert m.feed("ART").text == "START"
    assert m.flush() == ""
    m2 = StopStringMatcher(("end",))
    assert m2.feed("the en").text == "the "
    assert m2.flush() == "en"


def test_earliest_of_several_stop_strings_wins() -> None:
    m = StopStringMatcher(("world", "lo w"))
    r = m.feed("hello world")
    assert r.text == "hel" and r.matched_stop == "lo w"


@pytest.mark.parametrize("stop", ["你好", "😀!", "\n\n", "the end"])
def test_stop_across_token_boundaries_is_not_leaked(tokenizer: Tokenizer, stop: str) -> None:
    before = "Some text before 中文 and 😀 "
    text = before + stop + " and text after that must not appear"
    ids = tokenizer.encode(text, add_special_tokens=False)
    stop_start = len(tokenizer.decode(tokenizer.encode(before, add_special_tokens=False)))
    assert stop_start == len(before)
    output = OutputText(tokenizer, [stop])
    streamed, matched = [], None
    for t in ids:
        r = output.push([t])
        streamed.append(r.text)
        if r.matched_stop:
            matched = r.matched_stop
            break
    assert matched == stop
    assert "".join(streamed) == before == output.text
    assert output.push([ids[-1]]).text == ""  # tokens after the match are ignored


def test_unmatched_partial_stop_is_released_at_the_end(tokenizer: Tokenizer) -> None:
    output = OutputText(tokenizer, ["ZZZ-never"])
    ids = tokenizer.encode("ends with ZZZ", add_special_tokens=False)
    streamed = "".join(output.push([t]).text for t in ids)
    assert not streamed.endswith("ZZZ")
    tail = output.finish()
    assert tail.matched_stop is None
    assert streamed + tail.text == "ends with ZZZ" == output.text


def test_backend_text_without_tokenizer() -> None:
    output = OutputText(None, ["</s>"])
    assert output.push([], "hello </").text == "hello "
    r = output.push([], "s> tail")
    assert r.matched_stop == "</s>" and output.text == "hello "


def test_stop_matched_by_the_backend_drops_its_held_part() -> None:
    output = OutputText(None, ["0 w2", "xyz"])
    assert output.push([], " w11 w16850").text == " w11 w1685"  # "0" might start "0 w2": held back
    end = output.finish(backend_matched_stop="0 w2")
    assert (end.text, end.matched_stop) == ("", "0 w2")
    assert output.text == " w11 w1685"
    other = OutputText(None, ["0 w2"])
    other.push([], "abc0")
    assert other.finish(backend_matched_stop="not-ours").text == "0"  # unknown stop: nothing is cut


SENTENCE = "The cat sat on the mat, then the cat slept."


def _stop_at(tokenizer: Tokenizer, word: str) -> tuple[list[int], int]:
    """The sentence's ids up to and with the first ``word`` token (the engine's last output token), and its id."""
    ids = tokenizer.encode(SENTENCE, add_special_tokens=False)
    (stop_id,) = tokenizer.encode(word, add_special_tokens=False)
    return ids[: ids.index(stop_id) + 1], stop_id


@pytest.mark.parametrize("chunk", [1, 3, 100])
def test_the_stop_token_ids_entry_that_ends_the_output_leaves_no_text(
    tokenizer: Tokenizer, chunk: int
) -> None:
    """An ordinary word (" mat") as a stop_token_ids entry ends the output: like a matched stop string, its
    text is neither streamed nor in the final text, alone or at the end of a chunk (coalesced tokens)."""
    ids, _ = _stop_at(tokenizer, " mat")
    output = OutputText(tokenizer, prompt_token_ids=tokenizer.encode("Prompt:"))
    streamed = []
    for start in range(0, len(ids), chunk):
        piece = ids[start : start + chunk]
        streamed.append(output.push(piece, ended_by_stop_token=start + len(piece) == len(ids)).text)
    tail = output.finish()
    assert tail.matched_stop is None
    assert "".join(streamed) + tail.text == "The cat sat on the" == output.text


def test_a_stop_token_as_the_first_output_token_leaves_the_text_empty(tokenizer: Tokenizer) -> None:
    _, stop_id = _stop_at(tokenizer, " cat")
    output = OutputText(tokenizer, prompt_token_ids=tokenizer.encode("The"))
    assert output.push([stop_id], ended_by_stop_token=True).text == ""
    assert output.finish().text == "" and output.text == ""


def test_text_held_back_for_a_stop_string_is_released_after_a_stop_token(tokenizer: Tokenizer) -> None:
    """The text " the" might start the stop string " the m": held back while streaming, released once the stop
    token ends the output (the stop string never matched, the stop token's text is not added to it)."""
    ids, _ = _stop_at(tokenizer, " mat")
    output = OutputText(tokenizer, [" the m"])
    streamed = "".join(output.push([t], ended_by_stop_token=t == ids[-1]).text for t in ids)
    assert streamed == "The cat sat on"
    tail = output.finish()
    assert (tail.text, tail.matched_stop) == (" the", None)
    assert output.text == "The cat sat on the"


def test_a_special_eos_ends_the_text_as_before(tokenizer: Tokenizer) -> None:
    """Special tokens (the eos) have no text anyway: listed in stop_token_ids or not, the text is the same."""
    ids = tokenizer.encode("Hi there", add_special_tokens=False) + [2]
    for listed in (False, True):
        output = OutputText(tokenizer)
        streamed = "".join(output.push([t], ended_by_stop_token=listed and t == 2).text for t in ids)
        assert streamed + output.finish().text == "Hi there" == output.text


def test_a_backends_own_text_is_taken_as_sent_after_a_stop_token() -> None:
    """A backend that detokenizes itself (SGLang) leaves the stop token's text out itself."""
    output = OutputText(None)
    assert output.push([5, 7], " w5", ended_by_stop_token=True).text == " w5"
    assert output.finish().text == "" and output.text == " w5"


def test_a_stop_string_ends_the_output_only_after_min_tokens(tokenizer: Tokenizer) -> None:
    """vLLM's rule: a stop string counts once more than ``min_tokens`` tokens exist, where it ends after them
    (it may begin inside them). One token at a time or all in one chunk, the same text comes out."""
    ids = tokenizer.encode(" the cat and the dog and the bird", add_special_tokens=False)
    cut = len(tokenizer.encode(" the cat", add_special_tokens=False))
    for chunk in (1, len(ids)):
        output = OutputText(tokenizer, [" the"], min_tokens=cut)
        streamed = ""
        match = None
        for start in range(0, len(ids), chunk):
            match = output.push(ids[start : start + chunk])
            streamed += match.text
            if match.matched_stop:
                break
        assert match is not None and match.matched_stop == " the"
        assert streamed == output.text == " the cat and"  # the first " the" lies within min_tokens


def test_a_stop_string_begun_within_min_tokens_matches_where_it_ends_after_them(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode(" the cat sat", add_special_tokens=False)
    cut = len(tokenizer.encode(" the cat", add_special_tokens=False))
    output = OutputText(tokenizer, ["cat sat"], min_tokens=cut)
    text = "".join(output.push([i]).text for i in ids[:cut])
    last = output.push(ids[cut:])
    assert (text + last.text, last.matched_stop) == (" the ", "cat sat")


def test_a_stop_string_within_min_tokens_alone_never_matches(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode(" the cat", add_special_tokens=False)
    output = OutputText(tokenizer, ["cat"], min_tokens=len(ids))
    text = "".join(output.push([i]).text for i in ids)
    end = output.finish()
    assert (text + end.text, end.matched_stop) == (" the cat", None)
