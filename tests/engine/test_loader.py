"""Checkpoint loading: formats, clear errors, the GGUF rope permutation, head padding for TP."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest

from pdserve.engine.config import ModelConfig, UnsupportedModelError
from pdserve.engine.loading.checkpoints import (
    CheckpointError,
    SafetensorsCheckpoint,
    _undo_gguf_rope_permutation,
    load_gguf,
    load_hf_folder,
)
from pdserve.engine.loading.sources import resolve
from pdserve.engine.model.weights import pad_heads

pytestmark = pytest.mark.fast

HF_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 32,
    "hidden_size": 16,
    "intermediate_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "max_position_embeddings": 128,
    "tie_word_embeddings": True,
}


def test_unsupported_architecture_is_named(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({**HF_CONFIG, "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(UnsupportedModelError, match="GPT2LMHeadModel"):
        load_hf_folder(tmp_path)


@pytest.mark.parametrize(
    "change, field",
    [
        ({"architectures": ["Gemma3ForConditionalGeneration"]}, "Gemma3ForConditionalGeneration"),
        ({"layer_types": ["full_attention", "chunked_attention"]}, "chunked_attention"),
        ({"layer_types": ["full_attention", "sliding_attention"]}, "no sliding_window"),
        ({"hidden_act": "relu2"}, "hidden_act"),
        ({"use_bidirectional_attention": True}, "use_bidirectional_attention"),
        (
            {"architectures": ["Qwen3MoeForCausalLM"], "num_experts": 4, "mlp_only_layers": [1]},
            "mlp_only_layers",
        ),
        ({"architectures": ["Qwen3MoeForCausalLM"]}, "num_experts"),
        (
            {
                "architectures": ["DeepseekV2ForCausalLM"],
                **dict(kv_lora_rank=8, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8),
                **dict(n_routed_experts=4, num_experts_per_tok=2, topk_method="noaux_tc"),
            },
            "noaux_tc",
        ),
        ({"mlp_bias": True}, "mlp_bias"),
        ({"rope_scaling": {"rope_type": "longrope", "factor": 4.0}}, "longrope"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "original_max_position_embeddings"),
    ],
)
def test_unsupported_config_features_are_named(change, field):
    with pytest.raises(UnsupportedModelError, match=field):
        ModelConfig.from_hf_config({**HF_CONFIG, **change})


@pytest.mark.parametrize(
    "change, windows, rope",
    [
        ({"architectures": ["MistralForCausalLM"], "sliding_window": 32}, (32, 32), (10000.0, None, 1.0)),
        ({"architectures": ["MistralForCausalLM"], "sliding_window": None}, (), (10000.0, None, 1.0)),
        (  # Qwen2 before layer_types: sliding from max_window_layers on
            {
                "architectures": ["Qwen2ForCausalLM"],
                "use_sliding_window": True,
                "sliding_window": 64,
                "max_window_layers": 1,
            },
            (0, 64),
            (10000.0, None, 1.0),
        ),
        (  # Gemma 3 as its hub configs say it (transformers 4): a pattern, a local base, linear scaling
            {
                "architectures": ["Gemma3ForCausalLM"],
                "sliding_window": 16,
                "sliding_window_pattern": 2,
                "rope_theta": 1e6,
                "rope_local_base_freq": 1e4,
                "rope_scaling": {"rope_type": "linear", "factor": 8.0},
            },
            (16, 0),
            (1e6, 1e4, 8.0),
        ),
    ],
)
def test_sliding_windows_and_rope_per_layer_type_are_read(change, windows, rope):
    cfg = ModelConfig.from_hf_config({**HF_CONFIG, **change})
    assert cfg.layer_windows == windows
    assert (cfg.rope_theta, cfg.sliding_rope_theta, cfg.rope_linear_factor) == rope


def test_commands_refuse_an_unservable_model_in_one_line(tmp_path):
    """pdserve generate and both daemons: one line on stderr, exit status 1, no traceback."""
    import subprocess
    import sys

    (tmp_path / "config.json").write_text(json.dumps({**HF_CONFIG, "architectures": ["GPT2LMHeadModel"]}))
    commands = {
        "pdserve": ["generate", "--model", str(tmp_path), "Hi"],
        "prefill-server": ["--model", str(tmp_path), "--port", "0", "--no-warmup"],
        "decode-server": ["--model", str(tmp_path), "--port", "0", "--no-warmup"],
    }
    runs = {
        name: subprocess.Popen(  # the installed commands (console scripts beside this interpreter)
            [str(Path(sys.executable).parent / name), *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for name, args in commands.items()
    }
    for name, run in runs.items():
        _, err = run.communicate(timeout=120)
        lines = [line for line in err.splitlines() if line.strip()]
        assert run.returncode == 1 and len(lines) == 1, (name, err)
        assert lines[0].startswith("error: ") and "Gemma3ForCausalLM" in lines[0], (name, err)


def test_qwen3_gguf_and_hf_folder_load_the_same_weights(tmp_path):
    """The same random Qwen3 weights under llama.cpp's GGUF names and Hugging Face's: equal configs and host
    arrays (q/k norms included; no rope permutation for Qwen)."""
    import gguf
    from safetensors.numpy import save_file

    rng = np.random.default_rng(1)
    vocab, hidden, inter, heads, kv_heads, head_dim, layers = 40, 16, 24, 4, 2, 8, 2
    shapes = {  # HF name: ([out, in] as stored, GGUF name)
        "self_attn.q_proj.weight": ((heads * head_dim, hidden), "attn_q.weight"),
        "self_attn.k_proj.weight": ((kv_heads * head_dim, hidden), "attn_k.weight"),
        "self_attn.v_proj.weight": ((kv_heads * head_dim, hidden), "attn_v.weight"),
        "self_attn.o_proj.weight": ((hidden, heads * head_dim), "attn_output.weight"),
        "self_attn.q_norm.weight": ((head_dim,), "attn_q_norm.weight"),
        "self_attn.k_norm.weight": ((head_dim,), "attn_k_norm.weight"),
        "mlp.gate_proj.weight": ((inter, hidden), "ffn_gate.weight"),
        "mlp.up_proj.weight": ((inter, hidden), "ffn_up.weight"),
        "mlp.down_proj.weight": ((hidden, inter), "ffn_down.weight"),
        "input_layernorm.weight": ((hidden,), "attn_norm.weight"),
        "post_attention_layernorm.weight": ((hidden,), "ffn_norm.weight"),
    }
    hf = {
        "model.embed_tokens.weight": rng.normal(size=(vocab, hidden)),
        "model.norm.weight": rng.normal(size=hidden),
    }
    hf["lm_head.weight"] = rng.normal(size=(vocab, hidden))
    gg = {"token_embd.weight": hf["model.embed_tokens.weight"], "output_norm.weight": hf["model.norm.weight"]}
    gg["output.weight"] = hf["lm_head.weight"]
    for i in range(layers):
        for name, (shape, gguf_name) in shapes.items():
            hf[f"model.layers.{i}.{name}"] = gg[f"blk.{i}.{gguf_name}"] = rng.normal(size=shape)
    folder = tmp_path / "hf"
    folder.mkdir()
    save_file({k: v.astype(np.float32) for k, v in hf.items()}, str(folder / "model.safetensors"))
    config = {
        **HF_CONFIG,
        "architectures": ["Qwen3ForCausalLM"],
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": inter,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1e6,
        "tie_word_embeddings": False,
    }
    (folder / "config.json").write_text(json.dumps(config))
    writer = gguf.GGUFWriter(str(tmp_path / "q.gguf"), "qwen3")
    writer.add_block_count(layers)
    writer.add_context_length(HF_CONFIG["max_position_embeddings"])
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(inter)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_key_length(head_dim)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(1e6)
    writer.add_vocab_size(vocab)
    for name, w in gg.items():
        writer.add_tensor(name, w.astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    cfg, host = load_hf_folder(folder, name="q")
    gguf_cfg, gguf_host, _ = load_gguf(tmp_path / "q.gguf", name="q")
    assert gguf_cfg.rms_norm_eps == pytest.approx(cfg.rms_norm_eps)  # a float32 in GGUF
    assert cfg == dataclasses.replace(
        gguf_cfg, rms_norm_eps=cfg.rms_norm_eps, weights_digest=cfg.weights_digest
    )
    assert cfg.qk_norm and not cfg.qkv_bias and cfg.head_dim == head_dim
    assert host.keys() == gguf_host.keys() and {"q_norm", "k_norm"} <= host.keys()
    for key in host:
        np.testing.assert_allclose(host[key], gguf_host[key], rtol=1e-6, err_msg=key)


def test_gguf_metadata_without_a_key_takes_llama_cpps_choice():
    """Gemma 3: every sixth layer full, sliding layers at rope base 10000, head_dim's scale except for the
    62-layer 27B; Gemma 2: alternate layers, soft caps 50 / 30; Mixtral: `llama` with experts."""
    from pdserve.engine.loading.gguf_config import hf_config

    def meta(arch, layers, **extra):
        sizes = dict(embedding_length=64, feed_forward_length=128, block_count=layers, context_length=512)
        keys = {**sizes, "attention.head_count": 4, "attention.layer_norm_rms_epsilon": 1e-6, **extra}
        return {"general.architecture": arch, f"{arch}.vocab_size": 8} | {
            f"{arch}.{k}": v for k, v in keys.items()
        }

    gemma3 = ModelConfig.from_hf_config(
        hf_config(meta("gemma3", 12, **{"attention.sliding_window": 512}), True)
    )
    assert [i for i in range(12) if not gemma3.window(i)] == [5, 11] and gemma3.sliding_rope_theta == 1e4
    assert gemma3.attention_scale == 16**-0.5 and gemma3.final_logit_softcap is None
    big = hf_config(meta("gemma3", 62, **{"attention.key_length": 32, "attention.sliding_window": 512}), True)
    assert big["query_pre_attn_scalar"] == 16  # hidden / heads
    gemma2 = ModelConfig.from_hf_config(hf_config(meta("gemma2", 4), True))
    assert gemma2.layer_windows == (4096, 0, 4096, 0) and gemma2.sliding_rope_theta is None
    assert (gemma2.attn_logit_softcap, gemma2.final_logit_softcap) == (50.0, 30.0)
    moe = hf_config(meta("llama", 2, expert_count=4, expert_used_count=2), True)
    assert moe["architectures"] == ["MixtralForCausalLM"] and moe["norm_topk_prob"]
    mla = {"rope.dimension_count": 8, "attention.kv_lora_rank": 32, "expert_group_count": 8}
    with pytest.raises(UnsupportedModelError, match="expert_group_count"):  # DeepSeek-V2 (not Lite)
        hf_config(meta("deepseek2", 2, **mla), True)


def test_unsupported_gguf_architecture_is_named(tmp_path):
    import gguf

    path = tmp_path / "tiny.gguf"
    writer = gguf.GGUFWriter(str(path), "gpt2")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((4, 4), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(UnsupportedModelError, match="'gpt2'"):
        load_gguf(path)


def test_missing_files_are_clear_errors(tmp_path):
    with pytest.raises(CheckpointError, match="not found"):
        load_gguf(tmp_path / "nope.gguf")
    with pytest.raises(CheckpointError, match="config.json"):
        load_hf_folder(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(HF_CONFIG))
    with pytest.raises(CheckpointError, match="safetensors"):
        load_hf_folder(tmp_path)
    with pytest.raises(CheckpointError, match="neither a file"):
        resolve("no-such-model")


def test_missing_tensor_is_named(tmp_path):
    from safetensors.numpy import save_file

    (tmp_path / "config.json").write_text(json.dumps(HF_CONFIG))
    save_file(
        {"model.embed_tokens.weight": np.zeros((32, 16), np.float32)}, str(tmp_path / "model.safetensors")
    )
    with pytest.raises(CheckpointError, match="layer 0 lacks tensor attn_norm"):
        load_hf_folder(tmp_path)


def test_small_hf_folder_loads_and_runs(tmp_path):
    """A random 2-layer Llama in safetensors runs through the engine (config, stacking, tied head)."""
    from safetensors.numpy import save_file

    from pdserve.engine.config import EngineConfig
    from pdserve.engine.llm_engine import LLMEngine
    from pdserve.engine.loading.sources import LoadedModel

    rng = np.random.default_rng(0)
    tensors = {"model.embed_tokens.weight": rng.normal(size=(32, 16)), "model.norm.weight": np.ones(16)}
    shapes = {
        "self_attn.q_proj": (16, 16),
        "self_attn.k_proj": (8, 16),
        "self_attn.v_proj": (8, 16),
        "self_attn.o_proj": (16, 16),
        "mlp.gate_proj": (32, 16),
        "mlp.up_proj": (32, 16),
        "mlp.down_proj": (16, 32),
    }
    for i in range(2):
        for name, shape in shapes.items():
            tensors[f"model.layers.{i}.{name}.weight"] = rng.normal(size=shape) * 0.2
        tensors[f"model.layers.{i}.input_layernorm.weight"] = np.ones(16)
        tensors[f"model.layers.{i}.post_attention_layernorm.weight"] = np.ones(16)
    save_file({k: v.astype(np.float32) for k, v in tensors.items()}, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(HF_CONFIG))
    cfg, host = load_hf_folder(tmp_path)
    assert cfg.num_kv_heads == 2 and host["wq"].shape == (2, 16, 16) and "lm_head" not in host
    engine = LLMEngine(
        LoadedModel(cfg, SafetensorsCheckpoint(tmp_path), tokenizer=None, path=tmp_path),
        EngineConfig(
            num_blocks=8, max_model_len=64, max_num_seqs=2, max_num_batched_tokens=32, block_size=16
        ),
    )
    logits = engine.prompt_logits([1, 2, 3])
    assert logits.shape == (32,) and np.all(np.isfinite(logits))


def test_rope_permutation_round_trip():
    """llama.cpp's permutation (halves -> interleaved pairs per head) is undone exactly."""
    heads, head_dim, cols = 3, 8, 5
    hf = np.arange(heads * head_dim * cols, dtype=np.float32).reshape(heads * head_dim, cols)
    permuted = hf.reshape(heads, 2, head_dim // 2, cols).swapaxes(1, 2).reshape(hf.shape)
    assert np.array_equal(_undo_gguf_rope_permutation(permuted, heads), hf)


def test_head_padding_keeps_groups_with_their_kv_head():
    cfg = ModelConfig(
        "llama",
        32,
        8,
        16,
        1,
        num_heads=6,
        num_kv_heads=3,
        head_dim=2,
        rope_theta=1e4,
        rms_norm_eps=1e-5,
        max_position_embeddings=64,
        tie_word_embeddings=True,
    )
    assert cfg.padded_num_kv_heads(2) == 4 and cfg.padded_num_heads(2) == 8
    q = np.arange(6 * 2, dtype=np.float32)[None]  # [1, heads * head_dim]
    padded = pad_heads(q, -1, cfg, 2, kv=False).reshape(4, 2, 2)  # [kv heads, group, head_dim]
    assert np.array_equal(padded[:3].reshape(-1), q[0]) and not padded[3].any()
    kv = pad_heads(np.ones((1, 3 * 2), np.float32), -1, cfg, 4, kv=True)
    assert kv.shape == (1, 8) and not kv[0, 6:].any()


def test_dtype_auto_is_bfloat16_on_accelerators_and_float32_on_cpu():
    from pdserve.engine.config import EngineConfig

    assert EngineConfig().dtype == "auto"
    assert [EngineConfig().on_platform(p).dtype for p in ("tpu", "gpu", "cpu")] == [
        "bfloat16",
        "bfloat16",
        "float32",  # the tests' $PDSERVE_CPU_DTYPE (tests/conftest.py)
    ]
    assert EngineConfig(dtype="float32").on_platform("tpu").dtype == "float32"  # given: kept
    with pytest.raises(ValueError, match="dtype"):
        EngineConfig(dtype="float16")


def test_dtype_auto_on_a_cpu_follows_its_bfloat16_instructions_and_jax(monkeypatch):
    import jax

    from pdserve.engine.config import EngineConfig, engine

    monkeypatch.delenv(engine.CPU_DTYPE_ENV)
    for has_dots, version, expected in [
        (True, (0, 12, 0), "bfloat16"),
        (False, (0, 12, 0), "float32"),
        (True, (0, 10, 2), "float32"),  # XLA:CPU before jax 0.12 widened bfloat16 weights in every step
    ]:
        monkeypatch.setattr(engine, "cpu_has_bfloat16_dots", lambda has_dots=has_dots: has_dots)
        monkeypatch.setattr(jax, "__version_info__", version)
        assert EngineConfig().on_platform("cpu").dtype == expected
    monkeypatch.setenv(engine.CPU_DTYPE_ENV, "bfloat16")
    assert EngineConfig().on_platform("cpu").dtype == "bfloat16"
    monkeypatch.setenv(engine.CPU_DTYPE_ENV, "float16")
    with pytest.raises(ValueError, match="PDSERVE_CPU_DTYPE"):
        EngineConfig().on_platform("cpu")


def test_sixteen_bit_steps_on_a_cpu_are_compiled_for_two_rows_at_least():
    """XLA:CPU's one-row bfloat16 dots take a slow path: a lone request's step pads to two rows there."""
    from pdserve.engine.config import EngineConfig

    for dtype, platform, smallest in [("bfloat16", "cpu", 2), ("float32", "cpu", 1), ("bfloat16", "tpu", 1)]:
        config = EngineConfig(dtype=dtype, max_num_batched_tokens=64).on_platform(platform)
        assert config.token_buckets == (smallest, *(b for b in (2, 4, 8, 16, 32, 64) if b > smallest))
    config = EngineConfig(dtype="bfloat16", max_num_seqs=1, max_num_batched_tokens=1).on_platform("cpu")
    assert config.token_buckets == (1,)  # never past the budget


@pytest.mark.parametrize("budget", [1, 64, 256, 300, 512, 2048, 3000])
def test_step_buckets_double_then_add_half_steps_from_256_tokens(budget):
    """A step pays for its bucket: from HALF_STEPS_FROM tokens on, no bucket is more than 1.5x the one
    below it (a 256-token chunk with a few decodes runs in 384, not 512); below, powers of two."""
    from pdserve.engine.config import EngineConfig
    from pdserve.engine.config.engine import HALF_STEPS_FROM

    buckets = EngineConfig(max_num_batched_tokens=budget, max_num_seqs=1).token_buckets
    assert buckets[-1] == budget and list(buckets) == sorted(set(buckets))
    for below, above in zip(buckets, buckets[1:], strict=False):
        assert above <= (2 * below if below < HALF_STEPS_FROM else below * 3 // 2)
    assert all(b & (b - 1) == 0 for b in buckets[:-1] if b <= HALF_STEPS_FROM)  # powers of two


def _fp8_folder(path: Path, config: dict) -> Path:
    """A tiny folder as llm-compressor writes FP8 checkpoints: F8_E4M3 weights beside float32 scales."""
    import ml_dtypes
    from safetensors.numpy import save_file

    path.mkdir()
    (path / "config.json").write_text(json.dumps(config))
    weight = np.ones((16, 16), ml_dtypes.float8_e4m3fn)
    tensors = {
        "model.embed_tokens.weight": np.zeros((32, 16), np.float32),
        "model.layers.0.self_attn.q_proj.weight": weight,
        "model.layers.0.self_attn.q_proj.weight_scale": np.ones((16, 1), np.float32),
    }
    save_file(tensors, str(path / "model.safetensors"))
    return path


@pytest.mark.parametrize(
    "quantization, method",
    [
        ({"quant_method": "compressed-tensors", "format": "float-quantized"}, "compressed-tensors"),
        ({"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False}, "gptq"),
        ({"quant_method": "awq", "bits": 4, "version": "gemm"}, "awq"),
    ],
)
def test_quantized_checkpoints_are_refused_in_one_line(tmp_path, quantization, method):
    """A config.json quantization_config of any kind is refused by name: its weights would otherwise load
    unscaled (FP8) or fail as a missing tensor (GPTQ's qweight)."""
    from pdserve.engine.loading.sources import MODEL_ERRORS, load_model

    folder = _fp8_folder(tmp_path / "q", {**HF_CONFIG, "quantization_config": quantization})
    with pytest.raises(MODEL_ERRORS) as refusal:
        load_model(folder)
    assert isinstance(refusal.value, UnsupportedModelError)
    assert "\n" not in str(refusal.value) and f"quant_method={method!r}" in str(refusal.value)


def test_tensors_of_an_unread_dtype_are_refused_by_name(tmp_path):
    """Without a quantization_config, an F8_E4M3 tensor is still refused, naming the tensor."""
    folder = _fp8_folder(tmp_path / "f8", HF_CONFIG)
    with pytest.raises(UnsupportedModelError, match="q_proj.weight is F8_E4M3"):
        SafetensorsCheckpoint(folder)


def test_an_untied_head_missing_is_named(tmp_path):
    """A folder whose config unties the head but that has no lm_head.weight: a CheckpointError naming the
    tensor when the weights stream to the devices (the head is read in pieces, its size looked up first)."""
    from safetensors import safe_open

    from pdserve.engine.model.sharding import make_mesh
    from pdserve.engine.model.weights import build_weights
    from pdserve.testing.load_probe import write_random_llama

    write_random_llama(
        tmp_path, shards=1, hidden=64, intermediate=128, layers=2, heads=4, kv_heads=2, vocab=96
    )
    (shard,) = tmp_path.glob("*.safetensors")
    with safe_open(str(shard), "numpy") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys() if k != "lm_head.weight"}  # noqa: SIM118
    from safetensors.numpy import save_file

    save_file(tensors, str(shard))
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": dict.fromkeys(tensors, shard.name)})
    )
    checkpoint = SafetensorsCheckpoint(tmp_path)
    with pytest.raises(CheckpointError, match="lacks tensor lm_head.weight and embeddings are not tied"):
        build_weights(checkpoint.config, checkpoint, make_mesh(1))


def test_the_weights_digest_tells_checkpoints_of_one_name_apart(tmp_path):
    """Two folders of the same name (the same model name) with other weights: other digests, so KV layouts
    that do not fit each other; the same files again, and their copy read into memory, keep theirs."""
    from pdserve.engine.config import EngineConfig
    from pdserve.engine.loading.sources import LoadedModel
    from pdserve.engine.model.kv_cache import kv_layout
    from pdserve.kvtransfer import LayoutMismatchError
    from pdserve.testing.load_probe import write_random_llama

    sizes = dict(hidden=64, intermediate=128, layers=2, heads=4, kv_heads=2, vocab=96)
    first, second = tmp_path / "a" / "m", tmp_path / "b" / "m"
    write_random_llama(first, shards=2, seed=1, **sizes)
    write_random_llama(second, shards=2, seed=2, **sizes)
    a, b = SafetensorsCheckpoint(first), SafetensorsCheckpoint(second)
    assert a.config.name == b.config.name == "m" and a.config.weights_digest != b.config.weights_digest
    assert SafetensorsCheckpoint(first).config.weights_digest == a.config.weights_digest
    in_memory = LoadedModel(a.config, a, None, first).in_memory()
    assert in_memory.checkpoint.config.weights_digest == a.config.weights_digest
    config = EngineConfig(num_blocks=8, max_model_len=64).on_platform("cpu")
    with pytest.raises(LayoutMismatchError, match="model"):
        kv_layout(a.config, config).check_compatible(kv_layout(b.config, config))
    kv_layout(a.config, config).check_compatible(kv_layout(in_memory.config, config))
