"""Speculative decoding's configuration: --speculative-config's JSON (vLLM's keys) parsed and checked
into a SpeculativeConfig (engine.core.speculation plans the drafts, engine.draft_runner proposes them)."""

from __future__ import annotations

import dataclasses
import functools
import json

# SpeculativeConfig.method: "ngram" prompt lookup (engine.core.speculation), "eagle3" a draft head
# (engine.model.eagle3) read from `model`
SPECULATIVE_METHODS = ("ngram", "eagle3")
# SpeculativeConfig.draft_policy: "cost" verifies the drafts worth their step's measured cost
# (engine.core.speculation.plan_drafts), "all" every draft the token budget and the blocks allow
DRAFT_POLICIES = ("cost", "all")
MAX_SPECULATIVE_TOKENS = 16  # num_speculative_tokens at most (each costs a query token of every step)


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (engine.core.speculation), from --speculative-config's JSON with vLLM's keys:
    `method` ("ngram": prompt lookup, no weights; "eagle3": an EAGLE-3 draft head), `num_speculative_tokens`
    (k, drafts a step verifies per sequence), `prompt_lookup_min` / `prompt_lookup_max` (ngram's sizes; one
    given sets both, neither: 5 and 5, as vLLM's), `model` (eagle3's head: a folder of config.json and
    safetensors, engine.loading.eagle3). `k == 0`: speculation off. pdserve's own key `draft_policy`
    (DRAFT_POLICIES): "cost" (default) verifies the drafts worth their step's measured cost, "all" every
    draft."""

    method: str = ""
    num_speculative_tokens: int = 0
    prompt_lookup_min: int = 0
    prompt_lookup_max: int = 0
    draft_policy: str = "cost"  # pdserve's: DRAFT_POLICIES
    model: str = ""  # eagle3: the head's folder

    @classmethod
    @functools.lru_cache(maxsize=16)  # (EngineConfig.speculation is read every step: parsed once)
    def parse(cls, text: str) -> SpeculativeConfig:
        """The config of a JSON object (empty text: off); ValueError naming the bad key."""
        if not text.strip():
            return cls()
        try:
            given = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"speculative_config: not JSON ({e})") from None
        if not isinstance(given, dict):
            raise ValueError("speculative_config: a JSON object with vLLM's keys")
        method = given.get("method")
        if method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative_config: method {method!r}: one of {SPECULATIVE_METHODS}")
        unknown = sorted(set(given) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise ValueError(f"speculative_config: unknown key {unknown[0]!r}")
        sizes = {}
        for key in ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max"):
            value = given.get(key)
            if value is not None and (type(value) is not int or value < 1):
                raise ValueError(f"speculative_config: {key} must be a positive integer")
            sizes[key] = value
        k = sizes["num_speculative_tokens"]
        if k is None or k > MAX_SPECULATIVE_TOKENS:
            raise ValueError(
                f"speculative_config: num_speculative_tokens must be in [1, {MAX_SPECULATIVE_TOKENS}]"
            )
        low, high = sizes["prompt_lookup_min"], sizes["prompt_lookup_max"]
        model = given.get("model") or ""
        if method == "eagle3":
            if low or high:
                raise ValueError("speculative_config: prompt_lookup_min/max apply to method 'ngram' only")
            if not isinstance(model, str) or not model:
                raise ValueError(
                    "speculative_config: model (the EAGLE-3 head's folder) is required by eagle3"
                )
        elif model:
            raise ValueError("speculative_config: model applies to method 'eagle3' only")
        else:
            low, high = low or high or 5, high or low or 5
        if low and high and low > high:
            raise ValueError("speculative_config: prompt_lookup_min must be <= prompt_lookup_max")
        policy = given.get("draft_policy", "cost")
        if policy not in DRAFT_POLICIES:
            raise ValueError(f"speculative_config: draft_policy {policy!r}: one of {DRAFT_POLICIES}")
        return cls(method, k, low or 0, high or 0, policy, model)
