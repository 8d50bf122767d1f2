"""`halfmoon bench agreement`: teacher-forced greedy agreement with transformers in fp32."""

from __future__ import annotations

import json

import pytest

from halfmoon.bench.probes import agreement


@pytest.mark.timeout(120)
def test_fp32_agrees_everywhere_and_bf16_is_a_share(tiny_model_dir, capsys):
    argv = ["--model", str(tiny_model_dir), "--prompts", "3", "--tokens", "6", "--json"]
    assert agreement.main([*argv, "--dtype", "float32", "--disable-tqdm"]) == 0
    fp32 = json.loads(capsys.readouterr().out)
    assert (fp32["prompts"], fp32["tokens"]) == (3, 6)
    assert fp32["ours"] == fp32["transformers"] == 1.0  # exact against itself
    assert fp32["ours_logprob_positions"] == 18  # the reference token is ours' greedy one
    assert fp32["ours_logprob_mad"] < 1e-3 and fp32["transformers_logprob_mad"] == 0.0
    assert agreement.main([*argv, "--disable-tqdm"]) == 0
    bf16 = json.loads(capsys.readouterr().out)
    assert bf16["dtype"] == "bfloat16" and 0.0 <= bf16["ours"] <= 1.0
    assert bf16["ours_logprob_mad"] > 0.0 and bf16["transformers_logprob_mad"] > 0.0


def test_bad_counts_and_a_missing_model_are_refused(capsys):
    with pytest.raises(SystemExit):
        agreement.main(["--model", "x", "--prompts", "33"])
    assert agreement.main(["--model", "/no/such/model"]) == 2
    assert "does not exist" in capsys.readouterr().err
