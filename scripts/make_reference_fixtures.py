"""Writes tests/fixtures/reference_smollm2.npz with HF transformers (the `reference` extra) as the oracle.

For each prompt: its token ids, the float32 logits at its last position, and 32 greedy tokens (EOS
ignored), all computed by transformers on the same GGUF file pdserve loads. Run:
    .venv/bin/python scripts/make_reference_fixtures.py [--gguf PATH]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

OUT = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "reference_smollm2.npz"
GREEDY_STEPS = 32


def reference_prompts(tokenizer) -> list[list[int]]:
    """The fixture prompts (token ids); one of them is 600+ tokens long."""
    long_text = " ".join(
        f"Note {i}: the river town of Arles kept {i * 7 % 31} boats, {i * 3 % 17} bridges and one old mill."
        for i in range(26)
    )
    prompts = [
        tokenizer.encode_chat([{"role": "user", "content": "What is the capital of France?"}]),
        tokenizer.encode("Once upon a time"),
        tokenizer.encode("def fibonacci(n):\n    "),
        tokenizer.encode_chat([{"role": "user", "content": long_text + "\nHow many notes are there?"}]),
        tokenizer.encode("7"),
    ]
    assert max(len(p) for p in prompts) >= 600, [len(p) for p in prompts]
    return prompts


def hf_reference(gguf: Path, prompts: list[list[int]]) -> list[tuple[np.ndarray, list[int]]]:
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    model.eval()
    results = []
    with torch.no_grad():
        for ids in prompts:
            out = model(torch.tensor([ids]), use_cache=True)
            logits = out.logits[0, -1].float().numpy().copy()
            past, token, greedy = out.past_key_values, int(out.logits[0, -1].argmax()), []
            for _ in range(GREEDY_STEPS):
                greedy.append(token)
                out = model(torch.tensor([[token]]), past_key_values=past, use_cache=True)
                past, token = out.past_key_values, int(out.logits[0, -1].argmax())
            results.append((logits, greedy))
    return results


def main() -> None:
    from pdserve.engine.loading.sources import DEFAULT_MODEL, fetch
    from pdserve.engine.tokenizer import Tokenizer

    parser = argparse.ArgumentParser()
    parser.add_argument("--gguf", type=Path, default=None)
    args = parser.parse_args()
    gguf = args.gguf or fetch(DEFAULT_MODEL)
    prompts = reference_prompts(Tokenizer.from_gguf(gguf))
    arrays = {}
    for i, (ids, (logits, greedy)) in enumerate(zip(prompts, hf_reference(gguf, prompts), strict=True)):
        arrays[f"prompt_{i}"] = np.asarray(ids, np.int32)
        arrays[f"logits_{i}"] = logits.astype(np.float32)
        arrays[f"greedy_{i}"] = np.asarray(greedy, np.int32)
    OUT.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(OUT, **arrays)
    print(f"wrote {OUT} ({len(prompts)} prompts, lengths {[len(p) for p in prompts]})")


if __name__ == "__main__":
    main()
