"""The default model: a tiny Llama-architecture checkpoint made deterministically on first use."""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

from halfmoon.engine.errors import ModelLoadError

CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>{{ message['content'] }}</s>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
SPECIAL_TOKENS = ["<s>", "</s>", "<pad>", "<|system|>", "<|user|>", "<|assistant|>"]


@dataclass(slots=True)
class TinyModelShape:
    """Sizes of a generated checkpoint (`SHAPES` names the ones halfmoon makes)."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    max_position_embeddings: int = 4096
    # Rows of the embedding and the head; None: the tokenizer's 262. More pads them with ids no
    # token maps to, as real checkpoints do (Qwen2: 151,936 rows for 151,665 tokens), so the
    # sampler and the grammar masks run at a real vocabulary's width.
    vocab_size: int | None = None


# The checkpoints `init-model` and the benchmarks make, by name; columns: hidden, intermediate,
# layers, attention heads, KV heads (every one with a 4k context).
SHAPES = {
    "tiny": TinyModelShape(128, 352, 4, 4, 2),  # ~1M parameters: the serving default
    "bench": TinyModelShape(512, 1792, 14, 8, 4),  # ~50M: the CPU benchmarks' model
    # ~4M in 32 layers of width 128: a prefill dominated by per-layer host work, as an eager
    # GPU prefill is (issue 51: the prefill worker's overhead seen on CPU).
    "launch": TinyModelShape(128, 352, 32, 4, 2),
    "gpu": TinyModelShape(2048, 5632, 16, 32, 8),  # ~0.9B: the GPU issues' figures were measured at
    # The tiny model at Qwen2's vocabulary width (~40M parameters, nearly all embedding and head).
    "wide-vocab": TinyModelShape(128, 352, 4, 4, 2, vocab_size=151_936),
}


def cache_root() -> Path:
    """`$HALFMOON_CACHE`, by default `~/.cache/halfmoon`."""
    cache = (
        os.environ.get("HALFMOON_CACHE")
        or Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "halfmoon"
    )
    return Path(cache)


def default_model_dir() -> Path:
    """`$HALFMOON_CACHE/tiny-llama`, by default `~/.cache/halfmoon/tiny-llama`."""
    return cache_root() / "tiny-llama"


def ensure_model(model_dir: str | Path | None = None, shape: TinyModelShape | None = None) -> Path:
    """Return `model_dir` (default: the cached tiny model), creating the checkpoint if absent."""
    path = Path(model_dir) if model_dir else default_model_dir()
    if not (path / "config.json").is_file():
        init_model(path, shape or SHAPES["tiny"])
    return path


def build_tokenizer():
    """A byte-level tokenizer: 256 byte tokens plus the special tokens, no merges."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS)}
    for symbol in sorted(alphabet):
        vocab[symbol] = len(vocab)
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    core.add_special_tokens(SPECIAL_TOKENS)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core, bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def init_model(model_dir: str | Path, shape: TinyModelShape | None = None, seed: int = 0) -> Path:
    """Write a Llama checkpoint with seeded random weights and the byte-level tokenizer."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    path = Path(model_dir)
    if path.exists() and any(path.iterdir()):
        raise ModelLoadError(f"{path} exists and is not empty; choose a new directory")
    tokenizer = build_tokenizer()
    sizes = asdict(shape or SHAPES["tiny"])
    vocab_size = sizes.pop("vocab_size") or len(tokenizer)
    if vocab_size < len(tokenizer):
        raise ModelLoadError(f"vocab_size {vocab_size} is below the tokenizer's {len(tokenizer)}")
    config = LlamaConfig(
        vocab_size=vocab_size,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
        **sizes,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{path.name}-", dir=path.parent))
    model.save_pretrained(staging)
    tokenizer.save_pretrained(staging)
    try:
        if path.exists():
            path.rmdir()
        os.replace(staging, path)
    except OSError:
        # Another process created it first; theirs is as good as ours.
        shutil.rmtree(staging, ignore_errors=True)
        if not (path / "config.json").is_file():
            raise
    return path
