"""What a load run sends: prompt and output length distributions (`fixed:N`, `uniform:A:B`), JSONL
datasets, and the endless, seeded stream of `RequestSpec`s made from them (or of `Chat`s: conversations of
several turns)."""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np

# Prompt token ids are drawn from this range: ordinary vocabulary ids of the Llama-family models, clear of
# special tokens at the bottom (ids 0-99) and inside every supported model's vocabulary.
PROMPT_ID_RANGE = (100, 30000)


@dataclasses.dataclass(frozen=True)
class LengthDist:
    """`fixed:N` or `uniform:A:B` (inclusive)."""

    low: int
    high: int

    @classmethod
    def parse(cls, spec: str) -> LengthDist:
        parts = spec.split(":")
        try:
            if parts[0] == "fixed" and len(parts) == 2:
                low = high = int(parts[1])
            elif parts[0] == "uniform" and len(parts) == 3:
                low, high = int(parts[1]), int(parts[2])
            else:
                raise ValueError
        except ValueError:
            raise ValueError(f"bad length distribution {spec!r}: want fixed:N or uniform:A:B") from None
        if low < 1 or high < low:
            raise ValueError(f"bad length distribution {spec!r}: want 1 <= A <= B")
        return cls(low, high)

    def sample(self, rng: np.random.Generator) -> int:
        return int(rng.integers(self.low, self.high + 1))

    @property
    def spec(self) -> str:
        """The flag's value that parses to this distribution."""
        return f"fixed:{self.low}" if self.low == self.high else f"uniform:{self.low}:{self.high}"


@dataclasses.dataclass(frozen=True)
class SharedPrefix:
    """`TOKENS:COUNT`: every prompt starts with one of COUNT prefixes of TOKENS random ids (drawn in turn),
    its `prompt_len` tokens after it: a system prompt or a few-shot preamble the prefix cache can share."""

    tokens: int
    count: int = 1

    @classmethod
    def parse(cls, spec: str) -> SharedPrefix | None:
        if not spec:
            return None
        try:
            tokens, count = (int(x) for x in spec.split(":"))
        except ValueError:
            raise ValueError(f"bad shared prefix {spec!r}: want TOKENS:COUNT") from None
        if tokens < 1 or count < 1:
            raise ValueError(f"bad shared prefix {spec!r}: want TOKENS >= 1 and COUNT >= 1")
        return cls(tokens, count)

    @property
    def spec(self) -> str:
        """The flag's value that parses to these prefixes."""
        return f"{self.tokens}:{self.count}"


@dataclasses.dataclass
class RequestSpec:
    """One request to send: its index in the run, its prompt, its max_tokens and its LoRA adapter."""

    index: int
    prompt: str | list[int]  # token ids (exact lengths) or text
    max_tokens: int
    lora_adapter: str = ""  # "": the base model


def load_dataset(path: str | Path) -> list[dict]:
    """JSONL, one object a line: `prompt` (text) or `prompt_ids` (token ids), optional `max_tokens`."""
    entries = []
    for number, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        entry = json.loads(line)
        if not isinstance(entry, dict) or ("prompt" not in entry and "prompt_ids" not in entry):
            raise ValueError(f"{path}:{number}: want an object with `prompt` or `prompt_ids`")
        entries.append(entry)
    if not entries:
        raise ValueError(f"{path}: no entries")
    return entries


def make_workload(
    prompt_len: LengthDist | None,
    output_len: LengthDist,
    seed: int = 0,
    dataset: Sequence[dict] | None = None,
    lora_adapters: Sequence[str] = (),
    shared_prefix: SharedPrefix | None = None,
) -> Iterator[RequestSpec]:
    """An endless, reproducible stream of requests: random token-id prompts of `prompt_len` tokens (after
    one of `shared_prefix`'s prefixes, in turn), or the dataset's entries in a seeded order (cycled);
    `max_tokens` from the entry, else from `output_len`; the LoRA adapter from the entry's `lora_adapter`,
    else `lora_adapters` in turn ("": the base model)."""
    rng = np.random.default_rng(seed)
    prefixes = [[]]
    if shared_prefix is not None:  # (their own generator: the prompts after them are those without)
        drawn = np.random.default_rng((seed, shared_prefix.tokens, shared_prefix.count))
        prefixes = [
            drawn.integers(*PROMPT_ID_RANGE, shared_prefix.tokens).tolist()
            for _ in range(shared_prefix.count)
        ]
    order: list[int] = []
    for index in itertools.count():
        if dataset:
            if not order:
                order = rng.permutation(len(dataset)).tolist()
            entry = dataset[order.pop()]
            prompt = entry["prompt_ids"] if "prompt_ids" in entry else entry["prompt"]
            max_tokens = int(entry.get("max_tokens") or output_len.sample(rng))
        else:
            length = prompt_len.sample(rng)
            prompt = prefixes[index % len(prefixes)] + rng.integers(*PROMPT_ID_RANGE, length).tolist()
            max_tokens = output_len.sample(rng)
        adapter = lora_adapters[index % len(lora_adapters)] if lora_adapters else ""
        if dataset:
            adapter = entry.get("lora_adapter", adapter)
        yield RequestSpec(index, prompt, max_tokens, adapter)


@dataclasses.dataclass
class Chat:
    """A conversation to send, a turn at a time: turn 1's request as it is; each later turn's prompt is the
    conversation so far (the prompts and answers before) followed by that turn's own tokens, its `prompt`
    here. A turn is sent once the answer before it has ended, `think_s` later."""

    index: int
    turns: list[RequestSpec]
    think_s: float = 0.0


def make_chats(
    prompt_len: LengthDist,
    output_len: LengthDist,
    turns: int,
    think_s: float = 0.0,
    seed: int = 0,
    shared_prefix: SharedPrefix | None = None,
) -> Iterator[Chat]:
    """An endless, reproducible stream of conversations of `turns` turns: turn 1 as make_workload's
    request (after a shared prefix, if given), each later turn `prompt_len` new tokens of its own (from a
    stream of their own, so turn 1 of every conversation is make_workload's request of the same index)."""
    if turns < 1:
        raise ValueError(f"a conversation has at least 1 turn, got {turns}")
    firsts = make_workload(prompt_len, output_len, seed, shared_prefix=shared_prefix)
    laters = make_workload(prompt_len, output_len, seed + 7_000_003)
    for first in firsts:
        follow = [next(laters) for _ in range(turns - 1)]
        yield Chat(first.index, [first, *follow], think_s)


def arrival_times(rate: float, seed: int = 0, burstiness: float = 1.0) -> Iterator[float]:
    """Arrivals at `rate` requests/s on average, seconds since the start: the first at 0 (the load
    generator's open loop sends at these times; the simulator replays the same ones for the same seed).
    The gaps between them are gamma-distributed with shape `burstiness` (as vLLM's `bench serve`): 1 is a
    Poisson process, below 1 burstier (arrivals in clumps with long quiet gaps: a coefficient of variation
    of 1 / sqrt(burstiness)), above 1 more even."""
    if not burstiness > 0:
        raise ValueError(f"burstiness must be > 0, got {burstiness}")
    rng = np.random.default_rng(seed + 1_000_003)
    at = 0.0
    while True:
        yield at
        if burstiness == 1.0:
            at += rng.exponential(1.0 / rate)
        else:
            at += rng.gamma(burstiness, 1.0 / (rate * burstiness))


def add_burstiness_flag(parser: argparse.ArgumentParser) -> None:
    """--burstiness: the arrivals' gamma shape (workload.arrival_times), for the load generator and the
    planner's simulations alike."""
    parser.add_argument(
        "--burstiness",
        type=float,
        default=1.0,
        help="with --rate: the gaps between arrivals are gamma-distributed with this shape: 1 is Poisson, "
        "below 1 burstier (clumps and quiet gaps), above 1 more even",
    )


def add_shared_prefix_flag(parser: argparse.ArgumentParser) -> None:
    """--shared-prefix TOKENS:COUNT as a SharedPrefix (None when not given), for the planner's simulations
    of what `pdserve bench serve --shared-prefix` sends."""
    parser.add_argument(
        "--shared-prefix",
        type=SharedPrefix.parse,
        default=None,
        metavar="TOKENS:COUNT",
        help="each prompt after one of COUNT shared prefixes of TOKENS tokens (as `pdserve bench serve`)",
    )


def add_chat_flags(parser: argparse.ArgumentParser) -> None:
    """--turns and --think-time: conversations (make_chats), for the load generator and the simulator."""
    parser.add_argument(
        "--turns",
        type=int,
        default=1,
        help="each request a conversation of this many turns (with --rate: conversations/s): each turn's "
        "prompt is the conversation so far and --prompt-len new tokens",
    )
    parser.add_argument(
        "--think-time", type=float, default=0.0, help="seconds from an answer's end to the next turn"
    )
