"""Frozen configuration dataclasses: one for the model's architecture, one for the engine around it."""

from __future__ import annotations

import dataclasses
import functools
import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

SUPPORTED_ARCHITECTURES = (
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    "gemma2",
    "gemma3",
    "qwen3_moe",
    "mixtral",
    "deepseek_v2",
)
_HF_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "MixtralForCausalLM": "mixtral",
    "DeepseekV2ForCausalLM": "deepseek_v2",
}
_MODEL_TYPES = {"gemma3_text": "gemma3"}  # config.json model_type -> architecture, where they differ
# config.json activation names -> the gated MLP's activation (engine.model.forward)
_HF_ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh"}
ACTIVATIONS = tuple(sorted(set(_HF_ACTIVATIONS.values())))
_QK_NORM = ("qwen3", "gemma3", "qwen3_moe")  # RMSNorm of each query and key head before rope
GEMMA = ("gemma2", "gemma3")  # scaled embeddings, GeGLU, norms around attention and MLP, norm weights 1 + w
_MOE = ("qwen3_moe", "mixtral")  # every layer's MLP is a mixture of experts
# config.json's default layer pattern where it has no `layer_types`: every n-th layer is a full one
GEMMA_FULL_EVERY = {"gemma2": 2, "gemma3": 6}


class UnsupportedModelError(ValueError):
    """The checkpoint describes an architecture or feature pdserve does not implement."""


class SizingError(ValueError):
    """The asked sizes do not fit the model (a longer max_model_len than its context) or the devices'
    memory (engine.memory)."""


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Architecture of a decoder pdserve serves: Llama 2/3, SmolLM2, Mistral, Qwen2/2.5, Qwen3, Gemma 2/3,
    Qwen3-MoE, Mixtral, DeepSeek-V2 (docs/model-families.md)."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool = False
    qk_norm: bool = False  # Qwen3: RMSNorm over each query and key head (weights [head_dim]) before rope
    # Llama 3.x long-context rope scaling: (factor, low_freq_factor, high_freq_factor, original_max_pos).
    rope_llama3_scaling: tuple[float, float, float, int] | None = None
    rope_linear_factor: float = 1.0  # positions divided by this in full-attention layers ("linear" scaling)
    # YaRN (full-attention layers): (factor, original_max_position_embeddings, beta_fast, beta_slow, truncate)
    rope_yarn: tuple[float, int, float, float, bool] | None = None
    rope_attention_factor: float = 1.0  # cos and sin times this (YaRN's attention factor)
    attention_scale_factor: float = 1.0  # the softmax scale times this (DeepSeek's YaRN mscale squared)
    # Sliding-window attention: per layer, the tokens a query sees (itself included); 0: full attention.
    # Empty: every layer is full. Sliding layers may have their own rope base (Gemma 3's local layers).
    layer_windows: tuple[int, ...] = ()
    sliding_rope_theta: float | None = None  # None: sliding layers rotate like full ones
    hidden_act: str = "silu"  # of the gated MLP: "silu" (SwiGLU) or "gelu_tanh" (GeGLU, Gemma)
    query_pre_attn_scalar: float | None = None  # attention scale is this ** -0.5 (Gemma); None: head_dim
    attn_logit_softcap: float | None = None  # scores -> cap * tanh(scores / cap) (Gemma 2)
    final_logit_softcap: float | None = None  # the same on the logits
    scale_embeddings: bool = False  # embeddings times sqrt(hidden_size) (Gemma)
    sandwich_norms: bool = False  # RMSNorm on the attention's and the MLP's outputs too (Gemma 2/3)
    # Mixture of experts (every layer's MLP; intermediate_size is then each expert's): 0 experts: dense.
    num_experts: int = 0
    num_experts_per_tok: int = 0  # experts each token is routed to (top k of the router's softmax)
    norm_topk_prob: bool = False  # the k routing weights renormalized to sum to 1 (Mixtral: always)
    routed_scaling_factor: float = 1.0  # the routing weights times this (DeepSeek)
    router_groups: tuple[int, int] | None = None  # (groups, groups kept): DeepSeek's group-limited top k
    first_dense_layers: int = 0  # layers before the expert ones that have a dense MLP (DeepSeek)
    shared_experts: bool = False  # a dense MLP every token takes besides its routed experts (DeepSeek)
    # Multi-head latent attention (DeepSeek-V2): the cache holds one latent per token, kv_lora_rank dims
    # (keys' and values' shared compression) then the qk_rope_head_dim dims of its rotated key, shared by all
    # heads; head_dim is a query's (qk_nope_head_dim + qk_rope_head_dim). 0: not MLA.
    kv_lora_rank: int = 0
    q_lora_rank: int = 0  # queries through a low-rank projection and a norm first (0: one projection)
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    name: str = "model"
    # A digest of the checkpoint's weights (engine.loading.checkpoints): part of the KV layout's model, so
    # that KV computed with other weights under the same name is never inserted. "": not known.
    weights_digest: str = ""
    # An EAGLE-3 draft layer's name (engine.model.eagle3: "eagle3@<digest>"), "": none. Its KV is one more
    # full-attention layer after the model's own (row num_layers of the cache, group 0's block table), part
    # of the KV layout: KV of another draft, or of none, never fits.
    draft_layer: str = ""

    def __post_init__(self):
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedModelError(
                f"architecture {self.architecture!r} is not supported (supported: {SUPPORTED_ARCHITECTURES})"
            )
        if self.num_heads % self.num_kv_heads:
            raise UnsupportedModelError(
                f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}"
            )
        if self.layer_windows and len(self.layer_windows) != self.num_layers:
            raise UnsupportedModelError(
                f"{len(self.layer_windows)} layer windows for {self.num_layers} layers"
            )
        if self.num_experts and not 0 < self.num_experts_per_tok <= self.num_experts:
            raise UnsupportedModelError(f"{self.num_experts_per_tok} experts per token of {self.num_experts}")
        if self.hidden_act not in ACTIVATIONS:
            raise UnsupportedModelError(f"hidden_act {self.hidden_act!r}: one of {sorted(ACTIVATIONS)}")

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def rope_dim(self) -> int:
        """Dims of a head that rope rotates: all of them, or MLA's decoupled rope part."""
        return self.qk_rope_head_dim if self.is_mla else self.head_dim

    @property
    def widest_window(self) -> int:
        """The largest sliding window when every layer has one (Mistral), else 0: tokens before a query's
        last widest_window are read by no layer."""
        windows = self.layer_windows
        return max(windows) if windows and all(windows) else 0

    def window(self, layer: int) -> int:
        """Tokens a query of `layer` attends to, itself included (0: all before it)."""
        return self.layer_windows[layer] if self.layer_windows else 0

    @property
    def attention_scale(self) -> float:
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5 * self.attention_scale_factor

    @property
    def dense_layers(self) -> int:
        """Layers [0, dense_layers) have a dense MLP, the rest a mixture of experts."""
        return self.first_dense_layers if self.num_experts else self.num_layers

    def layer_segments(self) -> tuple[tuple[int, int], ...]:
        """(start, end) of each run of layers with the same weights' structure, scanned one run at a time:
        DeepSeek's dense layers, then its expert layers; every other model is one run."""
        k = self.dense_layers
        return ((0, k), (k, self.num_layers)) if 0 < k < self.num_layers else ((0, self.num_layers),)

    @property
    def group_size(self) -> int:
        """Query heads that share one KV head."""
        return self.num_heads // self.num_kv_heads

    def padded_num_kv_heads(self, tp: int) -> int:
        """KV heads padded up to a multiple of the TP size (dummy heads appended at the end)."""
        return math.ceil(self.num_kv_heads / tp) * tp

    def padded_num_heads(self, tp: int) -> int:
        """Query heads padded so that every (padded) KV head keeps a full group of query heads."""
        return self.padded_num_kv_heads(tp) * self.group_size

    @classmethod
    def from_hf_config(cls, config: Mapping[str, Any] | Path, name: str = "model") -> ModelConfig:
        """Builds the config from a Hugging Face `config.json` (a dict or its path)."""
        if isinstance(config, Path):
            config = json.loads(config.read_text())
        archs = config.get("architectures") or []
        arch = next((_HF_ARCHITECTURES[a] for a in archs if a in _HF_ARCHITECTURES), None)
        model_type = _MODEL_TYPES.get(config.get("model_type"), config.get("model_type"))
        if arch is None and not archs and model_type in SUPPORTED_ARCHITECTURES:
            arch = model_type  # folders written without `architectures`
        if arch is None:
            raise UnsupportedModelError(
                f"config.json architectures {archs} not supported (supported: {sorted(_HF_ARCHITECTURES)})"
            )
        num_heads = config["num_attention_heads"]
        # transformers >= 5 writes `rope_parameters` (theta inside; Gemma 3: one per layer type); older ones
        # `rope_theta`, `rope_scaling` (and Gemma 3 `rope_local_base_freq`)
        rope_parameters = config.get("rope_parameters") or {}
        full_rope = rope_parameters.get("full_attention", rope_parameters)
        rope_theta = full_rope.get("rope_theta", config.get("rope_theta", 10000.0))
        rope = _rope_scaling(config.get("rope_scaling") or full_rope)
        sliding_rope = rope_parameters.get("sliding_attention") or {}
        sliding_theta = sliding_rope.get("rope_theta", config.get("rope_local_base_freq"))
        if _rope_scaling(sliding_rope):
            raise UnsupportedModelError(
                "config.json rope_parameters.sliding_attention: scaling is not supported"
            )
        _refuse_unsupported_features(config)
        num_experts = config.get("num_experts") or config.get("num_local_experts") or 0
        mla = arch == "deepseek_v2"
        deepseek = _deepseek_fields(config, rope) if mla else {}
        if mla:
            num_experts = deepseek.pop("num_experts")
        if arch in _MOE and not num_experts:
            raise UnsupportedModelError(f"config.json of {arch} names no num_experts")
        return cls(
            architecture=arch,
            vocab_size=config["vocab_size"],
            hidden_size=config["hidden_size"],
            intermediate_size=config.get("moe_intermediate_size") or config["intermediate_size"]
            if num_experts
            else config["intermediate_size"],
            num_layers=config["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=config.get("num_key_value_heads", num_heads),
            head_dim=config["qk_nope_head_dim"] + config["qk_rope_head_dim"]
            if mla
            else config.get("head_dim") or config["hidden_size"] // num_heads,
            rope_theta=float(rope_theta),
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=config.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            qkv_bias=arch == "qwen2" or bool(config.get("attention_bias", False)),
            qk_norm=arch in _QK_NORM,
            **rope,
            layer_windows=_layer_windows(arch, config),
            sliding_rope_theta=None if sliding_theta is None else float(sliding_theta),
            hidden_act=_HF_ACTIVATIONS[_activation(arch, config)],
            query_pre_attn_scalar=config.get("query_pre_attn_scalar") if arch in GEMMA else None,
            attn_logit_softcap=config.get("attn_logit_softcapping"),
            final_logit_softcap=config.get("final_logit_softcapping"),
            scale_embeddings=arch in GEMMA,
            sandwich_norms=arch in GEMMA,
            num_experts=num_experts,
            num_experts_per_tok=config.get("num_experts_per_tok", 0) if num_experts else 0,
            norm_topk_prob=arch == "mixtral" or bool(config.get("norm_topk_prob")),
            kv_lora_rank=config["kv_lora_rank"] if mla else 0,
            q_lora_rank=(config.get("q_lora_rank") or 0) if mla else 0,
            qk_rope_head_dim=config["qk_rope_head_dim"] if mla else 0,
            v_head_dim=config["v_head_dim"] if mla else 0,
            **deepseek,
            name=name,
        )


def _rope_scaling(params: Mapping[str, Any]) -> dict[str, Any]:
    """The ModelConfig rope fields of one rope_scaling / rope_parameters dict ({}: no scaling)."""
    kind = params.get("rope_type") or params.get("type")
    if kind == "llama3":
        keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
        return {"rope_llama3_scaling": (*(float(params[k]) for k in keys[:3]), int(params[keys[3]]))}
    if kind == "linear":
        return {"rope_linear_factor": float(params["factor"])}
    if kind == "yarn":
        if "original_max_position_embeddings" not in params:
            raise UnsupportedModelError("rope_scaling yarn without original_max_position_embeddings")
        factor = float(params["factor"])
        mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
        attention_factor = params.get("attention_factor")
        if attention_factor is None:
            ratio = mscale and mscale_all_dim
            attention_factor = (
                _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
                if ratio
                else _yarn_mscale(factor)
            )
        yarn = (
            factor,
            int(params["original_max_position_embeddings"]),
            float(params.get("beta_fast") or 32),
            float(params.get("beta_slow") or 1),
            bool(params.get("truncate", True)),
        )
        return {"rope_yarn": yarn, "rope_attention_factor": float(attention_factor)}
    if kind not in (None, "default"):
        raise UnsupportedModelError(f"rope_scaling type {kind!r} is not supported")
    return {}


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


_DEEPSEEK_ROUTERS = ("greedy", "group_limited_greedy")


def _deepseek_fields(config: Mapping[str, Any], rope: Mapping[str, Any]) -> dict[str, Any]:
    """DeepSeek-V2's mixture of experts (after first_k_dense_replace dense layers, with shared experts)
    and the softmax scale its YaRN adds."""
    fields: dict[str, Any] = {"num_experts": 0}
    rope_parameters = config.get("rope_scaling") or config.get("rope_parameters") or {}
    if rope.get("rope_yarn") and rope_parameters.get("mscale_all_dim"):
        fields["attention_scale_factor"] = (
            _yarn_mscale(rope["rope_yarn"][0], rope_parameters["mscale_all_dim"]) ** 2
        )
    dense = config.get("first_k_dense_replace", 0)
    if not config.get("n_routed_experts") or dense >= config["num_hidden_layers"]:
        return fields  # every MLP dense
    if config.get("moe_layer_freq", 1) != 1:
        raise UnsupportedModelError(
            "config.json moe_layer_freq != 1: dense layers among expert ones unsupported"
        )
    method = config.get("topk_method", "greedy")
    if method not in _DEEPSEEK_ROUTERS:
        raise UnsupportedModelError(f"config.json topk_method={method!r}: one of {_DEEPSEEK_ROUTERS}")
    groups = (config["n_group"], config["topk_group"]) if method == "group_limited_greedy" else None
    return {
        **fields,
        "num_experts": config["n_routed_experts"],
        "first_dense_layers": dense,
        "shared_experts": bool(config.get("n_shared_experts")),
        "routed_scaling_factor": float(config.get("routed_scaling_factor", 1.0)),
        "router_groups": groups,
    }


def _activation(arch: str, config: Mapping[str, Any]) -> str:
    if arch in GEMMA:  # Gemma's config names it hidden_activation (hidden_act is Gemma 1's, ignored)
        return config.get("hidden_activation") or "gelu_pytorch_tanh"
    return config.get("hidden_act", "silu")


def _layer_windows(arch: str, config: Mapping[str, Any]) -> tuple[int, ...]:
    """Per layer the sliding window (0: full attention), from `layer_types` where config.json has them."""
    n, window = config["num_hidden_layers"], config.get("sliding_window") or 0
    types = config.get("layer_types")
    if types is None and arch in GEMMA_FULL_EVERY:
        every = config.get("sliding_window_pattern", GEMMA_FULL_EVERY[arch])
        types = ["full_attention" if (i + 1) % every == 0 else "sliding_attention" for i in range(n)]
    elif types is None and arch in ("mistral", "mixtral") and window:
        types = ["sliding_attention"] * n
    elif types is None and config.get("use_sliding_window"):  # Qwen2/3 before layer_types
        first = config.get("max_window_layers", n)
        types = ["sliding_attention" if i >= first else "full_attention" for i in range(n)]
    types = types or ["full_attention"] * n
    unknown = sorted(set(types) - {"full_attention", "sliding_attention"})
    if unknown:
        raise UnsupportedModelError(f"config.json layer_types {unknown}: not supported")
    if "sliding_attention" in types and not window:
        raise UnsupportedModelError("config.json layer_types has sliding layers but no sliding_window")
    windows = tuple(window if t == "sliding_attention" else 0 for t in types)
    return windows if any(windows) else ()


def _refuse_unsupported_features(config: Mapping[str, Any]) -> None:
    """UnsupportedModelError naming the config.json field of a feature the forward pass lacks."""
    quantization = config.get("quantization_config") or config.get("compression_config")
    if quantization:
        method = quantization.get("quant_method") or quantization.get("format") or "unnamed"
        raise UnsupportedModelError(
            f"config.json quantization_config (quant_method={method!r}): quantized checkpoints are not "
            "supported; serve the unquantized (bf16) checkpoint"
        )
    act = config.get("hidden_activation") or config.get("hidden_act", "silu")
    if act not in _HF_ACTIVATIONS:
        raise UnsupportedModelError(
            f"config.json hidden_act={act!r}: one of {sorted(_HF_ACTIVATIONS)} (SwiGLU, GeGLU)"
        )
    if config.get("mlp_bias"):
        raise UnsupportedModelError("config.json mlp_bias=true: MLP biases are not supported")
    if config.get("mlp_only_layers") or config.get("decoder_sparse_step", 1) != 1:
        raise UnsupportedModelError(
            "config.json mlp_only_layers / decoder_sparse_step: dense layers among expert ones unsupported"
        )
    if config.get("shared_expert_intermediate_size"):
        raise UnsupportedModelError("config.json shared experts are not supported")
    if config.get("use_bidirectional_attention"):
        raise UnsupportedModelError("config.json use_bidirectional_attention=true: decoders only")


DTYPES = ("auto", "float32", "bfloat16")
# --kv-cache-dtype (vLLM's names) -> the cache's element type; "auto": the serving dtype. fp8 with a static
# scale of 1.0 per tensor (as tpu-inference serves it): K/V are saturated to the type's range when written.
# int8 with a scale per token and head, stored beside the values (kvtransfer.layout.SCALE_SCHEMES).
KV_CACHE_DTYPES = {
    "auto": "", "fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2", "int8": "int8"
}  # fmt: skip
QUANTIZATIONS = ("none", "int8")  # EngineConfig.quantization (engine.model.quantized)
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


def _powers_of_two(start: int, stop: int) -> tuple[int, ...]:
    """start, 2*start, ... up to and including stop (stop itself is always the last bucket)."""
    out, value = [], start
    while value < stop:
        out.append(value)
        value *= 2
    out.append(stop)
    return tuple(out)


def flag(default: Any, help: str, **argparse_options: Any) -> Any:  # noqa: A002 - argparse's word
    """A config field that is also a command-line flag (pdserve/flags.py derives it: --field-name, the
    field's type and this default, `help`); `argparse_options` adds e.g. `flag` (another name),
    `aliases`, `choices`, `metavar`."""
    return dataclasses.field(default=default, metadata={"help": help, **argparse_options})


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Sizes of the paged cache, the batches and the compiled shape buckets. Fields made with `flag` are
    the engine's command-line flags (the defaults live here only)."""

    block_size: int = 16
    num_blocks: int = flag(
        0, "KV cache blocks (of block_size tokens) in device memory (0: what --gpu-memory-utilization leaves)"
    )
    gpu_memory_utilization: float = flag(
        0.0,
        "fraction of each device's memory for the weights, the step's temporaries and the KV cache (0: "
        "0.9); on a CPU of the RAM available at start (0: the KV cache takes 0.1 of the RAM left after the "
        "weights and the step, so any model whose weights fit serves); unused with --num-blocks",
        aliases=("--memory-fraction",),
    )
    max_num_seqs: int = flag(32, "running requests decoded together")
    max_model_len: int = flag(
        0,
        "prompt + generated tokens of one request (0: the model's context, capped to what the KV cache "
        "holds)",
    )
    # The token budget of one step: every running request's decode token first, then prefill chunks up
    # to the budget. A long prompt delays running requests by at most one budget's compute per token.
    max_num_batched_tokens: int = flag(
        512,
        "token budget of one step: every running request's decode token, then prefill chunks; a smaller "
        "budget bounds how long a long prompt delays running requests, a larger one prefills faster",
        aliases=("--max-prefill-tokens",),  # its name before steps mixed decode tokens and prefill chunks
    )
    max_prefill_seqs: int = 4  # prompts being computed at once (chunks in one step)
    tp: int = flag(1, "tensor-parallel degree (devices)")
    dtype: str = flag(
        "auto", "weights and KV cache (auto: bfloat16 on TPUs and GPUs, float32 on CPUs)", choices=DTYPES
    )
    kv_cache_dtype: str = flag(
        "auto",
        "the KV cache's element type, on both roles and on the wire (auto: --dtype's; fp8 = fp8_e4m3, "
        "fp8_e5m2: a quarter of float32's bytes and half of bfloat16's, with a static scale of 1.0; int8: "
        "the same plus a bfloat16 scale per token and KV head, the most accurate of the three)",
        choices=tuple(KV_CACHE_DTYPES),
    )
    quantization: str = flag(
        "none",
        "weight-only quantization of the attention and MLP projections (int8: one scale per output channel, "
        "half of bfloat16's bytes; not for mixture-of-experts or MLA models)",
        choices=QUANTIZATIONS,
    )
    max_logprobs: int = 20
    max_loras: int = flag(
        0, "LoRA adapter slots in device memory (0: LoRA off; default 4 with --lora)", group="lora"
    )
    max_lora_rank: int = flag(16, "highest adapter rank served (lower ranks are zero-padded)", group="lora")
    max_cpu_loras: int = flag(
        32, "adapters loaded at once, in host memory (more are refused: unload one first)", group="lora"
    )
    enable_prefix_caching: bool = flag(
        True,
        "reuse the KV of cached prompt prefixes (--no-prefix-caching: compute every prompt in full)",
        flag="--prefix-caching",
    )
    kv_offloading_size: float = flag(
        0.0,
        "GiB of host memory for a KV tier under the device cache (vLLM's flag): cached blocks evicted from "
        "the device are kept there and loaded back on a prefix hit; a prefill server also stages the KV "
        "its streams send there, freeing device memory while a decode server reads (0: off)",
        metavar="GIB",
    )
    # Host slots of that tier, one block each (engine.memory.plan resolves it from kv_offloading_size)
    num_host_blocks: int = 0
    speculative_config: str = flag(
        "",
        "speculative decoding, a JSON object with vLLM's keys: method (ngram or eagle3), "
        "num_speculative_tokens, prompt_lookup_min, prompt_lookup_max (ngram), model (eagle3: the head's "
        "folder) (empty: off)",
        metavar="JSON",
    )

    def __post_init__(self):
        if self.max_model_len % self.block_size or self.max_model_len < 0:
            raise ValueError("max_model_len must be a multiple of block_size (0: the model's context)")
        if not 0 <= self.gpu_memory_utilization <= 1 or self.num_blocks < 0:
            raise ValueError("gpu_memory_utilization must be in [0, 1] and num_blocks >= 0")
        if not self.kv_offloading_size >= 0 or self.num_host_blocks < 0:
            raise ValueError("kv_offloading_size must be >= 0 GiB")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError("max_num_batched_tokens must be >= max_num_seqs (every decode fits a step)")
        if self.max_loras < 0 or self.max_lora_rank < 1 or self.max_cpu_loras < max(self.max_loras, 1):
            raise ValueError(
                "max_loras must be >= 0, max_lora_rank >= 1 and max_cpu_loras >= max(max_loras, 1)"
            )
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype {self.dtype!r}: one of {DTYPES}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype {self.kv_cache_dtype!r}: one of {tuple(KV_CACHE_DTYPES)}")
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization {self.quantization!r}: one of {QUANTIZATIONS}")
        SpeculativeConfig.parse(self.speculative_config)  # refused here, naming the key

    @property
    def speculation(self) -> SpeculativeConfig:
        """--speculative-config, parsed (num_speculative_tokens 0: off)."""
        return SpeculativeConfig.parse(self.speculative_config)

    def on_platform(self, platform: str) -> EngineConfig:
        """This config with "auto" dtype resolved for devices of `platform` (jax.Device.platform):
        bfloat16 on TPUs and GPUs, float32 on CPUs (the reference, and what parity tests compare)."""
        if self.dtype != "auto":
            return self
        return dataclasses.replace(self, dtype="float32" if platform == "cpu" else "bfloat16")

    @property
    def cache_dtype(self) -> str:
        """The KV cache's element type (a kvtransfer.DTYPES name): --kv-cache-dtype's, else the serving
        dtype's (resolved by on_platform)."""
        return KV_CACHE_DTYPES[self.kv_cache_dtype] or self.dtype

    @property
    def max_prompt_chars(self) -> int:
        """The longest prompt text (or chat, before its template) taken: 16 characters a token of the
        model length, refused before any CPU is spent on tokenizing it."""
        return 16 * self.max_model_len

    @property
    def max_blocks_per_seq(self) -> int:
        return self.max_model_len // self.block_size

    @property
    def token_buckets(self) -> tuple[int, ...]:
        """Token counts a step is compiled for: one shape per bucket (engine.runner)."""
        return _powers_of_two(1, self.max_num_batched_tokens)

    def seq_bucket(self, num_tokens: int) -> int:
        """Sequence slots of the step of `num_tokens` tokens (a sequence has at least one token)."""
        return min(num_tokens, self.max_num_seqs)

    def logits_bucket(self, num_tokens: int) -> int:
        """Rows of logits the step of `num_tokens` tokens returns: one per sequence slot, and with
        speculation one more per draft a sequence verifies (never more than the step's tokens)."""
        return min(num_tokens, self.seq_bucket(num_tokens) * (1 + self.speculation.num_speculative_tokens))


def bucket_for(value: int, buckets: tuple[int, ...]) -> int:
    """The smallest bucket >= value; ValueError past the largest."""
    for bucket in buckets:
        if value <= bucket:
            return bucket
    raise ValueError(f"{value} exceeds the largest bucket {buckets[-1]}")
