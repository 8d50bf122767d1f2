"""Where a model comes from: a checkpoint directory, a GGUF file (or a directory holding one),
a transformers model id already in the local Hugging Face cache, or (when none is named) the
tiny generated default. Nothing is downloaded."""

from __future__ import annotations

import os
from pathlib import Path

from halfmoon.engine.errors import ModelLoadError
from halfmoon.engine.gguf_source import converted_checkpoint, gguf_file
from halfmoon.engine.init_model import ensure_model


def resolve_model(model: str | None) -> Path:
    """The checkpoint directory for `model`; raises `ModelLoadError` saying what to pass instead."""
    if model is None:
        return ensure_model()
    path = Path(model).expanduser()
    gguf = gguf_file(path)
    if gguf is not None:
        return converted_checkpoint(gguf)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelLoadError(
                f"{model!r} is a directory with neither config.json nor a .gguf file: pass a "
                "Hugging Face checkpoint directory or a GGUF file, or run `halfmoon init-model "
                "DIR` to write the tiny model there"
            )
        return path
    cached = _cached_snapshot(model)
    if cached is not None:
        return cached
    raise ModelLoadError(
        f"model {model!r} does not exist: it is neither a checkpoint directory, a GGUF file nor a "
        "model id in the local Hugging Face cache (HF_HOME / HF_HUB_CACHE); halfmoon never "
        "downloads: fetch it first (e.g. `huggingface-cli download ID`), pass its directory, or "
        "omit --model for the tiny model"
    )


def _cached_snapshot(model_id: str) -> Path | None:
    """The cached snapshot of a hub id such as `Qwen/Qwen2.5-0.5B-Instruct`, or None."""
    if model_id.count("/") > 1 or model_id.startswith((".", "/", "~")):
        return None  # a path that does not exist, not a hub id
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    # Read the cache location now, not at import, so a changed HF_HUB_CACHE / HF_HOME counts.
    hf_home = os.environ.get("HF_HOME")
    cache_dir = os.environ.get("HF_HUB_CACHE") or (
        str(Path(hf_home) / "hub") if hf_home else constants.HF_HUB_CACHE
    )
    try:
        snapshot = Path(snapshot_download(model_id, cache_dir=cache_dir, local_files_only=True))
    except (LocalEntryNotFoundError, HFValidationError, OSError):
        return None
    return snapshot if (snapshot / "config.json").is_file() else None
