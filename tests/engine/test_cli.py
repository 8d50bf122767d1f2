"""The command line: init-model writes a checkpoint transformers loads; generate --local --json."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import torch


def test_init_model_is_loadable_by_transformers_with_a_chat_template(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from halfmoon.cluster.cli import main

    assert main(["init-model", str(tmp_path / "m")]) == 0
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "m")
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "m")
    ids = tokenizer.encode("héllo")
    assert tokenizer.decode(ids) == "héllo"
    assert model(torch.tensor([ids])).logits.shape == (1, len(ids), len(tokenizer))
    chat = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert chat == "<|user|>hi</s><|assistant|>"


def test_init_model_is_deterministic(tmp_path):
    from halfmoon.engine.init_model import init_model

    a, b = init_model(tmp_path / "a"), init_model(tmp_path / "b")
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()


def generate_local(model_dir, *args: str, check: bool = False) -> subprocess.CompletedProcess:
    """Run `halfmoon generate --local --model MODEL_DIR ARGS` in a fresh process."""
    command = ["generate", "--local", "--model", str(model_dir), *args]
    return subprocess.run(
        [sys.executable, "-m", "halfmoon.cluster.cli", *command],
        capture_output=True,
        text=True,
        check=check,
        env={**os.environ, "TQDM_DISABLE": "1"},
    )


def test_generate_local_json_matches_offline_engine(tiny_model_dir, tiny_llm):
    from halfmoon.engine import SamplingParams

    out = generate_local(tiny_model_dir, "--max-tokens", "8", "--json", "Hello there", check=True)
    result = json.loads(out.stdout)
    expected = tiny_llm.generate(["Hello there"], SamplingParams(max_tokens=8, temperature=0.0))[0]
    assert result["token_ids"] == expected.token_ids
    assert result["text"] == expected.text
    assert result["finish_reason"] == expected.finish_reason
    assert result["usage"]["prompt_tokens"] == 11


def test_generate_bad_input_exits_2_with_the_field(tiny_model_dir):
    out = generate_local(tiny_model_dir, "--top-p", "2", "x")
    assert out.returncode == 2
    assert "top_p=2.0 is invalid" in out.stderr
