"""A GGUF file as a model, as `vllm serve model.gguf` takes one: dequantized once, through
transformers' GGUF loader, into a plain safetensors checkpoint under `$HALFMOON_CACHE/gguf`,
which every engine then loads like any other checkpoint directory.

The conversion keeps the file's tokenizer, chat template and special tokens, writes the weights
in fp32 (what the quantized blocks dequantize to; `--dtype` casts them at load, as for any
checkpoint) and leaves the output head out when the file ties it to the embeddings. The cached
directory is named by the file's stem and a key over its size and bytes at both ends (not its
path or time: the same file gets the same directory on every node), so a changed file is
converted again.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

from halfmoon.engine.errors import ModelLoadError
from halfmoon.engine.init_model import cache_root
from halfmoon.engine.model_config import SUPPORTED_ARCHITECTURES

log = logging.getLogger(__name__)
VERSION = 1  # of the conversion's recipe: a change converts every cached file again
SAMPLE_BYTES = 8 << 20  # read from each end of the file for its cache key

# GGUF's `general.architecture` names of the architectures halfmoon serves.
GGUF_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
assert set(GGUF_ARCHITECTURES.values()) <= set(SUPPORTED_ARCHITECTURES)


def gguf_file(path: Path) -> Path | None:
    """The GGUF file `path` names: itself, or the only `.gguf` in a directory that holds no
    checkpoint (no config.json); None where `path` is neither."""
    if path.is_file() and path.suffix.lower() == ".gguf":
        return path
    if not path.is_dir() or (path / "config.json").is_file():
        return None
    found = sorted(p for p in path.iterdir() if p.suffix.lower() == ".gguf" and p.is_file())
    if len(found) > 1:
        names = ", ".join(p.name for p in found)
        raise ModelLoadError(
            f"{path} holds {len(found)} GGUF files ({names}): pass the one to serve as --model"
        )
    return found[0] if found else None


def converted_checkpoint(gguf: Path) -> Path:
    """The safetensors checkpoint of `gguf`, converting it on first use (one process at a
    time; the others wait and take its result)."""
    gguf = gguf.resolve()
    target = cache_root() / "gguf" / f"{gguf.stem}-{cache_key(gguf)}"
    if (target / "config.json").is_file():
        return target
    architecture = gguf_architecture(gguf)
    if architecture not in GGUF_ARCHITECTURES:
        raise ModelLoadError(
            f"{gguf.name} is a GGUF model of architecture {architecture!r}, which halfmoon does "
            f"not serve; GGUF architectures served: {', '.join(sorted(GGUF_ARCHITECTURES))}"
        )
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (target / "config.json").is_file():
            _convert(gguf, architecture, target)
    return target


def gguf_architecture(gguf: Path) -> str:
    """The file's `general.architecture` (its metadata only is read)."""
    from gguf import GGUFReader

    try:
        field = GGUFReader(gguf).get_field("general.architecture")
    except (ValueError, OSError) as error:
        raise ModelLoadError(f"{gguf} is not a readable GGUF file: {error}") from error
    if field is None:
        raise ModelLoadError(f"{gguf} has no general.architecture: not a GGUF model file")
    return field.contents()


def cache_key(gguf: Path) -> str:
    """12 hex digits over the recipe's version, the file's size and its first and last
    SAMPLE_BYTES (its metadata, tokenizer and first tensors; its last ones): the same on every
    node that holds the same file, wherever it is and whenever it was copied."""
    size = gguf.stat().st_size
    digest = hashlib.sha256(json.dumps([VERSION, size]).encode())
    with open(gguf, "rb") as file:
        digest.update(file.read(SAMPLE_BYTES))
        file.seek(max(0, size - SAMPLE_BYTES))
        digest.update(file.read(SAMPLE_BYTES))
    return digest.hexdigest()[:12]


def _convert(gguf: Path, architecture: str, target: Path) -> None:
    """Dequantize `gguf` with transformers and write config, tokenizer and safetensors weights
    to `target`, atomically (a half-written directory is never seen)."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log.warning(
        "converting %s (%.0f MB) to a safetensors checkpoint, once: %s",
        gguf.name,
        gguf.stat().st_size / 1e6,
        target,
    )
    source, name = str(gguf.parent), gguf.name
    tokenizer = AutoTokenizer.from_pretrained(source, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(source, gguf_file=name, dtype=torch.float32)
    config = model.config
    config.architectures = [GGUF_ARCHITECTURES[architecture]]
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # the weights written are plain fp32
    weights = {name: tensor.contiguous() for name, tensor in model.state_dict().items()}
    if config.tie_word_embeddings:
        weights.pop("lm_head.weight", None)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        save_file(weights, staging / "model.safetensors", metadata={"format": "pt"})
        config.save_pretrained(staging)
        model.generation_config.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        os.replace(staging, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
