"""Tests for engine.tokenizer: GGUF tokenizer vs transformers, chat templates, streaming, stop strings."""

from __future__ import annotations

import json
import os
import re
import sys
import unicodedata

import gguf
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdserve.engine.tokenizer import (
    IncrementalDetokenizer,
    StopStringMatcher,
    Tokenizer,
    byte_alphabet,
    read_gguf_metadata,
)

HYP = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])

TEXTS = [
    "Hello, world!",
    "The year 2024 had 366 days; pi = 3.14159265.",
    "a  1",
    "x   12 y\t\t3\n\n4",
    "1234567890 00 007",
    "日本語のテキストと中文字符",
    "emoji 😀👍🏽👨‍👩‍👧 and flags 🇫🇷",
    "Ünïcödé façade naïve Ωμέγα Привет",
    "   leading and trailing   ",
    "\t\ttabs\r\nand\n\n\nnewlines\n",
    "def f(x):\n    return x ** 2  # square\n\nprint(f(3))\n",
    "I'm sure you'll see they've done it, can't they?",
    "<|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|><repo_name>pdserve<file_sep>x",
    "text<|im_end|>more",
    "",
]
CHATS = [
    [{"role": "user", "content": "Hi there"}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "And 😀 × 3?"},
    ],
]


@pytest.fixture(scope="module")
def metadata(full_gguf_path):
    """The default model's tokenizer metadata, from where `pdserve models fetch` puts the model."""
    return read_gguf_metadata(full_gguf_path)


@pytest.fixture(scope="module")
def tok(metadata):
    return Tokenizer.from_gguf_metadata(metadata)


@pytest.fixture(scope="module")
def hf(full_gguf_path):
    transformers = pytest.importorskip("transformers", reason="needs the reference extra (transformers)")
    folder, name = os.path.split(full_gguf_path)
    return transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)


def write_sentencepiece_gguf(path) -> list[str]:
    """A tiny llama-style (sentencepiece BPE, byte fallback) GGUF with no tensors; returns its tokens."""
    pieces = ["▁", "a", "b", "c", "▁a", "▁b", "ab", "bc", "▁ab", "abc", "▁abc", "h", "e", "l", "o"]
    pieces += ["he", "ll", "▁he", "llo", "▁hello", "▁hell", "<|user|>", "<|end|>"]
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), *pieces]
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_types([2, 3, 3] + [6] * 256 + [1] * (len(pieces) - 2) + [4, 3])
    writer.add_token_scores([0.0] * 259 + [-float(i) for i in range(len(pieces))])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_chat_template(
        "{{ bos_token }}{% for m in messages %}[{{ m.role }}] {{ m.content }}<|end|>{% endfor %}"
    )
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return tokens


# ---------------------------------------------------------------- the GGUF tokenizer on its own


@pytest.mark.model
def test_special_tokens_and_sizes(tok):
    assert tok.vocab_size == 49152
    assert tok.bos_token_id == 1
    assert tok.eos_token_ids == frozenset({2})  # eos is <|im_end|>, the chat end token
    assert tok.encode("<|im_start|>user<|im_end|>") == [1, 4093, 2]
    assert tok.encode("hi", add_special_tokens=True) == tok.encode("hi")  # add_bos_token is False
    assert tok.decode([1, 4093, 2], skip_special_tokens=True) == "user"


@pytest.mark.model
def test_smollm_splits_digits_like_llama_cpp(tok):
    pieces = lambda text: [tok.id_to_token(i) for i in tok.encode(text)]  # noqa: E731
    assert pieces("hello 12345") == ["hello", "Ġ", "1", "2", "3", "4", "5"]
    # llama.cpp's smollm rule (and SmolLM2's tokenizer.json): digits are split off before the GPT-2 regex
    assert pieces("a  1") == ["a", "ĠĠ", "1"]


@pytest.mark.model
@pytest.mark.parametrize("text", TEXTS)
def test_roundtrip(tok, text):
    assert tok.decode(tok.encode(text)) == text


@pytest.mark.model
def test_unsupported_tokenizers_raise(metadata):
    with pytest.raises(ValueError, match="tokenizer model 'bert'"):
        Tokenizer.from_gguf_metadata({**metadata, "tokenizer.ggml.model": "bert"})
    with pytest.raises(ValueError, match="tokenizer.ggml.pre 'mystery'"):
        Tokenizer.from_gguf_metadata({**metadata, "tokenizer.ggml.pre": "mystery"})
    with pytest.raises(ValueError, match="no tokenizer.ggml.tokens"):
        Tokenizer.from_gguf_metadata({"tokenizer.ggml.model": "gpt2"})


@pytest.mark.model
def test_chat_template(tok):
    text = tok.apply_chat_template(CHATS[0])
    assert text == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n"
    )
    assert tok.apply_chat_template(CHATS[0], add_generation_prompt=False) == text.removesuffix(
        "<|im_start|>assistant\n"
    )
    assert tok.encode_chat(CHATS[0]) == tok.encode(text)
    assert tok.encode_chat(CHATS[0])[0] == 1


@pytest.mark.fast
def test_template_helpers_and_sandbox():
    import jinja2
    from tokenizers import Tokenizer as Backend
    from tokenizers import models

    template = "{% if messages|length > 1 %}{{ raise_exception('one only') }}{% endif %}\n"
    template += (
        "  {% if bos_token %}{{ bos_token }}{% endif %}{{ messages[0] | tojson }}"  # trim/lstrip_blocks
    )
    raw = Tokenizer(Backend(models.BPE()), chat_template=template, special_tokens={"bos_token": "<s>"})
    assert (
        raw.apply_chat_template([{"role": "user", "content": "é<>"}])
        == '<s>{"role": "user", "content": "é<>"}'
    )
    with pytest.raises(jinja2.exceptions.TemplateError, match="one only"):
        raw.apply_chat_template([{}, {}])
    escape = Tokenizer(Backend(models.BPE()), chat_template="{{ messages.__class__.__mro__ }}")
    with pytest.raises(jinja2.exceptions.SecurityError):
        escape.apply_chat_template([])
    with pytest.raises(ValueError, match="no chat template"):
        Tokenizer(Backend(models.BPE())).apply_chat_template([])


@pytest.mark.model
def test_from_hf_folder(tok, tmp_path):
    tok.backend.save(str(tmp_path / "tokenizer.json"))
    config = {
        "bos_token": {"content": "<|im_start|>"},
        "eos_token": "<|im_end|>",
        "chat_template": tok.chat_template,
    }
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    loaded = Tokenizer.from_hf_folder(tmp_path)
    assert loaded.bos_token_id == 1 and loaded.eos_token_ids == {0, 2}
    assert all(loaded.encode(t) == tok.encode(t) for t in TEXTS)
    assert loaded.apply_chat_template(CHATS[1]) == tok.apply_chat_template(CHATS[1])
    (tmp_path / "chat_template.jinja").write_text("{{ eos_token }}")
    assert Tokenizer.from_hf_folder(tmp_path).apply_chat_template([]) == "<|im_end|>"


@pytest.mark.fast
def test_sentencepiece_gguf(tmp_path):
    write_sentencepiece_gguf(tmp_path / "sp.gguf")
    tok = Tokenizer.from_gguf(tmp_path / "sp.gguf")
    assert tok.encode("hello abc", add_special_tokens=True) == [1, 278, 269]
    assert tok.decode(tok.encode("abc  héllo\n😀")) == "abc  héllo\n😀"
    assert tok.encode("x<|user|>") == [259, 123, 280]
    assert tok.eos_token_ids == {2, 281}  # </s>, and <|end|> which the template writes
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}]) == "<s>[user] hi<|end|>"


# ---------------------------------------------------------------- streaming detokenization


def byte_token_ids(tok, data: bytes) -> list[int]:
    alphabet = byte_alphabet()
    return [tok.backend.token_to_id(alphabet[b]) for b in data]


def segments(tok):
    """Token id runs: random ids, special tokens, text, whole and cut multi-byte characters byte by byte."""
    wide = st.characters(min_codepoint=0x80, max_codepoint=0x10FFFF, exclude_categories=("Cs",))
    chars = st.one_of(wide, st.sampled_from("é日本😀👍🏽€"))
    return st.one_of(
        st.lists(st.integers(0, tok.vocab_size - 1), min_size=1, max_size=3),
        st.lists(st.integers(0, 16), min_size=1, max_size=2),
        st.text(max_size=12).map(tok.encode),
        chars.map(lambda c: byte_token_ids(tok, c.encode())),
        chars.map(lambda c: byte_token_ids(tok, c.encode()[:-1])),
    ).filter(lambda ids: None not in ids)  # a few bytes (e.g. 0xF4) have no token of their own


def stream(tok, ids, chunks, skip):
    detok, deltas, at = IncrementalDetokenizer(tok, skip_special_tokens=skip), [], 0
    for size in [*chunks, len(ids)]:
        deltas.append(detok.add(ids[at : at + size]))
        at += size
    return deltas, detok.finish()


def check_stream(tok, ids, chunks, skip):
    full = tok.decode(ids, skip_special_tokens=skip)
    deltas, tail = stream(tok, ids, chunks, skip)
    assert "".join(deltas) + tail == full
    emitted = ""
    for delta in deltas:
        emitted += delta
        assert full.startswith(emitted)
        assert "\ufffd" not in delta or "\ufffd" in full


@pytest.mark.model
@HYP
@given(data=st.data(), skip=st.booleans())
def test_incremental_detokenizer_random(tok, data, skip):
    runs = data.draw(st.lists(segments(tok), max_size=12))
    ids = [i for run in runs for i in run]
    chunks = data.draw(st.lists(st.integers(1, 4), max_size=len(ids)))
    check_stream(tok, ids, chunks, skip)


@pytest.mark.model
@HYP
@given(text=st.text(alphabet=st.sampled_from("ab 1\n日本😀👍🏽é€"), max_size=30))
def test_incremental_detokenizer_valid_text_one_token_at_a_time(tok, text):
    ids = [i for c in text for i in byte_token_ids(tok, c.encode())] + tok.encode(text)
    deltas, tail = stream(tok, ids, [1] * len(ids), True)
    assert "".join(deltas) == text + text and tail == ""
    assert all("\ufffd" not in d for d in deltas)


@pytest.mark.model
def test_emoji_split_across_tokens_is_held_back(tok):
    detok = IncrementalDetokenizer(tok)
    ids = byte_token_ids(tok, "😀".encode())
    assert [detok.add(i) for i in ids] == ["", "", "", "😀"]
    assert detok.add(byte_token_ids(tok, b"\xe6\x97")) == ""
    assert detok.finish() == "\ufffd"


@pytest.fixture(scope="module")
def sp_tok(tmp_path_factory):
    path = tmp_path_factory.mktemp("sp") / "sp.gguf"
    write_sentencepiece_gguf(path)
    return Tokenizer.from_gguf_metadata(read_gguf_metadata(gguf.GGUFReader(path)))


@pytest.mark.fast
@HYP
@given(data=st.data())
def test_incremental_detokenizer_sentencepiece(sp_tok, data):
    """Byte fallback: a run of `<0xNN>` tokens decodes to U+FFFDs as a whole if any byte is invalid."""
    ids = data.draw(st.lists(st.integers(0, sp_tok.vocab_size - 1), max_size=20))
    ids += sp_tok.encode(data.draw(st.text(alphabet=st.sampled_from("abc hello 日😀\n"), max_size=10)))
    chunks = data.draw(st.lists(st.integers(1, 3), max_size=len(ids)))
    check_stream(sp_tok, ids, chunks, data.draw(st.booleans()))


# ---------------------------------------------------------------- stop strings


def first_stop(text, stops):
    """Oracle: the stop string occurrence that ends first (ties: longest)."""
    hits = [(text.find(s) + len(s), text.find(s)) for s in stops if s and s in text]
    return min(hits)[1] if hits else None


@pytest.mark.fast
@HYP
@given(
    text=st.text(alphabet="abcX 😀", max_size=40),
    stops=st.lists(st.text(alphabet="abcX 😀", min_size=1, max_size=4), max_size=3),
    data=st.data(),
)
def test_stop_strings_random(text, stops, data):
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=8)))
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
    index = first_stop(text, stops)
    expected = text if index is None else text[:index]
    matcher, emitted = StopStringMatcher(stops), ""
    for piece in pieces:
        emitted += matcher.feed(piece)
        assert expected.startswith(emitted)  # never a character of a stop string, never out of order
    emitted += matcher.flush()
    assert emitted == expected
    assert matcher.stopped == (index is not None)


@pytest.mark.fast
def test_stop_string_earliest_end_wins_and_after_stop_nothing():
    matcher = StopStringMatcher(["bcd", "c", ""])
    assert matcher.feed("abcd") == "ab" and matcher.matched == "c"
    assert matcher.feed("more") == "" and matcher.flush() == ""
    matcher = StopStringMatcher(["END"])
    assert [matcher.feed(p) for p in ["xE", "N", "Dy"]] == ["x", "", ""]
    matcher = StopStringMatcher(["END"])
    assert [matcher.feed(p) for p in ["xE", "N", "o"]] == ["x", "", "ENo"]


def reference_stop(text, stops):
    """Reference: feed `text` one character at a time; at the first position where some stop string ends,
    the longest one ending there wins. Returns (index where it starts, the stop) or (None, None)."""
    stops = [s for s in stops if s]
    for end in range(1, len(text) + 1):
        ending = [s for s in stops if text[:end].endswith(s)]
        if ending:
            stop = max(ending, key=len)
            return end - len(stop), stop
    return None, None


def reference_emitted(text, stops):
    """What a matcher may have emitted after being fed `text`: up to the first stop, or all of `text` but its
    longest tail that is a proper prefix of a stop string."""
    index, _ = reference_stop(text, stops)
    if index is not None:
        return text[:index]
    tails = [n for s in stops for n in range(1, len(s)) if n <= len(text) and text.endswith(s[:n])]
    return text[: len(text) - max(tails, default=0)]


@pytest.mark.fast
@settings(derandomize=True, max_examples=300, deadline=None)
@given(
    text=st.text(alphabet="ab\n", max_size=30),
    stops=st.lists(st.text(alphabet="ab\n", max_size=5), max_size=6),
    data=st.data(),
)
def test_stop_strings_match_char_by_char_reference(text, stops, data):
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=10)))  # repeated cuts: empty deltas
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
    index, stop = reference_stop(text, stops)
    matcher, emitted, fed = StopStringMatcher(stops), "", ""
    assert matcher.stop_strings == tuple(s for s in stops if s)
    for piece in pieces:
        fed += piece
        emitted += matcher.feed(piece)
        assert emitted == reference_emitted(fed, stops)  # as much as is safe, never part of a possible stop
        assert matcher.stopped == (reference_stop(fed, stops)[0] is not None)
    emitted += matcher.flush()
    assert emitted == (text if index is None else text[:index])
    assert matcher.stopped == (index is not None) and matcher.matched == stop
    if matcher.stopped:
        assert matcher.feed("ab") == "" and matcher.flush() == ""


def count_lines(fn, *args):
    """Python lines executed by fn(*args): a measure of work that does not depend on the machine's speed."""
    lines = 0

    def tracer(frame, event, arg):
        nonlocal lines
        lines += event == "line"
        return tracer

    previous = sys.gettrace()
    sys.settrace(tracer)
    try:
        result = fn(*args)
    finally:
        sys.settrace(previous)
    return result, lines


@pytest.mark.fast
def test_many_stop_strings_cost_does_not_grow_with_their_number():
    few = ["STOP!!", "END", "<|im_end|>"]
    filler = [f"{i:06d}" for i in range(100_000)]  # digits never occur in the text: never match, never held
    pieces = ["Hello <", "|im", "_x", "> world E", "N", "o, S", "TOP", "!! and after"]
    text = "".join(pieces)
    results = []
    for stops in (few, filler + few):
        matcher = StopStringMatcher(stops)
        assert len(matcher.stop_strings) == len(stops)
        outputs, work = [], []
        for piece in pieces:
            output, lines = count_lines(matcher.feed, piece)
            outputs.append(output)
            work.append(lines)
        results.append((outputs, work, matcher.matched))
        assert "".join(outputs) == text[: reference_stop(text, stops)[0]] == "Hello <|im_x> world ENo, "
        assert matcher.stopped and matcher.matched == "STOP!!"
    assert results[0] == results[1]  # same outputs and exactly as many lines run with 100,003 stops as with 3


@pytest.mark.model
def test_stop_string_spanning_tokens(tok):
    text = "The answer is 42 😀.\n\nUser: more text"
    stop = "😀.\n\nUser:"
    ids = byte_token_ids(tok, "The answer is 42 😀".encode()) + tok.encode(".\n\nUser: more text")
    detok, matcher, emitted = IncrementalDetokenizer(tok), StopStringMatcher([stop]), ""
    for i in ids:
        emitted += matcher.feed(detok.add(i))
        assert "The answer is 42 ".startswith(emitted)
    assert matcher.stopped and emitted == text[: text.index(stop)]


# ---------------------------------------------------------------- against transformers (reference)


def without_smollm_divergence(text):
    """transformers' GGUF loader ignores `pre = smollm` and applies only the GPT-2 regex, where llama.cpp and
    SmolLM2's own tokenizer.json first split off every numeric character (`\\p{N}`). With this vocabulary
    (no merges between ASCII digits) that only shows on 2+ whitespace characters before an ASCII digit and
    on non-ASCII numerics such as "¼" or "²"."""
    non_ascii_numeric = any(not c.isascii() and unicodedata.category(c)[0] == "N" for c in text)
    return not non_ascii_numeric and re.search(r"\s\s[0-9]", text) is None


@pytest.fixture(scope="module")
def hf_smollm(hf):
    """transformers' GGUF tokenizer with the smollm pre-tokenizer that llama.cpp and SmolLM2 itself use."""
    from tokenizers import Tokenizer as Backend
    from tokenizers import pre_tokenizers

    backend = Backend.from_str(hf.backend_tokenizer.to_str())
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    return backend


@pytest.mark.model
@pytest.mark.reference
@pytest.mark.parametrize("text", TEXTS)
def test_encode_decode_match_hf(tok, hf, hf_smollm, text):
    ids = tok.encode(text)
    assert ids == hf_smollm.encode(text, add_special_tokens=False).ids
    if without_smollm_divergence(text):
        assert ids == hf.encode(text, add_special_tokens=False)
        assert tok.encode(text, add_special_tokens=True) == hf(text)["input_ids"]
    for skip in (False, True):
        assert tok.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip)


@pytest.mark.model
@pytest.mark.reference
@HYP
@given(
    text=st.text(max_size=40)
    | st.lists(
        st.sampled_from([" ", "\t", "\n", "1", "a", ".", "😀", "日", "¼", "²", "<|im_end|>"]), max_size=20
    ).map("".join)
)
def test_encode_matches_hf_random(tok, hf, hf_smollm, text):
    ids = tok.encode(text)
    assert ids == hf_smollm.encode(text, add_special_tokens=False).ids
    if without_smollm_divergence(text):
        assert ids == hf.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == hf.decode(ids)


@pytest.mark.model
@pytest.mark.reference
def test_vocab_and_special_tokens_match_hf(tok, hf):
    assert tok.vocab_size == len(hf)
    assert tok.bos_token_id == hf.bos_token_id and hf.eos_token_id in tok.eos_token_ids
    assert tok.backend.get_vocab() == hf.get_vocab()
    assert set(tok.backend.get_added_tokens_decoder()) == set(hf.added_tokens_decoder)


@pytest.mark.model
@pytest.mark.reference
@pytest.mark.parametrize("messages", CHATS)
@pytest.mark.parametrize("generation_prompt", [True, False])
def test_chat_template_matches_hf(tok, hf, messages, generation_prompt):
    expected = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
    assert tok.apply_chat_template(messages, add_generation_prompt=generation_prompt) == expected
    ids = hf.apply_chat_template(messages, tokenize=True, add_generation_prompt=generation_prompt)[
        "input_ids"
    ]
    assert tok.encode_chat(messages, add_generation_prompt=generation_prompt) == ids


@pytest.mark.model
@pytest.mark.reference
@pytest.mark.parametrize("pre", ["llama-bpe", "qwen2", "gpt2", "default", "smollm"])
def test_pre_tokenizer_types_match_hf_conversion(metadata, pre):
    """The same vocabulary with another `pre`, against transformers' own GGUF conversion."""
    mapping = pytest.importorskip("transformers.integrations.gguf.gguf_tokenizer_mapping")
    fields = {**metadata, "tokenizer.ggml.pre": pre}
    names = mapping.GGUF_TOKENIZER_MAPPING["tokenizer"]
    tokenizer_dict = {
        name: fields[f"tokenizer.{key}"] for key, name in names.items() if f"tokenizer.{key}" in fields
    }
    reference, _ = mapping.convert_gguf_tokenizer("llama", tokenizer_dict)
    ours = Tokenizer.from_gguf_metadata(fields)
    for text in TEXTS:
        if pre != "smollm" or without_smollm_divergence(text):
            assert ours.encode(text) == reference.encode(text, add_special_tokens=False).ids, text


@pytest.mark.model
@pytest.mark.reference
def test_sentencepiece_gguf_matches_hf(tmp_path):
    transformers = pytest.importorskip("transformers", reason="needs the reference extra (transformers)")
    write_sentencepiece_gguf(tmp_path / "sp.gguf")
    hf = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file="sp.gguf")
    ours = Tokenizer.from_gguf(tmp_path / "sp.gguf")
    for text in ["hello abc", " abc  ab", "héllo\nabc", "x<|user|>abc<|end|>", "😀 cab", "", "  "]:
        assert ours.encode(text, add_special_tokens=True) == hf.encode(text), text
        ids = ours.encode(text, add_special_tokens=True)
        for skip in (False, True):
            assert ours.decode(ids, skip) == hf.decode(ids, skip_special_tokens=skip), text


@pytest.mark.model
@pytest.mark.reference
def test_from_hf_folder_matches_hf(hf, tmp_path):
    hf.save_pretrained(tmp_path)
    ours = Tokenizer.from_hf_folder(tmp_path)
    assert ours.bos_token_id == hf.bos_token_id and hf.eos_token_id in ours.eos_token_ids
    for text in TEXTS:
        assert ours.encode(text) == hf.encode(text, add_special_tokens=False)
        assert ours.encode(text, add_special_tokens=True) == hf.encode(text)
    assert ours.apply_chat_template(CHATS[1]) == hf.apply_chat_template(
        CHATS[1], tokenize=False, add_generation_prompt=True
    )
