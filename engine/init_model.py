"""The default model: a tiny Llama-architecture checkpoint made deterministically on first use;
and tiny checkpoints of the other architectures (`init-model --arch`), mixtures of experts too."""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass
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
    # A mixture of experts (0: dense): per token `num_experts_per_tok` of `num_experts` MLPs of
    # `moe_intermediate_size`; `intermediate_size` is then the Qwen2-MoE shared expert's.
    num_experts: int = 0
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 0

    def dense_sizes(self) -> dict:
        """The sizes every architecture's transformers config takes, by its names."""
        return {
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "max_position_embeddings": self.max_position_embeddings,
        }


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
    # Mixtures of experts (`--arch mixtral|qwen2-moe|qwen3-moe`): ~0.3M, the MoE default; and
    # ~52M total (~6M active per token: 2 of 32 experts) for `bench engine`.
    "tiny-moe": TinyModelShape(64, 128, 2, 4, 2, num_experts=4, moe_intermediate_size=32),
    "moe": TinyModelShape(256, 512, 8, 8, 4, num_experts=32, moe_intermediate_size=256),
}
# `init-model --arch`: the transformers architecture each name writes.
ARCHES = {
    "llama": "LlamaForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen2-moe": "Qwen2MoeForCausalLM",
    "qwen3-moe": "Qwen3MoeForCausalLM",
}


def model_config(arch: str, shape: TinyModelShape, tokenizer):
    """The transformers config of an `arch` checkpoint of `shape`, with `tokenizer`'s ids."""
    from transformers import LlamaConfig, MixtralConfig, Qwen2MoeConfig, Qwen3MoeConfig

    if arch not in ARCHES:
        raise ModelLoadError(f"unknown architecture {arch!r}; choose one of {', '.join(ARCHES)}")
    if arch == "llama" and shape.num_experts:
        raise ModelLoadError("--arch llama is dense: choose a shape without experts")
    if arch != "llama" and not shape.num_experts:
        moe_shapes = ", ".join(name for name, each in SHAPES.items() if each.num_experts)
        raise ModelLoadError(f"--arch {arch} needs a shape with experts: {moe_shapes}")
    common = dict(
        shape.dense_sizes(),
        vocab_size=shape.vocab_size or len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
    )
    if arch == "mixtral":  # its experts are `intermediate_size` wide, and always renormalised
        common["intermediate_size"] = shape.moe_intermediate_size
        return MixtralConfig(
            **common,
            num_local_experts=shape.num_experts,
            num_experts_per_tok=shape.num_experts_per_tok,
        )
    if arch == "llama":
        return LlamaConfig(**common)
    moe = dict(
        num_experts=shape.num_experts,
        num_experts_per_tok=shape.num_experts_per_tok,
        moe_intermediate_size=shape.moe_intermediate_size,
    )
    if arch == "qwen2-moe":  # with a shared expert `intermediate_size` wide
        return Qwen2MoeConfig(
            **common, **moe, shared_expert_intermediate_size=common["intermediate_size"]
        )
    return Qwen3MoeConfig(**common, **moe, norm_topk_prob=True)


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


def ensure_model(
    model_dir: str | Path | None = None, shape: TinyModelShape | None = None, arch: str = "llama"
) -> Path:
    """Return `model_dir` (default: the cached tiny model), creating the checkpoint if absent
    (an `arch` one of `shape`, as `init_model` writes it)."""
    path = Path(model_dir) if model_dir else default_model_dir()
    if not (path / "config.json").is_file():
        init_model(path, shape, arch=arch)
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


def init_model(
    model_dir: str | Path, shape: TinyModelShape | None = None, seed: int = 0, arch: str = "llama"
) -> Path:
    """Write an `arch` checkpoint (one of `ARCHES`) of `shape` (by default "tiny", or
    "tiny-moe" for a mixture of experts) with seeded random weights and the byte-level
    tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM

    path = Path(model_dir)
    if path.exists() and any(path.iterdir()):
        raise ModelLoadError(f"{path} exists and is not empty; choose a new directory")
    tokenizer = build_tokenizer()
    config = model_config(
        arch, shape or SHAPES["tiny" if arch == "llama" else "tiny-moe"], tokenizer
    )
    if config.vocab_size < len(tokenizer):
        raise ModelLoadError(
            f"vocab_size {config.vocab_size} is below the tokenizer's {len(tokenizer)}"
        )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
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
