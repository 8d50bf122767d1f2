"""`load_tokenizer` hands AutoTokenizer a generic config (to skip importing the model's config
class): the tokenizer must be the one AutoTokenizer picks on its own."""

from __future__ import annotations

import json
import shutil

import pytest

from halfmoon.engine.tokenizer import _light_config, load_tokenizer

SAMPLES = ["Hello, world!", "  two  spaces\nand a newline", "ünïcödé ✓ 漢字", ""]


def _same(ours, theirs) -> None:
    assert type(ours) is type(theirs)
    for text in SAMPLES:
        ids = theirs.encode(text)
        assert ours.encode(text) == ids
        assert ours.decode(ids) == theirs.decode(ids)
    for attr in ("eos_token_id", "bos_token_id", "pad_token_id", "chat_template"):
        assert getattr(ours, attr) == getattr(theirs, attr), attr
    messages = [{"role": "user", "content": "hi"}]
    if theirs.chat_template:
        assert ours.apply_chat_template(messages) == theirs.apply_chat_template(messages)


def test_every_test_checkpoint_gets_the_tokenizer_autotokenizer_picks(checkpoints):
    from transformers import AutoTokenizer

    for name, path in checkpoints.items():
        assert _light_config(path), f"{name}: the light path is taken"
        _same(load_tokenizer(path), AutoTokenizer.from_pretrained(path))


@pytest.mark.parametrize(
    "declared", ["PreTrainedTokenizerFast", "LlamaTokenizerFast", "Qwen2Tokenizer", None]
)
def test_declared_tokenizer_classes_resolve_as_autotokenizer_resolves_them(
    tiny_model_dir, tmp_path, declared
):
    from transformers import AutoTokenizer

    path = tmp_path / "model"
    shutil.copytree(tiny_model_dir, path)
    file = path / "tokenizer_config.json"
    settings = json.loads(file.read_text())
    settings.pop("tokenizer_class", None)
    if declared is not None:
        settings["tokenizer_class"] = declared
    file.write_text(json.dumps(settings))
    assert bool(_light_config(path)) == (declared is not None)
    _same(load_tokenizer(path), AutoTokenizer.from_pretrained(path))
