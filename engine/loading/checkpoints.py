"""Checkpoints: GGUF files (each tensor dequantized as it is read) and Hugging Face safetensors folders.

Opening one reads its config only. Its weights are read one layer at a time, in their stored dtype and in
math layout (`x @ W`), by `engine.model.weights.build_weights`, which streams each layer to the devices: no
copy of the whole model is ever held on the host. `HostCheckpoint` holds a model's arrays in memory
instead (random test models, and the tests' shared fixtures).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import math
import struct
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

import ml_dtypes
import numpy as np

from pdserve.engine.config import GEMMA, ModelConfig, UnsupportedModelError
from pdserve.engine.loading import gguf_config
from pdserve.engine.tokenizer import read_gguf_metadata

log = logging.getLogger(__name__)

# per-layer weight name -> (GGUF tensor suffix, HF tensor suffix)
_LAYER_TENSORS = {
    "attn_norm": ("attn_norm.weight", "input_layernorm.weight"),
    "wq": ("attn_q.weight", "self_attn.q_proj.weight"),
    "wk": ("attn_k.weight", "self_attn.k_proj.weight"),
    "wv": ("attn_v.weight", "self_attn.v_proj.weight"),
    "bq": ("attn_q.bias", "self_attn.q_proj.bias"),
    "bk": ("attn_k.bias", "self_attn.k_proj.bias"),
    "bv": ("attn_v.bias", "self_attn.v_proj.bias"),
    "wo": ("attn_output.weight", "self_attn.o_proj.weight"),
    "mlp_norm": ("ffn_norm.weight", "post_attention_layernorm.weight"),
    "w_gate": ("ffn_gate.weight", "mlp.gate_proj.weight"),
    "w_up": ("ffn_up.weight", "mlp.up_proj.weight"),
    "w_down": ("ffn_down.weight", "mlp.down_proj.weight"),
    "experts_gate": ("ffn_gate_exps.weight", "mlp.experts.{e}.gate_proj.weight"),  # {e}: each expert
    "experts_up": ("ffn_up_exps.weight", "mlp.experts.{e}.up_proj.weight"),
    "experts_down": ("ffn_down_exps.weight", "mlp.experts.{e}.down_proj.weight"),
    "shared_gate": ("ffn_gate_shexp.weight", "mlp.shared_experts.gate_proj.weight"),
    "shared_up": ("ffn_up_shexp.weight", "mlp.shared_experts.up_proj.weight"),
    "shared_down": ("ffn_down_shexp.weight", "mlp.shared_experts.down_proj.weight"),
    "q_norm": ("attn_q_norm.weight", "self_attn.q_norm.weight"),
    "k_norm": ("attn_k_norm.weight", "self_attn.k_norm.weight"),
    "post_attn_norm": ("post_attention_norm.weight", "post_attention_layernorm.weight"),
    "post_mlp_norm": ("post_ffw_norm.weight", "post_feedforward_layernorm.weight"),
    "w_router": ("ffn_gate_inp.weight", "mlp.gate.weight"),
    "w_q_a": ("attn_q_a.weight", "self_attn.q_a_proj.weight"),
    "q_a_norm": ("attn_q_a_norm.weight", "self_attn.q_a_layernorm.weight"),
    "w_q_b": ("attn_q_b.weight", "self_attn.q_b_proj.weight"),
    "w_kv_a": ("attn_kv_a_mqa.weight", "self_attn.kv_a_proj_with_mqa.weight"),
    "kv_a_norm": ("attn_kv_a_norm.weight", "self_attn.kv_a_layernorm.weight"),
    "w_kv_b": ("attn_kv_b.weight", "self_attn.kv_b_proj.weight"),
}
# Gemma's checkpoints name the norm before the MLP differently (its post_attention_layernorm normalizes
# the attention's output, see post_attn_norm)
_GEMMA_HF_TENSORS = {"mlp_norm": "pre_feedforward_layernorm.weight"}
# Mixtral's names for its router and experts
_MIXTRAL_HF_TENSORS = {
    "w_router": "block_sparse_moe.gate.weight",
    "experts_gate": "block_sparse_moe.experts.{e}.w1.weight",
    "experts_up": "block_sparse_moe.experts.{e}.w3.weight",
    "experts_down": "block_sparse_moe.experts.{e}.w2.weight",
}
_BIASES = ("bq", "bk", "bv")
_MLA = ("w_kv_a", "kv_a_norm", "w_kv_b")  # multi-head latent attention's, in place of wk, wv
_Q_LORA = ("w_q_a", "q_a_norm", "w_q_b")  # MLA's low-rank queries, in place of wq
_DENSE_MLP = ("w_gate", "w_up", "w_down")
_EXPERTS = ("w_router", "experts_gate", "experts_up", "experts_down")
_SHARED = ("shared_gate", "shared_up", "shared_down")


def _layers_with(cfg: ModelConfig, name: str) -> range:
    """The layers that have weight `name` (empty: the model has none)."""
    every, none = range(cfg.num_layers), range(0)
    dense_end = cfg.dense_layers  # expert layers after
    has = {
        "q_norm": cfg.qk_norm,
        "k_norm": cfg.qk_norm,
        "post_attn_norm": cfg.sandwich_norms,
        "post_mlp_norm": cfg.sandwich_norms,
        "wq": not cfg.q_lora_rank,
        **{n: not cfg.is_mla for n in ("wk", "wv", *_BIASES)},
        **{n: cfg.is_mla for n in _MLA},
        **{n: cfg.q_lora_rank > 0 for n in _Q_LORA},
    }
    if name in _DENSE_MLP:
        return range(dense_end)
    if name in _EXPERTS or name in _SHARED:
        return range(dense_end, cfg.num_layers) if name not in _SHARED or cfg.shared_experts else none
    return every if has.get(name, True) else none


def _halves_from_interleaved_rope(w: np.ndarray, head_size: int, rope_dim: int) -> np.ndarray:
    """DeepSeek rotates pairs of adjacent dims (complex numbers); pdserve's rope rotates dim i with
    i + rope_dim / 2. Reorders the last rope_dim of each head_size-wide head of w's last axis to match;
    q.k is unchanged when queries and keys are reordered alike."""
    heads = w.reshape(*w.shape[:-1], -1, head_size)
    order = np.r_[np.arange(0, rope_dim, 2), np.arange(1, rope_dim, 2)] + head_size - rope_dim
    heads = np.concatenate([heads[..., : head_size - rope_dim], heads[..., order]], axis=-1)
    return heads.reshape(w.shape)


def _mla_rope_in_halves(cfg: ModelConfig, host: dict[str, np.ndarray]) -> None:
    """MLA's query and latent projections with their rope dims in halves (both formats keep DeepSeek's
    interleaved order: llama.cpp rotates adjacent pairs too)."""
    if cfg.is_mla:
        q = "w_q_b" if cfg.q_lora_rank else "wq"
        host[q] = _halves_from_interleaved_rope(host[q], cfg.head_dim, cfg.rope_dim)
        host["w_kv_a"] = _halves_from_interleaved_rope(host["w_kv_a"], host["w_kv_a"].shape[-1], cfg.rope_dim)


def _undo_gguf_rope_permutation(w: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's converter reorders each q/k head's rows from halves to interleaved pairs; undo it.

    `w` is [out, ...] with out = num_heads * head_dim (a weight or a bias).
    """
    out = w.shape[0]
    return w.reshape(num_heads, out // num_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


class CheckpointError(FileNotFoundError):
    """A checkpoint file or tensor is missing."""


# Tensor dtypes pdserve reads from safetensors files (anything else is a quantized or foreign checkpoint),
# each with the numpy dtype its tensors are read as (_Stored)
_SAFETENSORS_DTYPES = {"F32": np.dtype("<f4"), "F16": np.dtype("<f2"), "BF16": np.dtype(ml_dtypes.bfloat16)}
GLOBAL_TENSORS = ("embed", "final_norm", "lm_head")  # the arrays outside the layers


def weights_digest(entries: Iterator[tuple[str, str, tuple[int, ...], bytes]]) -> str:
    """A digest of a checkpoint's weights from each tensor's (name, dtype, shape, a sample of its bytes:
    its first and last rows): other weights (a fine-tune, another release under the same name) differ in
    every tensor, so it tells them apart without reading the whole checkpoint."""
    digest = hashlib.sha256()
    for name, dtype, shape, sample in sorted(entries):
        digest.update(f"{name}|{dtype}|{shape}|".encode())
        digest.update(hashlib.sha256(sample).digest())
    return digest.hexdigest()[:16]


def edge_rows(array: np.ndarray) -> bytes:
    """The first and last rows of an array (all of a small one), as bytes."""
    flat = array.reshape(array.shape[0], -1) if array.ndim > 1 else array.reshape(1, -1)
    return np.ascontiguousarray(flat[0]).tobytes() + np.ascontiguousarray(flat[-1]).tobytes()


class LayerReader:
    """An open checkpoint: one layer's arrays (or the embeddings, final norm and head) at a time, as
    numpy arrays in their stored dtype (float32 where dequantized), in math layout. `bytes_read` counts
    the stored bytes read so far (progress)."""

    bytes_read: int = 0

    def layer(self, i: int) -> dict[str, np.ndarray]:
        """Layer i's arrays, named as engine.model.weights.build_weights takes them ([in, out] weights;
        [experts, in, out] for experts), only those the layer has."""
        raise NotImplementedError

    def global_tensor(self, name: str, vocab: slice = slice(None)) -> np.ndarray | None:
        """One of GLOBAL_TENSORS: `embed` [vocab, hidden], `final_norm` [hidden], `lm_head` [hidden, vocab]
        (None when the head is tied to the embeddings); of `embed` and `lm_head` only the `vocab` entries
        (the loader reads them in pieces: each is the size of several layers)."""
        raise NotImplementedError

    def vocab_size(self, name: str) -> int:
        """Vocabulary entries of `embed` or `lm_head` as stored."""
        raise NotImplementedError


class Checkpoint:
    """A model's weights where they are stored. `config` is read on opening; `reader()` reads the
    weights, a layer at a time (engine.model.weights.build_weights)."""

    config: ModelConfig
    path: Path
    nbytes: int  # stored bytes of the weights
    num_params: int  # their elements (the devices' bytes before loading: engine.memory)

    def reader(self) -> contextlib.AbstractContextManager[LayerReader]:
        raise NotImplementedError


class _FileReader(LayerReader):
    """A checkpoint file's reader over `tensor(key)` and `fetch(layer, name)` (the stored [out, in]
    tensor of one of _LAYER_TENSORS): what GGUF and safetensors share."""

    def __init__(self, cfg: ModelConfig, path: Path, fetch: Callable[[int, str], np.ndarray | None]):
        self.cfg, self.path, self.fetch = cfg, path, fetch

    GLOBAL_KEYS: dict[str, str]  # GLOBAL_TENSORS' names in the format

    def tensor(self, key: str, rows: slice = slice(None)) -> np.ndarray | None:
        """The stored tensor `key` (those `rows` of its first axis), None if the checkpoint lacks it."""
        raise NotImplementedError

    def rows(self, key: str) -> int:
        raise NotImplementedError

    def vocab_size(self, name: str) -> int:
        if self.global_tensor(name, slice(0, 0)) is None:  # (raises CheckpointError naming a missing one)
            raise CheckpointError(f"{self.path}: {name} is tied to the embeddings")
        return self.rows(self.GLOBAL_KEYS[name])

    def global_tensor(self, name: str, vocab: slice = slice(None)) -> np.ndarray | None:
        if name == "lm_head" and self.cfg.tie_word_embeddings:
            return None
        w = self.tensor(self.GLOBAL_KEYS[name], vocab if name != "final_norm" else slice(None))
        if w is None:
            tied = " and embeddings are not tied" if name == "lm_head" else ""
            raise CheckpointError(f"{self.path} lacks tensor {self.GLOBAL_KEYS[name]}{tied}")
        return w.T if name == "lm_head" else w  # stored [vocab, hidden]

    def layer(self, i: int) -> dict[str, np.ndarray]:
        cfg, out = self.cfg, {}
        for name in _LAYER_TENSORS:
            if i not in _layers_with(cfg, name):
                continue
            w = self.fetch(i, name)
            if w is None:
                if name in _BIASES and not cfg.qkv_bias:
                    heads = cfg.num_heads if name == "bq" else cfg.num_kv_heads
                    w = np.zeros(heads * cfg.head_dim, np.float32)
                else:
                    raise CheckpointError(f"layer {i} lacks tensor {name} ({_LAYER_TENSORS[name]})")
            out[name] = np.swapaxes(w, -1, -2) if w.ndim >= 2 else w  # [(experts,) out, in] -> in, out
        _mla_rope_in_halves(cfg, out)
        return out


class GGUFCheckpoint(Checkpoint):
    """A GGUF file (llama.cpp's format); quantized tensors are dequantized to float32 one at a time."""

    def __init__(self, path: str | Path, name: str | None = None):
        import gguf

        self.path = path = Path(path)
        if not path.is_file():
            raise CheckpointError(f"GGUF file not found: {path}")
        reader = gguf.GGUFReader(str(path))
        self.metadata = read_gguf_metadata(reader)
        names = {t.name for t in reader.tensors}
        config = gguf_config.hf_config(self.metadata, tie_word_embeddings="output.weight" not in names)
        config = ModelConfig.from_hf_config(config, name=name or path.stem)
        self.nbytes = sum(int(t.n_bytes) for t in reader.tensors)
        self.num_params = sum(int(t.n_elements) for t in reader.tensors)
        entries = (
            (t.name, t.tensor_type.name, tuple(int(d) for d in t.shape), edge_rows(np.asarray(t.data)))
            for t in reader.tensors
        )
        self.config = dataclasses.replace(config, weights_digest=weights_digest(entries))

    @contextlib.contextmanager
    def reader(self) -> Iterator[LayerReader]:
        import gguf

        reader = gguf.GGUFReader(str(self.path))  # a memory map, dropped when the load ends
        yield _GGUFReader(self.config, self.path, {t.name: t for t in reader.tensors}, self.metadata)


class _GGUFReader(_FileReader):
    def __init__(self, cfg: ModelConfig, path: Path, tensors: Mapping, meta: Mapping):
        super().__init__(cfg, path, self._fetch)
        self.tensors = tensors
        self.permute = meta["general.architecture"] in gguf_config.ROPE_PERMUTED

    GLOBAL_KEYS = {
        "embed": "token_embd.weight",
        "final_norm": "output_norm.weight",
        "lm_head": "output.weight",
    }

    def rows(self, key: str) -> int:
        return int(self.tensors[key].shape[-1])  # (GGUF lists dimensions innermost first)

    def tensor(self, key: str, rows: slice = slice(None)) -> np.ndarray | None:
        import gguf

        t = self.tensors.get(key)
        if t is None:
            return None
        shape = tuple(reversed([int(d) for d in t.shape]))
        data = t.data[rows] if rows != slice(None) else t.data  # rows of a matrix: rows of its blocks
        self.bytes_read += data.nbytes
        try:
            arr = gguf.quants.dequantize(data, t.tensor_type)
        except NotImplementedError:
            raise UnsupportedModelError(
                f"{self.path}: tensor {key} is {t.tensor_type.name}, a type the gguf package does not read"
            ) from None
        return np.asarray(arr, dtype=np.float32).reshape(-1, *shape[1:])

    def _fetch(self, i: int, weight: str) -> np.ndarray | None:
        cfg = self.cfg
        w = self.tensor(f"blk.{i}.{_LAYER_TENSORS[weight][0]}")
        # llama.cpp splits DeepSeek's kv_b: k_b [heads, rank, nope], v_b [heads, v, rank]
        if w is None and weight == "w_kv_b":
            k_b, v_b = self.tensor(f"blk.{i}.attn_k_b.weight"), self.tensor(f"blk.{i}.attn_v_b.weight")
            if k_b is not None and v_b is not None:
                w = np.concatenate([k_b.transpose(0, 2, 1), v_b], axis=1).reshape(-1, k_b.shape[1])
        if w is not None and self.permute and weight in ("wq", "bq"):
            w = _undo_gguf_rope_permutation(w, cfg.num_heads)
        if w is not None and self.permute and weight in ("wk", "bk"):
            w = _undo_gguf_rope_permutation(w, cfg.num_kv_heads)
        return w


class SafetensorsCheckpoint(Checkpoint):
    """A Hugging Face folder: config.json and one or several *.safetensors files (with an index)."""

    def __init__(self, path: str | Path, name: str | None = None):
        from safetensors import safe_open

        self.path = path = Path(path)
        config_file = path / "config.json"
        if not config_file.is_file():
            raise CheckpointError(f"{path} has no config.json")
        self.config = ModelConfig.from_hf_config(json.loads(config_file.read_text()), name=name or path.name)
        index_file = path / "model.safetensors.index.json"
        if index_file.is_file():
            files = sorted(set(json.loads(index_file.read_text())["weight_map"].values()))
        else:
            files = sorted(p.name for p in path.glob("*.safetensors"))
        if not files:
            raise CheckpointError(f"{path} has no *.safetensors files")
        self.where: dict[str, _Stored] = {}
        self.nbytes = self.num_params = 0
        entries = []
        for file in files:
            if not (path / file).is_file():
                raise CheckpointError(f"{path / file} (named in the index) is missing")
            offsets = _data_offsets(path / file)
            with safe_open(str(path / file), framework="numpy") as f:
                for key in f.keys():  # noqa: SIM118 - safe_open has no __iter__
                    tensor = f.get_slice(key)
                    dtype = tensor.get_dtype()
                    if dtype not in _SAFETENSORS_DTYPES:
                        raise UnsupportedModelError(
                            f"{path / file}: tensor {key} is {dtype}: pdserve reads "
                            f"{tuple(_SAFETENSORS_DTYPES)} tensors only (a quantized checkpoint? serve its "
                            "bf16 original)"
                        )
                    shape = tuple(tensor.get_shape())
                    self.where[key] = _Stored(path / file, offsets[key], _SAFETENSORS_DTYPES[dtype], shape)
                    self.num_params += math.prod(shape)
                    if shape and shape[0]:
                        sample = edge_rows(tensor[0:1]) + edge_rows(tensor[shape[0] - 1 : shape[0]])
                    else:
                        sample = b""
                    entries.append((key, dtype, shape, sample))
            self.nbytes += (path / file).stat().st_size
        self.config = dataclasses.replace(self.config, weights_digest=weights_digest(iter(entries)))

    @contextlib.contextmanager
    def reader(self) -> Iterator[LayerReader]:
        yield _SafetensorsReader(self.config, self.path, self.where)


@dataclasses.dataclass(frozen=True)
class _Stored:
    """Where a safetensors tensor's bytes are: its file, their offset in it, its numpy dtype and shape."""

    file: Path
    offset: int
    dtype: np.dtype
    shape: tuple[int, ...]

    def mapped(self) -> np.ndarray:
        """The tensor as a read-only view of the file's pages (mapped for this tensor only: the mapping, and
        the pages it made resident, end when the array and its views are dropped)."""
        if math.prod(self.shape) == 0:
            return np.zeros(self.shape, self.dtype)
        return np.asarray(np.memmap(self.file, self.dtype, mode="r", offset=self.offset, shape=self.shape))


def _data_offsets(file: Path) -> dict[str, int]:
    """Where each tensor's bytes start in a safetensors file. The format: an 8-byte little-endian length,
    a JSON header of that length naming each tensor's `data_offsets` from the end of the header. (The
    safetensors package reads a tensor by copying it out of its own map; a view of the pages lets the
    devices' copy be the only one.)"""
    with file.open("rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
    return {
        key: 8 + length + entry["data_offsets"][0] for key, entry in header.items() if key != "__metadata__"
    }


class _SafetensorsReader(_FileReader):
    def __init__(self, cfg: ModelConfig, path: Path, where: Mapping[str, _Stored]):
        super().__init__(cfg, path, self._fetch)
        self.where = where
        self.names = {w: hf for w, (_, hf) in _LAYER_TENSORS.items()}
        if cfg.architecture in GEMMA:
            self.names.update(_GEMMA_HF_TENSORS)
        if cfg.architecture == "mixtral":
            self.names.update(_MIXTRAL_HF_TENSORS)

    GLOBAL_KEYS = {
        "embed": "model.embed_tokens.weight",
        "final_norm": "model.norm.weight",
        "lm_head": "lm_head.weight",
    }

    def rows(self, key: str) -> int:
        return self.where[key].shape[0]

    def tensor(self, key: str, rows: slice = slice(None)) -> np.ndarray | None:
        stored = self.where.get(key)
        if stored is None:
            return None
        w = stored.mapped()[rows]
        self.bytes_read += w.nbytes
        return w

    def _fetch(self, i: int, weight: str) -> np.ndarray | None:
        name = f"model.layers.{i}.{self.names[weight]}"
        if "{e}" not in name:
            return self.tensor(name)
        experts = [self.tensor(name.format(e=e)) for e in range(self.cfg.num_experts)]
        missing = [e for e, w in enumerate(experts) if w is None]
        if missing:
            raise CheckpointError(f"{self.path} lacks {name} of experts {missing}")
        return np.stack(experts)

    def layer(self, i: int) -> dict[str, np.ndarray]:
        out = super().layer(i)
        if self.cfg.architecture in GEMMA:  # RMSNorm scales by (1 + weight): folded in, as llama.cpp does
            for key in [k for k in out if k.endswith("_norm")]:
                out[key] = out[key].astype(np.float32) + 1.0
        return out

    def global_tensor(self, name: str, vocab: slice = slice(None)) -> np.ndarray | None:
        w = super().global_tensor(name, vocab)
        if name == "final_norm" and self.cfg.architecture in GEMMA:  # (1 + weight), as in the layers
            w = w.astype(np.float32) + 1.0
        return w


class HostCheckpoint(Checkpoint):
    """A model's arrays held in memory, layers stacked on a leading axis (random test models; test fixtures
    that build many engines of one model)."""

    def __init__(self, config: ModelConfig, host: dict[str, np.ndarray], path: Path | None = None):
        if not config.weights_digest:  # (one read from a checkpoint keeps the checkpoint's digest)
            entries = ((k, w.dtype.name, w.shape, edge_rows(w) if w.size else b"") for k, w in host.items())
            config = dataclasses.replace(config, weights_digest=weights_digest(entries))
        self.config = config
        self.host, self.path = host, path or Path(config.name)
        self.nbytes = sum(w.nbytes for w in host.values())
        self.num_params = sum(w.size for w in host.values())

    @contextlib.contextmanager
    def reader(self) -> Iterator[LayerReader]:
        yield _HostReader(self)


class _HostReader(LayerReader):
    def __init__(self, checkpoint: HostCheckpoint):
        self.cfg, self.host = checkpoint.config, checkpoint.host

    def layer(self, i: int) -> dict[str, np.ndarray]:
        out = {}
        for name, w in self.host.items():
            layers = _layers_with(self.cfg, name) if name not in GLOBAL_TENSORS else range(0)
            if i in layers:
                out[name] = w[i - layers.start]
                self.bytes_read += out[name].nbytes
        return out

    def global_tensor(self, name: str, vocab: slice = slice(None)) -> np.ndarray | None:
        w = self.host.get(name)
        if w is None or name == "final_norm":
            return w
        return w[vocab] if name == "embed" else w[:, vocab]

    def vocab_size(self, name: str) -> int:
        w = self.host[name]
        return w.shape[0] if name == "embed" else w.shape[1]


def read_stacked(checkpoint: Checkpoint) -> dict[str, np.ndarray]:
    """Every array of `checkpoint` in memory as float32, layers stacked on a leading axis (over the layers
    that have them): a HostCheckpoint's arrays. Tests compare formats with it."""
    cfg = checkpoint.config
    with checkpoint.reader() as reader:
        layers = [reader.layer(i) for i in range(cfg.num_layers)]
        host = {name: reader.global_tensor(name) for name in GLOBAL_TENSORS}
        host = {name: w.astype(np.float32) for name, w in host.items() if w is not None}
    for name in _LAYER_TENSORS:
        per_layer = [layer[name] for layer in layers if name in layer]
        if per_layer:
            host[name] = np.stack(per_layer).astype(np.float32, copy=False)
    return host


def open_checkpoint(path: str | Path, name: str | None = None) -> GGUFCheckpoint | SafetensorsCheckpoint:
    """A GGUF file or a Hugging Face folder, its config read."""
    path = Path(path)
    if path.is_dir():
        return SafetensorsCheckpoint(path, name)
    if path.suffix == ".gguf":
        return GGUFCheckpoint(path, name)
    raise CheckpointError(f"{path}: expected a .gguf file or a Hugging Face folder")


def load_gguf(path: str | Path, name: str | None = None) -> tuple[ModelConfig, dict[str, np.ndarray], dict]:
    """A GGUF file read whole: (config, float32 arrays as read_stacked gives them, metadata)."""
    checkpoint = GGUFCheckpoint(path, name)
    return checkpoint.config, read_stacked(checkpoint), checkpoint.metadata


def load_hf_folder(path: str | Path, name: str | None = None) -> tuple[ModelConfig, dict[str, np.ndarray]]:
    """A Hugging Face folder read whole: (config, float32 arrays as read_stacked gives them)."""
    checkpoint = SafetensorsCheckpoint(path, name)
    return checkpoint.config, read_stacked(checkpoint)
