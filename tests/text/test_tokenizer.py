"""The torch-free tokenizer against transformers' tokenizer for the same embedded GGUF."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ominix_runtime.models import embedded_model_path
from ominix_runtime.text import Tokenizer, TokenizerError

SAMPLES = [
    "Hello world",
    "  leading spaces and trailing  ",
    "12345 + 678 = 7023",
    "héllo wörld — ça va?",
    "emoji 😀👍🏽 and 🇫🇷 flags",
    "中文测试，日本語のテキスト、한국어",
    "code: def f(x):\n\treturn x**2  # comment\n",
    "<|im_start|>user\nhi there<|im_end|>\n",
    "",
]


@pytest.fixture(scope="module")
def ours(smollm2_tokenizer: Tokenizer) -> Tokenizer:
    return smollm2_tokenizer


@pytest.fixture(scope="module")
def reference():
    transformers = pytest.importorskip("transformers")
    path = embedded_model_path()
    return transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


def test_special_ids_match_the_embedded_model(ours: Tokenizer) -> None:
    assert ours.bos_token_id == 1
    assert ours.eos_token_ids == (2,)
    assert ours.vocab_size == 49152
    assert ours.chat_template and "<|im_start|>" in ours.chat_template


@pytest.mark.parametrize("text", SAMPLES)
def test_encode_matches_transformers(ours: Tokenizer, reference, text: str) -> None:
    assert ours.encode(text) == reference.encode(text)
    assert ours.encode(text, add_special_tokens=False) == reference.encode(text, add_special_tokens=False)


@pytest.mark.parametrize("text", SAMPLES)
def test_decode_matches_transformers(ours: Tokenizer, reference, text: str) -> None:
    ids = reference.encode(text)
    assert ours.decode(ids) == reference.decode(ids, skip_special_tokens=True)
    assert ours.decode(ids, skip_special_tokens=False) == reference.decode(ids, skip_special_tokens=False)


def test_chat_template_matches_transformers(ours: Tokenizer, reference) -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Quelle heure est-il ? 🕐"},
        {"role": "assistant", "content": "Midi."},
        {"role": "user", "content": "Merci"},
    ]
    for add_generation_prompt in (True, False):
        expected = reference.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt
        )
        assert ours.apply_chat_template(messages, add_generation_prompt) == expected
    assert ours.encode_chat(messages[1:2]) == reference.apply_chat_template(
        messages[1:2], tokenize=True, add_generation_prompt=True, return_dict=False
    )


def test_template_raise_exception_becomes_a_clear_error(ours: Tokenizer) -> None:
    bad = Tokenizer(
        backend=ours.backend,
        bos_token_id=1,
        eos_token_ids=(2,),
        add_bos_token=False,
        chat_template="{% if messages[0]['role'] != 'user' %}{{ raise_exception('user first') }}{% endif %}ok",
    )
    with pytest.raises(TokenizerError, match="user first"):
        bad.apply_chat_template([{"role": "system", "content": "x"}])
    assert bad.apply_chat_template([{"role": "user", "content": "x"}]) == "ok"


def test_template_kwargs_may_turn_the_generation_prompt_off_but_not_set_the_engines_variables(
    ours: Tokenizer,
) -> None:
    """chat_template_kwargs {"add_generation_prompt": false} (to continue a turn) renders as the argument does;
    the variables the engine fills itself are refused with a clear error, not a TypeError."""
    messages = [{"role": "user", "content": "hi"}]
    off = ours.tokenize_chat(messages, template_kwargs={"add_generation_prompt": False})
    assert off == ours.tokenize_chat(messages, add_generation_prompt=False)
    assert off != ours.tokenize_chat(messages)  # the default writes the assistant's header
    for key in ("messages", "bos_token", "eos_token"):
        with pytest.raises(TokenizerError, match=f"may not set {key}"):
            ours.tokenize_chat(messages, template_kwargs={key: "x"})
    assert ours.tokenize_chat(
        messages, template_kwargs={"add_generation_prompt": None}
    ) == ours.tokenize_chat(messages)
    for not_a_flag in ("false", 0):  # the string "false" used to count as true
        with pytest.raises(TokenizerError, match="add_generation_prompt must be true or false"):
            ours.tokenize_chat(messages, template_kwargs={"add_generation_prompt": not_a_flag})


def test_hf_folder_round_trip(ours: Tokenizer, tmp_path: Path) -> None:
    """The GGUF tokenizer exported to tokenizer.json loads back from a HF folder with the same behaviour."""
    ours.backend.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "bos_token": "<|im_start|>",
                "eos_token": "<|im_end|>",
                "chat_template": ours.chat_template,
            }
        )
    )
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 2}))
    folder = Tokenizer.from_hf_folder(tmp_path)
    assert folder.eos_token_ids == (2, 0)
    assert folder.bos_token_id == 1
    for text in SAMPLES:
        assert folder.encode(text) == ours.encode(text)
    messages = [{"role": "user", "content": "hi"}]
    assert folder.apply_chat_template(messages) == ours.apply_chat_template(messages)
