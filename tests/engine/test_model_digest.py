"""A checkpoint's identity covers every weight byte, and is hashed once per checkpoint."""

from __future__ import annotations

import hashlib
import os
import shutil

import pytest

from halfmoon.engine import model_digest
from halfmoon.engine.loader import checkpoint_files
from halfmoon.engine.model_digest import model_identity


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("HALFMOON_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache" / "model-digests"


def _copy(checkpoint, parent):
    return shutil.copytree(checkpoint, parent / checkpoint.name)


def _flip_last_weight_byte(model_dir):
    """A fine-tune of the base: the same shapes and headers, one weight byte changed, far past
    the first 64 KiB of the first shard."""
    shard = checkpoint_files(model_dir)[-1]
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0x01
    shard.write_bytes(bytes(data))


def test_copies_share_an_identity_and_a_fine_tune_does_not(checkpoints, tmp_path, cache):
    base = _copy(checkpoints["llama-sharded"], tmp_path / "a")
    copy = _copy(checkpoints["llama-sharded"], tmp_path / "b")
    tuned = _copy(checkpoints["llama-sharded"], tmp_path / "c")
    _flip_last_weight_byte(tuned)
    assert model_identity(base) == model_identity(copy)
    assert model_identity(tuned) != model_identity(base)
    assert model_identity(tuned).startswith(base.name + "@")


def test_the_digest_is_hashed_once_and_again_when_a_file_changes(
    checkpoints, tmp_path, cache, monkeypatch
):
    model_dir = _copy(checkpoints["llama"], tmp_path)
    first = model_identity(model_dir)
    reads = []
    file_digest = hashlib.file_digest
    monkeypatch.setattr(hashlib, "file_digest", lambda f, d: reads.append(f) or file_digest(f, d))
    assert model_identity(model_dir) == first and not reads, "served from the cache"
    _flip_last_weight_byte(model_dir)
    assert model_identity(model_dir) != first and reads, "the changed file is hashed again"


def test_a_record_others_may_write_is_not_believed(checkpoints, tmp_path, cache, monkeypatch):
    model_dir = _copy(checkpoints["llama"], tmp_path)
    honest = model_identity(model_dir)
    (record,) = cache.iterdir()
    record.write_text(
        record.read_text().replace(model_digest.checkpoint_digest(model_dir), "f" * 64)
    )
    os.chmod(record, 0o666)
    assert model_identity(model_dir) == honest
