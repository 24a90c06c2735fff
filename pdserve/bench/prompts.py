"""The prompts the benchmarks share: random token-id prompts that share no prefix, the speculative
benchmarks' chat workloads (text a draft can or cannot look up), and the instruction templates and topics
of the EAGLE-3 benchmarks."""

from __future__ import annotations

import numpy as np


def random_prompt(length: int, salt: int) -> list[int]:
    """Random tokens; prompts of different lengths or salts share no prefix (nothing cached is reused)."""
    return np.random.default_rng((length, salt)).integers(100, 40000, length).tolist()


def random_tokens(n: int, rng: np.random.Generator) -> list[int]:
    """`n` random ordinary token ids drawn from `rng`."""
    return rng.integers(100, 40000, n).tolist()


PARAGRAPH = (
    "The lighthouse keeper climbed the spiral stairs every evening at dusk. He trimmed the wick, polished "
    "the great lens and wound the clockwork that turned the light. Ships passing in the night never saw "
    "him, but they steered by the beam he kept burning until dawn."
)
CODE = """def mean_price(items):
    total = 0
    count = 0
    for item in items:
        if item.price is None:
            continue
        total += item.price
        count += 1
    if count == 0:
        return 0.0
    return total / count
"""
TABLE = "name age city\nAlice 30 Paris\nBob 25 Lyon\nCarol 41 Nice\nDave 35 Lille\nEve 28 Nantes\n"
WORKLOADS = {
    "quote": f"Repeat the following paragraph word for word.\n\n{PARAGRAPH}",
    "code": f"Rename the variable `total` to `acc` in this function and print the whole function.\n\n{CODE}",
    "json": f"Convert this table to a JSON list of objects with the keys name, age and city.\n\n{TABLE}",
    "story": "Write a short story about a dragon who learns to sing.",
}


def chat_prompts(tokenizer, text: str, batch: int) -> list[list[int]]:
    """`batch` variants of the workload's prompt (a request number first: the same decode work)."""
    return [
        tokenizer.encode_chat([{"role": "user", "content": f"Request {i + 1}. {text}"}]) for i in range(batch)
    ]


# EAGLE-3: instructions (task x topic) to distill a head on and to measure it with
TASKS = [
    "Explain {t} to a ten-year-old.",
    "Write three facts about {t}.",
    "Write a short poem about {t}.",
    "List five questions someone might ask about {t}, one per line.",
    "Summarize what you know about {t} in two sentences.",
    "Write a JSON object describing {t} with the keys name, kind and summary.",
    "Write a Python function that returns a list of words related to {t}.",
    "Repeat this sentence twice: I would like to learn more about {t}.",
]
TOPICS = [
    "the moon", "volcanoes", "honeybees", "the printing press", "rainbows", "chess", "bicycles", "glaciers",
    "the piano", "octopuses", "bread baking", "the internet", "deserts", "lighthouses", "tea", "comets",
]  # fmt: skip
