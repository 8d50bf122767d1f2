"""`halfmoon bench engine` on a mixture of experts: against transformers, and `--vs-expert-loop`
(grouped experts against one expert MLP per (token, slot))."""

from __future__ import annotations

import functools
import json

import pytest

from halfmoon.bench import engine as bench_engine
from halfmoon.bench.probes import engine_turns
from halfmoon.engine.init_model import SHAPES, init_model

TINY_RUN = ["--arch", "qwen3-moe", "--requests", "4", "--scale", "0.1", "--json"]


@pytest.fixture(scope="module")
def tiny_moe_dir(tmp_path_factory):
    return init_model(
        tmp_path_factory.mktemp("models") / "qwen3-moe", SHAPES["tiny-moe"], arch="qwen3-moe"
    )


@pytest.fixture(autouse=True)
def brief_quiet(monkeypatch):
    """A timed turn waits at most 0.5 s for idle CPUs (as in test_bench_engine.py)."""
    brief = functools.partial(engine_turns.after_quiet, timeout_s=0.5)
    monkeypatch.setattr(engine_turns, "after_quiet", brief)


@pytest.mark.timeout(120)
def test_a_mixture_of_experts_runs_against_transformers_with_the_same_greedy_tokens(
    tiny_moe_dir, capsys
):
    assert bench_engine.main(["--model", str(tiny_moe_dir), *TINY_RUN]) == 0
    out, err = capsys.readouterr()
    figures = json.loads(out)
    assert figures["architecture"] == "Qwen3MoeForCausalLM"
    assert figures["requests"] == 4
    assert figures["ours_tok_s"] > 0 and figures["hf_static_tok_s"] > 0
    assert figures["hf_cb_tok_s"] > 0  # transformers' continuous batching serves Qwen3-MoE
    assert figures["hf_static_same_tokens"] == 1.0
    assert "M active a token" in err


@pytest.mark.timeout(120)
def test_vs_expert_loop_times_grouped_experts_against_the_per_token_loop(tiny_moe_dir, capsys):
    argv = ["--model", str(tiny_moe_dir), *TINY_RUN, "--vs-expert-loop", "--repeats", "2"]
    assert bench_engine.main(argv) == 0
    out, err = capsys.readouterr()
    figures = json.loads(out)
    assert figures["same_tokens_as_expert_loop"] is True
    assert len(figures["ratios_vs_expert_loop"]) == 2
    assert figures["ours_tok_s"] > 0 and figures["expert_loop_tok_s"] > 0
    assert set(figures["kernel_vs_loop"]) == {"1", "16", "256"}
    assert set(figures["kernel_vs_loop"]["256"]) == {"grouped_ms", "loop_ms", "ratio"}
    assert "turn 1: grouped" in err and "hf static" not in err


def test_vs_expert_loop_refuses_a_dense_model_and_other_comparisons(tiny_model_dir, tiny_moe_dir):
    dense = (["--vs-expert-loop"], ["--vs-expert-loop", "--model", str(tiny_model_dir)])
    moe = ["--vs-expert-loop", "--model", str(tiny_moe_dir)]
    others = (["--peer", "vllm"], ["--tp", "2"], ["--threads", "1", "2"], ["--vs-dtype", "float32"])
    for argv in (*dense, *([*moe, *extra] for extra in others)):
        with pytest.raises(SystemExit):
            bench_engine.main(argv)


def test_arch_must_name_the_given_models_architecture(tiny_moe_dir, capsys):
    with pytest.raises(SystemExit):
        bench_engine.main(["--model", str(tiny_moe_dir), "--arch", "mixtral"])
    assert "is a Qwen3MoeForCausalLM" in capsys.readouterr().err


def test_an_moe_arch_generates_the_moe_shape_next_to_the_other_checkpoints(
    tiny_moe_dir, tmp_path, monkeypatch
):
    made = []

    def ensure_model(path, shape, arch="llama"):
        made.append((path, shape, arch))
        return tiny_moe_dir

    monkeypatch.setattr(bench_engine, "default_model_dir", lambda: tmp_path / "tiny-llama")
    monkeypatch.setattr(bench_engine, "ensure_model", ensure_model)
    argv = ["--arch", "mixtral", "--requests", "1", "--scale", "0.02", "--skip-hf-cb", "--json"]
    assert bench_engine.main(argv) == 0
    assert made == [(tmp_path / "bench-moe-mixtral", SHAPES["moe"], "mixtral")]
