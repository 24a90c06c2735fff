"""Text <-> token ids: GGUF / Hugging Face tokenizers, chat templates, streaming detokenization, stop strings.

The tokenizer is a `tokenizers.Tokenizer` rebuilt from a GGUF's metadata the way llama.cpp reads it (and,
but for the `smollm` note below, the way transformers' GGUF loader does), or loaded from a Hugging Face
folder. Chat templates are rendered with jinja2 in a sandbox, like `transformers.apply_chat_template`.
"""

from __future__ import annotations

import json
import os
from bisect import bisect_right
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from functools import cached_property
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as _Backend

from pdserve.engine.sampling_params import InvalidRequestError

_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp token_type values
_LLAMA3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_SPLITS = dict.fromkeys(("llama-bpe", "llama3", "llama-v3", "smaug-bpe", "dbrx"), _LLAMA3)
_SPLITS.update(dict.fromkeys(("qwen2", "deepseek-r1-qwen"), _QWEN2))
# For these llama.cpp splits off every numeric character, then applies the GPT-2 regex (as SmolLM2's own
# tokenizer.json does). transformers' GGUF loader does not know them and applies only the GPT-2 regex, which
# differs from us on 2+ whitespace characters before a digit ("a  1") and on non-ASCII numerics ("¼").
_DIGIT_PRES = frozenset({"smollm", "starcoder", "refact", "codeshell"})
_GPT2_PRES = frozenset({"default", "gpt2", "mpt", "olmo", None})
_GGUF_SPECIAL = {"bos_token": "bos", "eos_token": "eos", "unk_token": "unknown", "pad_token": "padding"}
# End-of-turn tokens that stop generation when the chat template writes them.
_END_OF_TURN = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<end_of_turn>", "<|end|>", "<|endoftext|>")


def read_gguf_metadata(source: str | os.PathLike | Any) -> dict[str, Any]:
    """All metadata of a GGUF file (a path or an open `gguf.GGUFReader`) as `{name: python value}`."""
    import gguf

    reader = source if isinstance(source, gguf.GGUFReader) else gguf.GGUFReader(os.fspath(source))
    metadata = {}
    for name, field in reader.fields.items():
        try:
            metadata[name] = field.contents()
        except Exception:  # noqa: BLE001 - a field type gguf cannot turn into Python says nothing about tokens
            continue
    return metadata


def byte_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable character table used by byte-level BPE vocabularies."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    cs, n = list(bs), 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs, strict=True)}


def _byte_level_backend(tokens: list[str], merges: list[str], pre: str | None) -> tuple[_Backend, dict]:
    """Byte-level BPE with the pre-tokenizer llama.cpp uses for `tokenizer.ggml.pre`."""
    alphabet = byte_alphabet()
    letters = set(alphabet.values())
    respell = lambda t: t if set(t) <= letters else "".join(alphabet[b] for b in t.encode())  # noqa: E731
    vocab = {respell(t): i for i, t in enumerate(tokens)}
    backend = _Backend(models.BPE(vocab, [tuple(m.split(" ")) for m in merges]))
    byte_level = lambda regex: pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=regex)  # noqa: E731
    if pre in _SPLITS:
        steps = [pre_tokenizers.Split(Regex(_SPLITS[pre]), behavior="isolated"), byte_level(False)]
    elif pre in _DIGIT_PRES:
        steps = [pre_tokenizers.Digits(individual_digits=True), byte_level(True)]
    elif pre in _GPT2_PRES:
        steps = [byte_level(True)]
    else:
        known = sorted({*_SPLITS, *_DIGIT_PRES, *(p for p in _GPT2_PRES if p)})
        raise ValueError(f"unsupported tokenizer.ggml.pre {pre!r} for a gpt2 vocabulary; known: {known}")
    backend.pre_tokenizer = pre_tokenizers.Sequence(steps)
    backend.decoder = decoders.ByteLevel()
    return backend, vocab


def _sentencepiece_backend(
    tokens: list[str], merges: list[str], scores: Sequence[float]
) -> tuple[_Backend, dict]:
    """Sentencepiece as BPE with byte fallback (transformers' LlamaTokenizer); merges come from the scores."""
    vocab = {t: i for i, t in enumerate(tokens)}
    pairs = [tuple(m.split(" ")) for m in merges]
    if not pairs:  # every split of a token into two tokens, best-scored token first
        ranked = []
        for token, index in vocab.items():
            local = [
                (token[:i], token[i:])
                for i in range(1, len(token))
                if token[:i] in vocab and token[i:] in vocab
            ]
            local.sort(key=lambda m: (vocab[m[0]], vocab[m[1]]))
            ranked += [(left, right, scores[index]) for left, right in local]
        ranked.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
        pairs = [(left, right) for left, right, _ in ranked]
    backend = _Backend(models.BPE(vocab, pairs, fuse_unk=True, byte_fallback=True))
    backend.pre_tokenizer = pre_tokenizers.Metaspace("▁", prepend_scheme="first", split=False)
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    backend.decoder = decoders.Sequence(steps)
    return backend, vocab


def _tojson(x: Any, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    """transformers' `tojson` template filter: plain `json.dumps`, no HTML escaping."""
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


class Tokenizer:
    """A model's tokenizer: `encode`/`decode`, special token ids and its chat template."""

    def __init__(
        self,
        backend: _Backend,
        *,
        bos_token_id: int | None = None,
        eos_token_ids: Iterable[int] = (),
        chat_template: str | None = None,
        special_tokens: Mapping[str, str | None] | None = None,
    ) -> None:
        """Wrap `backend`; `special_tokens` maps `bos_token`, `eos_token`, ... to their text for templates.

        `eos_token_ids` gets the end-of-turn token (`<|im_end|>`, `<|eot_id|>`, ...) the chat template writes.
        """
        self.backend = backend
        self.bos_token_id = bos_token_id
        self.chat_template = chat_template
        self.special_tokens = dict(special_tokens or {})
        eos = set(eos_token_ids)
        for token in _END_OF_TURN:
            tid = backend.token_to_id(token)
            if chat_template and token in chat_template and tid is not None:
                eos.add(tid)
        self.eos_token_ids: frozenset[int] = frozenset(eos)
        # With byte fallback, decode turns a whole run of `<0xNN>` tokens into U+FFFDs if any byte is invalid.
        self.byte_fallback = bool(getattr(backend.model, "byte_fallback", False))
        added = backend.get_added_tokens_decoder()
        self.special_ids = frozenset(i for i, token in added.items() if token.special)

    @classmethod
    def from_gguf(cls, path: str | os.PathLike) -> Tokenizer:
        """Shorthand for `from_gguf_metadata(read_gguf_metadata(path))`."""
        return cls.from_gguf_metadata(read_gguf_metadata(path))

    @classmethod
    def from_gguf_metadata(cls, fields: Mapping[str, Any]) -> Tokenizer:
        """Build from GGUF metadata (`read_gguf_metadata`'s dict, llama.cpp key names).

        Supports `tokenizer.ggml.model` `gpt2` (byte-level BPE; `pre` one of the GPT-2 family, `smollm` and
        other digit-splitting ones, `llama-bpe`, `qwen2` and aliases) and `llama` (sentencepiece BPE with
        byte fallback). Anything else raises `ValueError`. Control tokens (type 3) become special tokens,
        user-defined ones (type 4) plain added tokens, as transformers' GGUF loader does.
        """
        get = lambda key, default=None: fields.get(f"tokenizer.ggml.{key}", default)  # noqa: E731
        kind, tokens, merges = get("model"), list(get("tokens") or []), get("merges") or []
        if not tokens:
            raise ValueError("GGUF metadata has no tokenizer.ggml.tokens")
        if kind == "gpt2":
            backend, vocab = _byte_level_backend(tokens, merges, get("pre"))
        elif kind == "llama":
            backend, vocab = _sentencepiece_backend(tokens, merges, get("scores") or [0.0] * len(tokens))
        else:
            raise ValueError(f"unsupported GGUF tokenizer model {kind!r} (supported: 'gpt2', 'llama')")
        # `t in vocab`: a byte-level token spelled outside the byte alphabet is a llama.cpp mislabel; skip it.
        typed = [
            (t, ty)
            for t, ty in zip(tokens, get("token_type") or [1] * len(tokens), strict=True)
            if t in vocab
        ]
        backend.add_special_tokens(
            [AddedToken(t, normalized=False, special=True) for t, ty in typed if ty == _CONTROL]
        )
        backend.add_tokens(
            [AddedToken(t, normalized=False, special=False) for t, ty in typed if ty == _USER_DEFINED]
        )
        ids = {name: get(f"{key}_token_id") for name, key in _GGUF_SPECIAL.items()}
        special = {name: None if i is None else tokens[i] for name, i in ids.items()}
        bos, eos = ids["bos_token"], ids["eos_token"]
        add_bos = bool(get("add_bos_token", kind == "llama")) and bos is not None
        add_eos = bool(get("add_eos_token", False)) and eos is not None
        if add_bos or add_eos:
            ends = [tokens[bos]] * add_bos, [tokens[eos]] * add_eos
            backend.post_processor = processors.TemplateProcessing(
                single=[*ends[0], "$A", *ends[1]],
                special_tokens=[(tokens[i], i) for i, on in ((bos, add_bos), (eos, add_eos)) if on],
            )
        eos_ids = {i for i in (eos, get("eot_token_id"), get("eom_token_id")) if i is not None}
        template = fields.get("tokenizer.chat_template")
        return cls(
            backend, bos_token_id=bos, eos_token_ids=eos_ids, chat_template=template, special_tokens=special
        )

    @classmethod
    def from_hf_folder(cls, path: str | os.PathLike) -> Tokenizer:
        """Load a Hugging Face tokenizer folder.

        Reads `tokenizer.json`; `tokenizer_config.json` (special tokens, chat template, which may also be
        in `chat_template.jinja` / `chat_template.json`); eos ids from `config.json` and
        `generation_config.json`, plus the `eos_token` and the chat end token (see `eos_token_ids`).
        """
        folder = Path(path)
        load = lambda name: json.loads((folder / name).read_text()) if (folder / name).is_file() else {}  # noqa: E731
        backend = _Backend.from_file(str(folder / "tokenizer.json"))
        config = load("tokenizer_config.json")
        special = {k: config.get(k) for k in ("bos_token", "eos_token", "unk_token", "pad_token")}
        special = {k: v.get("content") if isinstance(v, dict) else v for k, v in special.items()}
        template = config.get("chat_template") or load("chat_template.json").get("chat_template")
        if (folder / "chat_template.jinja").is_file():
            template = (folder / "chat_template.jinja").read_text()
        if isinstance(template, list):  # [{"name": ..., "template": ...}]
            template = {t["name"]: t["template"] for t in template}.get("default")
        eos: set[int] = set()
        for source in (load("config.json"), load("generation_config.json")):
            value = source.get("eos_token_id")
            eos.update(value if isinstance(value, list) else [] if value is None else [value])
        if special["eos_token"] and backend.token_to_id(special["eos_token"]) is not None:
            eos.add(backend.token_to_id(special["eos_token"]))
        bos = backend.token_to_id(special["bos_token"]) if special["bos_token"] else None
        return cls(
            backend, bos_token_id=bos, eos_token_ids=eos, chat_template=template, special_tokens=special
        )

    @property
    def vocab_size(self) -> int:
        """Number of token ids, added tokens included."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of `text`; `add_special_tokens` adds BOS/EOS as the model's tokenizer config says."""
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        """Text of `ids` (invalid UTF-8 becomes U+FFFD)."""
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        """The vocabulary entry of `token_id` (byte-level spelling), or None."""
        return self.backend.id_to_token(token_id)

    @cached_property
    def _template(self) -> jinja2.Template:
        if not self.chat_template:
            raise ValueError("this tokenizer has no chat template")

        def raise_exception(message: str) -> None:
            raise jinja2.exceptions.TemplateError(message)

        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
        )
        env.filters["tojson"] = _tojson
        env.globals.update(raise_exception=raise_exception, strftime_now=lambda f: datetime.now().strftime(f))
        return env.from_string(self.chat_template)

    def apply_chat_template(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        **kwargs: Any,
    ) -> str:
        """Render `messages` with the chat template; `kwargs` (e.g. `tools`) go to the template too.
        `continue_final_message`: the rendering ends with the last message's text, left open for the model
        to continue (no end-of-turn after it; ValueError when the template does not write that text)."""
        variables = {"tools": None, "documents": None, **self.special_tokens, **kwargs}
        text = self._template.render(
            messages=messages, add_generation_prompt=add_generation_prompt, **variables
        )
        if not continue_final_message:
            return text
        final = (messages[-1].get("content") or "").strip()
        at = text.rfind(final) if final else -1
        if at < 0:
            raise ValueError("continue_final_message: the last message's text is not in the rendered chat")
        return text[: at + len(final)]

    def encode_chat(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        field: str = "messages",
        max_chars: int | None = None,
        **kwargs: Any,
    ) -> list[int]:
        """Token ids of the rendered chat (the template writes any BOS itself, as in transformers).

        A chat the template refuses or fails on (its raise_exception, a type it cannot render, the
        sandbox's limits), or one rendered to more than `max_chars` characters, is an InvalidRequestError
        naming `field`."""
        try:
            text = self.apply_chat_template(messages, add_generation_prompt, **kwargs)
        except (jinja2.TemplateError, TypeError, ValueError, AttributeError, RecursionError) as e:
            raise InvalidRequestError(field, f"the chat template failed: {type(e).__name__}: {e}") from None
        if max_chars is not None and len(text) > max_chars:
            raise InvalidRequestError(field, f"renders to {len(text)} characters: the limit is {max_chars}")
        return self.encode(text)


class IncrementalDetokenizer:
    """Turns a stream of token ids into text deltas that never split a UTF-8 character.

    Uses the prefix/read offset technique (vLLM, TGI): the delta is `decode(ids[p:]) - decode(ids[p:r])`
    with `p` the start of the previous emitted chunk, held back while it ends in U+FFFD (an unfinished
    multi-byte character) or, with byte fallback, in a `<0xNN>` token (its run can still turn invalid).
    `"".join(deltas from add) + finish() == tokenizer.decode(all ids, skip_special_tokens)`.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self.tokenizer, self.skip_special_tokens = tokenizer, skip_special_tokens
        self.ids: list[int] = []
        self._prefix = self._read = 0

    def _delta(self, final: bool) -> str:
        decode = lambda ids: self.tokenizer.decode(ids, self.skip_special_tokens)  # noqa: E731
        prefix_text = decode(self.ids[self._prefix : self._read])
        new_text = decode(self.ids[self._prefix :])
        if len(new_text) <= len(prefix_text):
            return ""
        if not final and (new_text.endswith("\ufffd") or self._in_byte_run()):
            return ""
        self._prefix, self._read = self._read, len(self.ids)
        return new_text[len(prefix_text) :]

    def _in_byte_run(self) -> bool:
        if self.tokenizer.byte_fallback:
            skipped = self.tokenizer.special_ids if self.skip_special_tokens else frozenset()
            for token_id in reversed(self.ids):
                if token_id not in skipped:
                    token = self.tokenizer.id_to_token(token_id) or ""
                    return len(token) == 6 and token.startswith("<0x") and token.endswith(">")
        return False

    def add(self, token_ids: int | Iterable[int]) -> str:
        """Append one or more token ids; return the text that became final (possibly "")."""
        self.ids.extend([token_ids] if isinstance(token_ids, int) else token_ids)
        return self._delta(final=False)

    def finish(self) -> str:
        """End of stream: return whatever is still held back (an unfinished character shows as U+FFFD)."""
        return self._delta(final=True)


class StopStringMatcher:
    """Cuts streamed text at the first stop string, never showing the client any part of one.

    `feed(delta)` returns the text that is safe to emit: it holds back a tail of the text that could be the
    start of a stop string. Once a stop string is seen, `stopped` is set, its text (`matched`) and everything
    after it are dropped. At the end of a stream without a stop, `flush()` returns what was held back.

    The work per `feed` does not grow with the number N of stop strings (a request may send 100,000s): with
    L the longest stop's length and D <= L the number of distinct lengths, it hashes len(delta) * D slices of
    at most L characters (a set lookup each) and runs at most L - 1 binary searches for the held tail, each
    O(L log N). Construction (O(N log N), once) keeps a frozenset and a sorted tuple of the stop strings,
    sharing the strings themselves, and their distinct lengths: O(N) memory beyond the strings.
    """

    def __init__(self, stop_strings: Iterable[str]) -> None:
        self.stop_strings = tuple(s for s in stop_strings if s)
        self.stopped, self.matched = False, None
        self._held = ""
        self._stops = frozenset(self.stop_strings)
        self._sorted = tuple(sorted(self._stops))  # strings with a given prefix form a contiguous run
        self._lengths = sorted({len(s) for s in self._stops}, reverse=True)  # longest first: ties go to it
        self._longest = self._lengths[0] if self._lengths else 0

    def feed(self, delta: str) -> str:
        """Add newly generated text; return the part of it (with earlier held text) that can be emitted."""
        if self.stopped:
            return ""
        text = self._held + delta
        # The stop that ends first wins (ties: the longest), as if the text had come one character at a time.
        # Held text never contains a whole stop (it was checked last call), so a stop can only end in `delta`.
        for end in range(len(self._held) + 1, len(text) + 1):
            for n in self._lengths:
                if n <= end and text[end - n : end] in self._stops:
                    self.stopped, self.matched, self._held = True, text[end - n : end], ""
                    return text[: end - n]
        keep = 0  # longest tail of `text` that is a proper prefix of a stop string (tail itself is no stop)
        for n in range(min(self._longest - 1, len(text)), 0, -1):
            tail = text[len(text) - n :]
            # Stops that start with tail sort together, right after tail: check the first stop > tail.
            i = bisect_right(self._sorted, tail)
            if i < len(self._sorted) and self._sorted[i].startswith(tail):
                keep = n
                break
        self._held = text[len(text) - keep :]
        return text[: len(text) - keep]

    def flush(self) -> str:
        """Return the held-back text (call when generation ended without a stop string)."""
        held, self._held = self._held, ""
        return "" if self.stopped else held
