"""The default model cut to its first layers: real weights, the real tokenizer and chat template, a
fraction of the compute. Most engine and daemon tests compare pdserve with itself (disaggregated with
colocated, batched with alone, TP 2 with TP 1, cached with uncached), which any real model shows; the
parity tests against transformers keep the whole model.

The cut is a GGUF file like the original: its metadata with `<arch>.block_count` lowered, and the tensors
of the layers kept, bytes unchanged (gguf's own metadata copier writes it).
"""

from __future__ import annotations

import re
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


def small_model(num_layers: int = TEST_MODEL_LAYERS) -> Path:
    """The default model's first `num_layers` layers, written next to it in the cache folder."""
    source = fetch(DEFAULT_MODEL, progress=False)
    return first_layers(
        source, num_layers, cache_dir() / f"{DEFAULT_MODEL}-{num_layers}-layers" / source.name
    )
