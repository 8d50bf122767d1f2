"""Model options like `vllm serve`: where the model comes from, its context, the KV budget."""

from __future__ import annotations

import shutil
from types import SimpleNamespace

import pytest

from halfmoon.cluster.cli import build_parser, main
from halfmoon.cluster.serve_cli import parse_bytes
from halfmoon.engine import LLM, SamplingParams
from halfmoon.engine.errors import ModelLoadError
from halfmoon.engine.kv_sizing import (
    CPU_KV_CACHE_BYTES,
    CUDA_RUNTIME_BYTES,
    SAMPLER_COPIES,
    DeviceMemory,
    GiB,
    activation_bytes,
    forward_bytes,
    kv_budget_bytes,
    page_bytes,
    plan_num_pages,
    sampler_bytes,
    unbudgeted_cuda_bytes,
)
from halfmoon.engine.model_source import resolve_model


def _hub_cache(tmp_path, model_dir, repo_id="halfmoon-test/tiny-llama"):
    """A local Hugging Face cache holding `model_dir` as `repo_id` (the hub's on-disk layout)."""
    repo = tmp_path / "hub" / ("models--" + repo_id.replace("/", "--"))
    shutil.copytree(model_dir, repo / "snapshots" / "0123abcd")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0123abcd")
    return tmp_path / "hub"


def test_a_missing_model_path_is_an_error_and_nothing_is_created(tmp_path):
    missing = tmp_path / "some" / "missing-path"
    with pytest.raises(ModelLoadError, match="does not exist.*never downloads"):
        resolve_model(str(missing))
    assert not missing.exists()
    with pytest.raises(ModelLoadError, match="does not exist"):
        resolve_model("nobody/not-in-the-cache")


def test_a_model_id_in_the_local_hub_cache_serves_like_its_directory(
    tmp_path, monkeypatch, tiny_model_dir, tiny_llm
):
    monkeypatch.setenv("HF_HUB_CACHE", str(_hub_cache(tmp_path, tiny_model_dir)))
    resolved = resolve_model("halfmoon-test/tiny-llama")
    assert resolved.name == "0123abcd" and (resolved / "config.json").is_file()
    params = SamplingParams(max_tokens=6, temperature=0.0)
    by_id = LLM("halfmoon-test/tiny-llama", num_pages=64).generate(["Hello"], params)
    assert by_id[0].token_ids == tiny_llm.generate(["Hello"], params)[0].token_ids


def test_no_model_means_the_generated_tiny_model(tmp_path, monkeypatch):
    monkeypatch.setenv("HALFMOON_CACHE", str(tmp_path))
    assert resolve_model(None) == tmp_path / "tiny-llama"
    assert (tmp_path / "tiny-llama" / "config.json").is_file()


def test_max_model_len_beyond_the_model_is_an_error(tiny_model_dir):
    with pytest.raises(ModelLoadError, match="exceeds the model's context of 4096"):
        LLM(str(tiny_model_dir), max_model_len=5000)


def test_max_model_len_the_kv_cache_cannot_hold_is_an_error(tiny_model_dir):
    with pytest.raises(ModelLoadError, match="holds 64 tokens.*max_model_len=100"):
        LLM(str(tiny_model_dir), num_pages=4, max_model_len=100)


def test_max_model_len_limits_prompts_with_the_limit_in_the_message(tiny_model_dir):
    llm = LLM(str(tiny_model_dir), max_model_len=256)
    assert llm.engine.max_model_len == 256
    with pytest.raises(ValueError, match="shorter than the context length of 256 tokens"):
        llm.engine.add_request("x" * 300)


def test_kv_cache_memory_sets_the_page_count(tiny_model_dir):
    llm = LLM(str(tiny_model_dir), kv_cache_memory_bytes=10 << 20)
    engine = llm.engine
    per_page = page_bytes(engine.model_config, 16, engine.dtype)
    assert per_page == 2 * 4 * 16 * 2 * 32 * 4  # K and V, 4 layers, 16 tokens, 2 heads of 32, fp32
    assert engine.num_pages == (10 << 20) // per_page == 320
    assert engine.max_model_len == min(4096, 320 * 16)


def test_gpu_budget_is_the_share_minus_weights_and_activations_within_free_memory():
    memory = DeviceMemory(total_bytes=80 * GiB, free_bytes=78 * GiB, weights_bytes=2 * GiB)
    assert kv_budget_bytes(None, 0.5, memory, 1 * GiB) == 40 * GiB - 3 * GiB
    crowded = DeviceMemory(total_bytes=80 * GiB, free_bytes=20 * GiB, weights_bytes=2 * GiB)
    assert kv_budget_bytes(None, 0.9, crowded, 1 * GiB) == 19 * GiB
    assert kv_budget_bytes(5 * GiB, 0.9, crowded, 1 * GiB) == 5 * GiB
    assert kv_budget_bytes(None, 0.9, None, 1 * GiB) == CPU_KV_CACHE_BYTES
    with pytest.raises(ModelLoadError, match="no GPU memory left.*--gpu-memory-utilization"):
        kv_budget_bytes(None, 0.02, memory, 1 * GiB)


def test_a_cuda_budget_leaves_room_for_the_runtime_and_the_decode_graphs_pool():
    # Found on the first GPU run: two engines at 0.27 of an H200 each held ~50 MB past it.
    cfg = SimpleNamespace(hidden_size=2048, intermediate_size=5632, vocab_size=32000, moe=None)
    eager = unbudgeted_cuda_bytes(cfg, max_seqs=256, graphs=False)
    graphed = unbudgeted_cuda_bytes(cfg, max_seqs=256, graphs=True)
    assert eager == CUDA_RUNTIME_BYTES >= 5 * 50 * 10**6
    assert graphed - eager == forward_bytes(cfg, 256, 256)  # the sampler runs outside the graphs


def test_the_eager_budget_leaves_room_for_the_samplers_copies_of_the_logits():
    # Top-k/top-p, penalties and masks copy [N, vocab] fp32 logits several times over: at 256
    # rows of Qwen2's 151,936 tokens that is over a GB the KV cache must not take.
    cfg = SimpleNamespace(hidden_size=896, intermediate_size=4864, vocab_size=151_936, moe=None)
    extra = activation_bytes(cfg, 2048, 256) - forward_bytes(cfg, 2048, 256)
    assert extra == sampler_bytes(cfg, 256) == 4 * SAMPLER_COPIES * 256 * 151_936
    assert extra > 1.5e9


def test_page_plan_caps_only_the_default_cpu_budget():
    assert plan_num_pages(1 << 30, 1 << 20, pages_per_seq=8, max_seqs=4, capped=True) == 32
    assert plan_num_pages(1 << 30, 1 << 20, pages_per_seq=8, max_seqs=4, capped=False) == 1024
    with pytest.raises(ModelLoadError, match="at least 2"):
        plan_num_pages(1 << 20, 1 << 20, pages_per_seq=8, max_seqs=4, capped=False)


@pytest.mark.parametrize(
    ("text", "size"),
    [("4GiB", 4 << 30), ("512MiB", 512 << 20), ("2G", 2_000_000_000), ("100", 100)],
)
def test_sizes_parse_with_units(text, size):
    assert parse_bytes(text) == size


def test_version_flag_prints_the_version(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.startswith("halfmoon 0.")


def test_serve_rejects_a_missing_model_and_a_bad_tensor_parallel_size_early(tmp_path, capsys):
    assert main(["serve", "--model", str(tmp_path / "missing")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert not (tmp_path / "missing").exists()
    assert main(["serve", "--tensor-parallel-size", "0"]) == 2
    assert "prefill.tensor_parallel_size" in capsys.readouterr().err


def test_serve_refuses_a_bind_beyond_loopback_without_a_key_and_says_how(monkeypatch, capsys):
    monkeypatch.delenv("HALFMOON_API_KEY", raising=False)
    assert main(["serve", "--host", "0.0.0.0"]) == 2
    error = capsys.readouterr().err
    assert "0.0.0.0 serves beyond this machine with no API key" in error
    assert "--api-key-file" in error and "--allow-unauthenticated" in error
    parsed = build_parser().parse_args(["serve", "--host", "0.0.0.0", "--allow-unauthenticated"])
    assert parsed.allow_unauthenticated is True
    assert build_parser().parse_args(["serve"]).allow_unauthenticated is None  # the config's
