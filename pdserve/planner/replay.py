"""A workload from a decode server's log: each `request ended` line (services.decode.core) carries its
arrival (unix seconds), its prompt's length, its n and the tokens it generated, so yesterday's traffic can
be replayed against another configuration (`pdserve simulate --replay LOG`). Both log formats are read
(`--log-format json`: one object a line; text: the fields as key=value after the message).

What a log line cannot give back: the prompts' tokens (each is drawn at random at its length, so prefixes
that were shared are not: the line's cached_prompt_tokens says how much was), and what each request was
asked for beyond what it did (a request that stopped at EOS is replayed as generating exactly that many
tokens). Requests that produced no token (refused, failed) are left out.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np

from pdserve.planner.simulator import Arrival

ENDED = "request ended"
_FIELD = re.compile(r"(\w+)=(\S+)")
FIELDS = ("arrival", "prompt_tokens", "output_tokens", "n")


def ended_requests(path: str | Path, fields: tuple[str, ...] = FIELDS) -> list[dict]:
    """The `request ended` lines of a log that have `fields`, as dicts of those numbers, in the log's
    order."""
    out = []
    with open(path, errors="replace") as f:
        for line in f:
            if ENDED not in line:
                continue
            line = line.strip()
            if line.startswith("{"):
                try:
                    entry = json.loads(line)
                except json.JSONDecodeError:
                    continue
                if entry.get("message") != ENDED:
                    continue
            else:
                entry = dict(_FIELD.findall(line.split(ENDED, 1)[1]))
            try:
                out.append({k: float(entry[k]) for k in fields})
            except (KeyError, TypeError, ValueError):
                continue  # (a line of an older pdserve, without the arrival)
    return out


def replay_workload(path: str | Path, seed: int = 0, vocab: int = 20000) -> list[Arrival]:
    """The log's requests as arrivals from the first one's (prompts of random ids, seeded)."""
    requests = [r for r in ended_requests(path) if r["output_tokens"] > 0]
    if not requests:
        raise ValueError(f"{path}: no `{ENDED}` line with {', '.join(FIELDS)} (a decode server's log?)")
    requests.sort(key=lambda r: r["arrival"])
    first, rng = requests[0]["arrival"], np.random.default_rng(seed)
    return [
        Arrival(
            at_s=r["arrival"] - first,
            prompt_ids=tuple(int(t) for t in rng.integers(100, vocab, int(r["prompt_tokens"]))),
            max_tokens=max(1, int(r["output_tokens"] // max(r["n"], 1))),
            n=max(1, int(r["n"])),
        )
        for r in requests
    ]
