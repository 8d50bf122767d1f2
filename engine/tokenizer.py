"""Prompts to token ids: text, token-id lists and chat messages."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Union

from halfmoon.engine.errors import InvalidRequestError, ModelLoadError

Prompt = Union[str, list[int], list[dict]]  # noqa: UP007 - a runtime alias
# For tokenizers without a chat template: one `role: content` line per message, then
# `assistant:` for the model to continue.
DEFAULT_CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n"
    "{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}"
)


def load_tokenizer(model_dir: Path):
    """The checkpoint's tokenizer, through `transformers.AutoTokenizer`."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(model_dir, **_light_config(Path(model_dir)))
    except (OSError, ValueError) as error:
        raise ModelLoadError(f"cannot load a tokenizer from {model_dir}: {error}") from error


def _light_config(model_dir: Path) -> dict:
    """`config=` for AutoTokenizer when tokenizer_config.json names the tokenizer class.

    AutoTokenizer loads the model's config to choose a class, and importing the model's config
    class costs ~3 s of CPU (it pulls in torch.distributed), paid by every worker and router.
    When the checkpoint names its tokenizer class (and has no custom code), AutoTokenizer
    reads only `model_type` and `tokenizer_class` from the config, which the generic config
    class holds as well. tests/engine/test_tokenizer_load.py compares both ways."""
    from transformers import PretrainedConfig  # the name in transformers 4 and 5

    try:
        declared = json.loads((model_dir / "tokenizer_config.json").read_text())
        config = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError):
        return {}  # AutoTokenizer's own path, and its own error
    if not isinstance(declared, dict) or not isinstance(config, dict):
        return {}
    if not declared.get("tokenizer_class") or "auto_map" in declared or "auto_map" in config:
        return {}
    light = PretrainedConfig.from_dict(config)
    light._name_or_path = str(model_dir)
    return {"config": light}


def tokenize_prompt(tokenizer, prompt: Prompt, vocab_size: int) -> list[int]:
    """Token ids of a prompt; chat messages go through the model's chat template."""
    if isinstance(prompt, str):
        token_ids = tokenizer.encode(prompt) if prompt else []
    elif isinstance(prompt, list) and prompt and all(isinstance(m, dict) for m in prompt):
        token_ids = _apply_chat_template(tokenizer, prompt)
    elif isinstance(prompt, list) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in prompt
    ):
        token_ids = list(prompt)
        bad = [t for t in token_ids if not 0 <= t < vocab_size]
        if bad:
            raise InvalidRequestError(
                "prompt_token_ids", bad[:5], f"ids must be in [0, {vocab_size})"
            )
    else:
        raise InvalidRequestError(
            "prompt",
            type(prompt).__name__,
            "a string, a list of token ids or a list of chat messages",
        )
    if not token_ids:
        raise InvalidRequestError("prompt", prompt, "must not be empty")
    return token_ids


def _apply_chat_template(tokenizer, messages: list[dict]) -> list[int]:
    for i, message in enumerate(messages):
        if not isinstance(message.get("role"), str) or not isinstance(message.get("content"), str):
            raise InvalidRequestError(
                f"messages[{i}]", message, "each message needs a string 'role' and 'content'"
            )
    template = None if getattr(tokenizer, "chat_template", None) else DEFAULT_CHAT_TEMPLATE
    encoded = tokenizer.apply_chat_template(
        messages, chat_template=template, add_generation_prompt=True, tokenize=True
    )
    if isinstance(encoded, dict) or hasattr(encoded, "input_ids"):
        encoded = encoded["input_ids"]
    return list(encoded)
