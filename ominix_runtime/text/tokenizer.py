"""Torch-free tokenizer built on the ``tokenizers`` package, from a GGUF file or a Hugging Face folder."""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as HFTokenizer

from ominix_runtime.contract import InvalidArgument
from ominix_runtime.models import ModelFormat, ModelSource

if TYPE_CHECKING:  # jinja2 loads only when a chat template is first rendered
    from jinja2 import Template

# GGUF token types (llama.cpp's llama_token_type).
_TOKEN_TYPE_CONTROL = 3
_TOKEN_TYPE_USER_DEFINED = 4

# Pre-tokenizer split patterns of the GGUF `tokenizer.ggml.pre` families whose regex differs from GPT-2's.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)
_SPLIT_BY_PRE: dict[str, str] = {
    "llama-bpe": _LLAMA3_SPLIT,
    "llama3": _LLAMA3_SPLIT,
    "smaug-bpe": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT,
}


# Stand-ins for special-token strings found inside chat content while the template renders: private-use
# characters that no template writes. The opening character is itself escaped when content carries it.
_MARK_OPEN = "\ue000"
_MARK_CLOSE = "\ue001"
_MARK = re.compile(f"{_MARK_OPEN}(\\d+){_MARK_CLOSE}")


# What apply_chat_template itself passes to the template beside its add_generation_prompt argument.
_TEMPLATE_VARIABLES = frozenset({"messages", "bos_token", "eos_token"})


class TokenizerError(InvalidArgument):
    """The model's tokenizer cannot be built or used."""


@dataclass(frozen=True, slots=True)
class EncodedPrompt:
    """A prompt as the engine sees it: the text (for logs and request-level backends) and its token ids."""

    text: str
    token_ids: list[int]


@dataclass(slots=True)
class Tokenizer:
    """Encode, decode and chat templates for one model."""

    backend: HFTokenizer
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    add_bos_token: bool
    chat_template: str | None = None
    special_token_ids: frozenset[int] = field(default_factory=frozenset)
    _compiled_template: Template | None = None
    # A copy of ``backend`` that reads special-token strings as plain text (user content), and the
    # patterns that find those strings; built on first use.
    _plain: HFTokenizer | None = None
    _special_re: re.Pattern[str] | None = None
    _escape_re: re.Pattern[str] | None = None
    _max_token_chars: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)

    # ---- construction --------------------------------------------------------------------------------

    @classmethod
    def from_source(cls, source: ModelSource) -> Tokenizer:
        if source.format == ModelFormat.GGUF:
            return cls.from_gguf(source.path)
        folder = source.path if source.path.is_dir() else source.path.parent
        return cls.from_hf_folder(folder)

    @classmethod
    def from_gguf(cls, path: str | Path) -> Tokenizer:
        import gguf  # imported here: only GGUF models need it

        reader = gguf.GGUFReader(str(path))
        fields = reader.fields

        def scalar(key: str, default: Any = None) -> Any:
            f = fields.get(key)
            return default if f is None else f.contents()

        def string_array(key: str) -> list[str]:
            f = fields.get(key)
            if f is None:
                return []
            return [bytes(f.parts[i]).decode("utf-8") for i in f.data]

        model_kind = scalar("tokenizer.ggml.model")
        if model_kind != "gpt2":
            raise TokenizerError(
                f"GGUF tokenizer model '{model_kind}' is not supported (byte-level BPE 'gpt2' is); "
                "serve the model from a Hugging Face folder with tokenizer.json instead"
            )
        tokens = string_array("tokenizer.ggml.tokens")
        merges = [
            (left, right)
            for left, _, right in (m.partition(" ") for m in string_array("tokenizer.ggml.merges"))
        ]
        type_field = fields.get("tokenizer.ggml.token_type")
        token_types = [int(type_field.parts[i][0]) for i in type_field.data] if type_field else []
        vocab = {tok: i for i, tok in enumerate(tokens)}
        backend = HFTokenizer(
            models.BPE(
                vocab=vocab,
                merges=merges,
                continuing_subword_prefix="",
                end_of_word_suffix="",
                fuse_unk=False,
                byte_fallback=False,
            )
        )
        split = _SPLIT_BY_PRE.get(str(scalar("tokenizer.ggml.pre", "")))
        if split is None:
            backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        else:
            backend.pre_tokenizer = pre_tokenizers.Sequence(
                [
                    pre_tokenizers.Split(Regex(split), behavior="isolated"),
                    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
                ]
            )
        backend.decoder = decoders.ByteLevel()
        special: list[AddedToken] = []
        user_defined: list[AddedToken] = []
        for token_id, token_type in enumerate(token_types):
            if token_type == _TOKEN_TYPE_CONTROL:
                special.append(AddedToken(tokens[token_id], special=True, normalized=False))
            elif token_type == _TOKEN_TYPE_USER_DEFINED:
                user_defined.append(AddedToken(tokens[token_id], special=False, normalized=False))
        backend.add_special_tokens(special)
        backend.add_tokens(user_defined)

        bos = scalar("tokenizer.ggml.bos_token_id")
        eos = scalar("tokenizer.ggml.eos_token_id")
        eot = scalar("tokenizer.ggml.eot_token_id")
        eos_ids = tuple(dict.fromkeys(int(t) for t in (eos, eot) if t is not None))
        add_bos = bool(scalar("tokenizer.ggml.add_bos_token", bos is not None))
        tokenizer = cls(
            backend=backend,
            bos_token_id=None if bos is None else int(bos),
            eos_token_ids=eos_ids,
            add_bos_token=add_bos and bos is not None,
            chat_template=scalar("tokenizer.chat_template"),
            special_token_ids=frozenset(vocab[t.content] for t in special),
        )
        tokenizer._install_bos_post_processor()
        return tokenizer

    @classmethod
    def from_hf_folder(cls, folder: str | Path) -> Tokenizer:
        folder = Path(folder)
        tokenizer_file = folder / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise TokenizerError(f"{folder} has no tokenizer.json (only fast tokenizers are supported)")
        backend = HFTokenizer.from_file(str(tokenizer_file))
        config = _read_json(folder / "tokenizer_config.json")
        generation = _read_json(folder / "generation_config.json")
        model_config = _read_json(folder / "config.json")

        def token_id(value: Any) -> int | None:
            if isinstance(value, dict):
                value = value.get("content")
            return backend.token_to_id(value) if isinstance(value, str) else None

        bos = token_id(config.get("bos_token"))
        if bos is None and isinstance(model_config.get("bos_token_id"), int):
            bos = model_config["bos_token_id"]
        eos_ids: list[int] = []
        for source in (generation.get("eos_token_id"), model_config.get("eos_token_id")):
            eos_ids.extend([source] if isinstance(source, int) else source or [])
        eos_from_config = token_id(config.get("eos_token"))
        if eos_from_config is not None:
            eos_ids.append(eos_from_config)

        template = config.get("chat_template")
        if isinstance(template, list):  # named templates: use "default"
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default") or next(iter(named.values()), None)
        jinja_file = folder / "chat_template.jinja"
        if template is None and jinja_file.is_file():
            template = jinja_file.read_text(encoding="utf-8")

        special_ids = {
            i for i, added in backend.get_added_tokens_decoder().items() if getattr(added, "special", False)
        }
        # The post-processor in tokenizer.json (if any) decides BOS for HF folders; add_bos_token only
        # matters when it has none (a bare BPE export).
        add_bos = bool(config.get("add_bos_token", False)) and backend.post_processor is None
        tokenizer = cls(
            backend=backend,
            bos_token_id=bos,
            eos_token_ids=tuple(dict.fromkeys(int(t) for t in eos_ids)),
            add_bos_token=add_bos and bos is not None,
            chat_template=template if isinstance(template, str) else None,
            special_token_ids=frozenset(special_ids),
        )
        if tokenizer.add_bos_token:
            tokenizer._install_bos_post_processor()
        return tokenizer

    def _install_bos_post_processor(self) -> None:
        if self.add_bos_token and self.bos_token_id is not None:
            bos = self.backend.id_to_token(self.bos_token_id)
            self.backend.post_processor = processors.TemplateProcessing(
                single=f"{bos} $A", pair=f"{bos} $A $B:1", special_tokens=[(bos, self.bos_token_id)]
            )
        else:
            self.backend.post_processor = None

    # ---- use -----------------------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def token_text(self, token_id: int) -> str | None:
        return self.backend.id_to_token(token_id)

    def prepare(self) -> Tokenizer:
        """Build now what is otherwise built on first use (the plain-text copy, the longest token): seconds of
        work that would otherwise hold the GIL while the first request waits. Returns self."""
        self._prepare_special()
        _ = self.max_token_chars
        if self.chat_template and self._compiled_template is None:
            self._compiled_template = _compile_template(self.chat_template)
        return self

    @property
    def max_token_chars(self) -> int:
        """The longest text one token stands for (a byte-level token's string has a character per byte)."""
        if not self._max_token_chars:
            self._max_token_chars = max(
                (len(t) for t in self.backend.get_vocab(with_added_tokens=True)), default=1
            )
        return self._max_token_chars

    def encode(self, text: str, add_special_tokens: bool = True, parse_special: bool = True) -> list[int]:
        """Token ids of ``text``; with ``parse_special`` False, special-token strings in it are plain text.

        encode_batch releases the GIL while the Rust tokenizer runs (encode does not), so a long prompt
        tokenized on a worker thread leaves the event loop free.
        """
        backend = self.backend if parse_special else self._plain_backend()
        return backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def _plain_backend(self) -> HFTokenizer:
        self._prepare_special()
        assert self._plain is not None
        return self._plain

    def _prepare_special(self) -> None:
        if self._plain is not None:
            return
        with self._lock:
            if self._plain is not None:
                return
            plain = HFTokenizer.from_str(self.backend.to_str())
            plain.encode_special_tokens = True
            strings = sorted(
                {t for i in self.special_token_ids if (t := self.backend.id_to_token(i))},
                key=len,
                reverse=True,
            )
            alternatives = [re.escape(t) for t in strings]
            self._special_re = re.compile("|".join(alternatives)) if alternatives else None
            self._escape_re = re.compile("|".join([*alternatives, _MARK_OPEN]))
            self._plain = plain

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        **template_kwargs: Any,
    ) -> str:
        """Render chat turns to a prompt string (encode it with ``add_special_tokens=False``)."""
        if not self.chat_template:
            raise TokenizerError("this model has no chat template; send a plain prompt instead")
        if self._compiled_template is None:
            self._compiled_template = _compile_template(self.chat_template)
        bos = self.backend.id_to_token(self.bos_token_id) if self.bos_token_id is not None else ""
        eos = self.backend.id_to_token(self.eos_token_ids[0]) if self.eos_token_ids else ""
        try:
            return self._compiled_template.render(
                messages=[dict(m) for m in messages],
                add_generation_prompt=add_generation_prompt,
                bos_token=bos or "",
                eos_token=eos or "",
                **template_kwargs,
            )
        except TemplateRaised as exc:
            raise TokenizerError(f"chat template refused the messages: {exc}") from exc
        except Exception as exc:  # jinja2 errors: a template bug or messages it cannot render
            raise TokenizerError(f"chat template failed: {exc}") from exc

    def encode_chat(
        self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True
    ) -> list[int]:
        return self.tokenize_chat(messages, add_generation_prompt).token_ids

    def tokenize_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        parse_special_in_content: bool = False,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> EncodedPrompt:
        """Render and tokenize chat turns. Special tokens come from the template only: a special-token
        string inside a message's content is tokenized as the text it is (no role forging), unless
        ``parse_special_in_content`` (trusted callers).

        The template renders with such strings replaced by private-use markers; the rendered text is cut at
        the template's own special tokens and every piece between them is tokenized as plain text with the
        markers put back. For content without special-token strings the ids equal a plain HF encode.
        """
        # The template writes its own BOS/special tokens, so none are added on top (HF behaviour).
        extra = dict(template_kwargs or {})  # e.g. enable_thinking for Qwen3-style templates
        # A caller's kwargs may turn the generation prompt off (to continue a turn), as the argument does.
        given = extra.pop("add_generation_prompt", None)  # null: as if not given
        add_generation_prompt = add_generation_prompt if given is None else given
        if not isinstance(add_generation_prompt, bool):  # bool("false") would turn it on
            raise TokenizerError(
                f"chat_template_kwargs.add_generation_prompt must be true or false, got {add_generation_prompt!r}"
            )
        taken = sorted(_TEMPLATE_VARIABLES & extra.keys())
        if taken:
            raise TokenizerError(
                f"chat_template_kwargs may not set {', '.join(taken)}: the engine fills them"
            )
        if parse_special_in_content:
            text = self.apply_chat_template(messages, add_generation_prompt, **extra)
            return EncodedPrompt(text, self.encode(text, add_special_tokens=False))
        self._prepare_special()
        assert self._escape_re is not None and self._plain is not None
        originals: list[str] = []

        def mark(match: re.Match[str]) -> str:
            originals.append(match.group(0))
            return f"{_MARK_OPEN}{len(originals) - 1}{_MARK_CLOSE}"

        escaped = [
            {**m, "content": self._escape_re.sub(mark, m["content"])}
            if isinstance(m.get("content"), str)
            else m
            for m in messages
        ]
        rendered = self.apply_chat_template(escaped, add_generation_prompt, **extra)

        def unmark(text: str) -> str:
            return _MARK.sub(lambda m: originals[int(m.group(1))], text) if originals else text

        pieces: list[str] = []
        specials: list[int | None] = []  # the template's special token after each piece (None: the end)
        position = 0
        for match in self._special_re.finditer(rendered) if self._special_re is not None else ():
            pieces.append(unmark(rendered[position : match.start()]))
            specials.append(self.backend.token_to_id(match.group(0)))
            position = match.end()
        pieces.append(unmark(rendered[position:]))
        specials.append(None)
        encodings = self._plain.encode_batch(pieces, add_special_tokens=False)
        ids: list[int] = []
        for encoding, special in zip(encodings, specials, strict=True):
            ids.extend(encoding.ids)
            if special is not None:
                ids.append(special)
        return EncodedPrompt(unmark(rendered), ids)


class TemplateRaised(Exception):
    """A chat template called raise_exception()."""


def _raise_exception(message: str) -> None:
    raise TemplateRaised(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: Any = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _compile_template(source: str) -> Template:
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    with path.open(encoding="utf-8") as f:
        data = json.load(f)
    return data if isinstance(data, dict) else {}


def load_tokenizer(model: str | None) -> Tokenizer:
    """Tokenizer of a ``--model`` argument (see :func:`ominix_runtime.models.resolve_model`)."""
    from ominix_runtime.models import resolve_model

    return Tokenizer.from_source(resolve_model(model))
