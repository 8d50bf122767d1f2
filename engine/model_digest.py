"""A checkpoint's identity: its name plus a digest of every byte the model is built from.

Block keys start from it (`LLMEngine`), so two checkpoints share cached KV, through a Redis
shared across clusters, only if their config and every weight byte are equal: a fine-tune that
keeps its base model's shapes, and so its safetensors headers, still gets keys of its own.

Hashing reads the whole checkpoint (about 2 GB/s with SHA extensions), so the digest is computed
once and kept under `$HALFMOON_CACHE/model-digests`, keyed by the checkpoint's path and checked
against each file's size, inode and modification time: a file rewritten is hashed again.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import stat
import tempfile
from pathlib import Path

from halfmoon.engine.init_model import cache_root
from halfmoon.engine.loader import checkpoint_files

log = logging.getLogger(__name__)
VERSION = 1  # of the digest's recipe: a change makes every cached digest stale


def model_identity(model_dir: Path) -> str:
    """`<directory name>@<16 hex digits>`: equal across nodes that hold the same checkpoint,
    different for checkpoints that differ in any config or weight byte."""
    return f"{model_dir.resolve().name}@{checkpoint_digest(model_dir)[:16]}"


def checkpoint_digest(model_dir: Path) -> str:
    """SHA-256 over `config.json` and each weight file's name, size and bytes (cached)."""
    files = [model_dir / "config.json", *checkpoint_files(model_dir)]
    stamp = {"version": VERSION, "files": [_stamp(path) for path in files]}
    record = _record_path(model_dir)
    cached = _read_record(record)
    if cached is not None and cached.get("stamp") == stamp:
        return cached["digest"]
    size = sum(entry[1] for entry in stamp["files"])
    log.info("hashing the checkpoint %s (%.1f GiB), once", model_dir, size / 2**30)
    digest = hashlib.sha256()
    for path in files:
        digest.update(f"{path.name}\0{path.stat().st_size}\0".encode())
        with path.open("rb") as source:
            digest.update(hashlib.file_digest(source, "sha256").digest())
    _write_record(record, {"stamp": stamp, "digest": digest.hexdigest()})
    return digest.hexdigest()


def _stamp(path: Path) -> list:
    info = path.stat()
    return [path.name, info.st_size, info.st_ino, info.st_mtime_ns]


def _record_path(model_dir: Path) -> Path:
    key = hashlib.sha256(str(model_dir.resolve()).encode()).hexdigest()[:24]
    return cache_root() / "model-digests" / f"{key}.json"


def _read_record(record: Path) -> dict | None:
    """The cached record, unless absent, unreadable, or writable by someone else (who could
    then make two checkpoints share keys)."""
    try:
        info = record.stat()
        if info.st_uid != os.getuid() or info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            return None
        loaded = json.loads(record.read_text())
    except (OSError, ValueError):
        return None
    return loaded if isinstance(loaded, dict) and isinstance(loaded.get("digest"), str) else None


def _write_record(record: Path, content: dict) -> None:
    """Written atomically; a cache that cannot be written only costs hashing again."""
    try:
        record.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        fd, scratch = tempfile.mkstemp(dir=record.parent, suffix=".tmp")
        with os.fdopen(fd, "w") as out:
            json.dump(content, out)
        os.replace(scratch, record)
    except OSError as error:
        log.warning("could not cache the checkpoint digest at %s: %s", record, error)
