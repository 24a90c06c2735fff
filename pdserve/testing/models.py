"""The test model: the default model cut to its first layers. Real weights, the real tokenizer and chat
template, a fraction of the compute. Most engine and daemon tests compare pdserve with itself
(disaggregated with colocated, batched with alone, TP 2 with TP 1, cached with uncached), which any real
model shows; the parity tests against transformers keep the whole model.

Two forms, both kept in the cache folder next to the default model:
- `small_gguf()`: a GGUF file like the original, its metadata with `<arch>.block_count` lowered and the
  tensors of the layers kept, bytes unchanged (gguf's own metadata copier writes it);
- `small_model()`: the same weights as a Hugging Face folder (config.json, safetensors in float32,
  tokenizer.json), written by transformers from that GGUF file (the reference extra). It holds the values
  the GGUF loader dequantizes, and a daemon starts on it in a third of the time: reading GGUF metadata (the
  49k-token vocabulary) costs seconds, which every daemon a test starts would pay.

`bench_model(smoke)`: what a benchmark runs on, the test model for its `--smoke` run, else the default.
"""

from __future__ import annotations

import json
import re
import shutil
import tempfile
import types
from pathlib import Path

import gguf
from gguf.scripts.gguf_new_metadata import MetadataDetails, copy_with_new_metadata

from pdserve.engine.loading.sources import DEFAULT_MODEL, cache_dir, fetch

TEST_MODEL_LAYERS = 4  # of SmolLM2-135M's 30
_LAYER = re.compile(r"^blk\.(\d+)\.")


def first_layers(source: Path, num_layers: int, target: Path) -> Path:
    """Writes a GGUF file of `source`'s first `num_layers` layers to `target` (once: an existing file is
    kept); returns `target`."""
    if target.is_file():
        return target
    reader = gguf.GGUFReader(source)
    arch = reader.get_field(gguf.Keys.General.ARCHITECTURE).contents()
    block_count = gguf.Keys.LLM.BLOCK_COUNT.format(arch=arch)
    total = reader.get_field(block_count).contents()
    if not 0 < num_layers <= total:
        raise ValueError(f"{source.name} has {total} layers; cannot keep {num_layers}")

    def kept(tensor) -> bool:
        layer = _LAYER.match(tensor.name)
        return layer is None or int(layer.group(1)) < num_layers

    cut = types.SimpleNamespace(  # the reader, less the tensors of the dropped layers
        fields=reader.fields, tensors=[t for t in reader.tensors if kept(t)], endianess=reader.endianess
    )
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_suffix(".partial")
    writer = gguf.GGUFWriter(partial, arch=arch, endianess=reader.endianess)
    copy_with_new_metadata(
        cut, writer, {block_count: MetadataDetails(gguf.GGUFValueType.UINT32, num_layers)}, []
    )
    partial.rename(target)
    return target


def hf_folder(gguf_file: Path, target: Path) -> Path:
    """Writes `gguf_file` as a Hugging Face folder at `target` (once), through transformers: its GGUF
    loader dequantizes the weights to float32 as pdserve's does; returns `target`."""
    if (target / "config.json").is_file():
        return target
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_file = Path(gguf_file)
    model = AutoModelForCausalLM.from_pretrained(
        gguf_file.parent, gguf_file=gguf_file.name, dtype=torch.float32
    )
    tokenizer = AutoTokenizer.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name)
    target.parent.mkdir(parents=True, exist_ok=True)
    folder = Path(tempfile.mkdtemp(dir=target.parent, prefix=".partial-"))
    try:
        tied = {"lm_head.weight"} if model.config.tie_word_embeddings else set()
        state = {k: v.contiguous() for k, v in model.state_dict().items() if k not in tied}
        save_file(state, folder / "model.safetensors")
        config = model.config.to_dict()
        config.pop("quantization_config", None)
        config["architectures"] = [type(model).__name__]  # what loaders other than transformers dispatch on
        (folder / "config.json").write_text(json.dumps(config, indent=1))
        tokenizer.save_pretrained(folder)
        shutil.rmtree(target, ignore_errors=True)  # a folder left without config.json
        folder.rename(target)
    except BaseException:
        shutil.rmtree(folder, ignore_errors=True)
        raise
    return target


def small_gguf(num_layers: int = TEST_MODEL_LAYERS) -> Path:
    """The default model's first `num_layers` layers as a GGUF file."""
    source = fetch(DEFAULT_MODEL, progress=False)
    return first_layers(
        source, num_layers, cache_dir() / f"{DEFAULT_MODEL}-{num_layers}-layers" / source.name
    )


def small_model(num_layers: int = TEST_MODEL_LAYERS) -> Path:
    """The test model: the default model's first `num_layers` layers as a Hugging Face folder."""
    name = f"SmolLM2-135M-Instruct-{num_layers}-layers"
    return hf_folder(small_gguf(num_layers), cache_dir() / f"{DEFAULT_MODEL}-{num_layers}-layers" / name)


def bench_model(smoke: bool) -> Path:
    """The model a benchmark runs on: the test model for a `--smoke` run (it only shows the script still
    runs), else the default model's GGUF file (fetched once into the cache folder)."""
    return small_model() if smoke else fetch(DEFAULT_MODEL, progress=False)
