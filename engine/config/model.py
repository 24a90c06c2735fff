"""The model's architecture: ModelConfig, a frozen description of the decoder (layers, heads, rope,
windows, experts, MLA) and the shapes derived from it, built from a config.json by engine.config.hf."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pdserve.engine.config.hf import ACTIVATIONS, SUPPORTED_ARCHITECTURES, UnsupportedModelError, hf_fields


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
        return cls(**hf_fields(config, name))
