"""The offline engine split across two ranks (real processes, gloo on CPU; NCCL on two GPUs in
the `gpu` test) generates what one rank does, loads only each rank's slices, places its ranks
on devices, and fails or stops cleanly."""

from __future__ import annotations

import gc
import json
import os
import random
import signal
import subprocess
import sys
import textwrap

import pytest
import torch
from safetensors import safe_open
from test_cli import generate_local

from halfmoon.engine import LLM, EngineConfig, InvalidRequestError, ModelLoadError, SamplingParams
from halfmoon.engine.errors import RankFailedError
from halfmoon.engine.loader import _copy_slice, checkpoint_files
from halfmoon.engine.model_config import load_model_config
from halfmoon.engine.model_runner import ModelRunner
from halfmoon.engine.sampler import sample
from halfmoon.engine.tensor_parallel import (
    TPGroup,
    VocabParallelEmbedding,
    process_group_backend,
    rank_devices,
)

PROMPT_LENGTHS = [1, 7, 17, 45, 130]
NEW_TOKENS = 8
# Chunked prefill (a 130-token prompt takes 5 steps) next to a batch of decoding sequences.
ENGINE_ARGS = dict(
    block_size=16, num_pages=32, max_num_batched_tokens=64, prefill_chunk_size=32, max_num_seqs=8
)
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)


def _prompts() -> list[list[int]]:
    rng = random.Random(7)
    return [[rng.randrange(6, 262) for _ in range(n)] for n in PROMPT_LENGTHS]


def _generate(llm: LLM, monkeypatch) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Greedy tokens of every prompt, and the logits its first token was sampled from."""
    first_logits = {}

    def capture(logits, seqs):
        for row, seq in enumerate(seqs):
            first_logits.setdefault(seq.request_id, logits[row].clone())
        return sample(logits, seqs)

    monkeypatch.setattr("halfmoon.engine.llm_engine.sample", capture)
    outputs = llm.generate(_prompts(), GREEDY)
    return [o.token_ids for o in outputs], [first_logits[o.request_id] for o in outputs]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("arch", ["llama", "qwen2", "mixtral", "qwen2-moe", "qwen3-moe"])
def test_two_ranks_generate_the_greedy_tokens_of_one(checkpoints, arch, monkeypatch):
    one = LLM(str(checkpoints[arch]), **ENGINE_ARGS)
    expected_tokens, expected_logits = _generate(one, monkeypatch)
    llm = LLM(str(checkpoints[arch]), tensor_parallel_size=2, **ENGINE_ARGS)
    try:
        tokens, logits = _generate(llm, monkeypatch)
        steps = llm.engine.step_log
        k_cache = llm.engine.kv_cache.layers[0][0]  # rank 0's pages
    finally:
        llm.close()
    assert tokens == expected_tokens
    for ours, theirs in zip(logits, expected_logits, strict=True):
        torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=0)
    assert any(cached for step in steps for _, cached in step.prefill_chunks), "chunked prefill"
    assert max(step.decode_seqs for step in steps) > 1, "a decode batch"
    assert k_cache.shape[2] == 1, "rank 0 holds one of the two KV heads"


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs, one per rank")
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_two_ranks_on_two_gpus_generate_the_greedy_tokens_of_one_gpu(
    checkpoints, arch, monkeypatch
):
    args = dict(device="cuda", dtype="float32", **ENGINE_ARGS)
    expected_tokens, expected_logits = _generate(LLM(str(checkpoints[arch]), **args), monkeypatch)
    llm = LLM(str(checkpoints[arch]), tensor_parallel_size=2, **args)
    try:
        tokens, logits = _generate(llm, monkeypatch)
        k_cache = llm.engine.kv_cache.layers[0][0]  # rank 0's pages
        with pytest.raises(InvalidRequestError, match="must be 1 on this engine"):
            llm.generate([[7, 8, 9]], SamplingParams(n=2))
    finally:
        llm.close()
    assert tokens == expected_tokens
    for ours, theirs in zip(logits, expected_logits, strict=True):
        torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=0)
    assert k_cache.device == torch.device("cuda", 0) and k_cache.shape[2] == 1


def test_ranks_on_the_cpu_share_it_over_gloo():
    cpu = torch.device("cpu")
    assert rank_devices(cpu, 3) == [cpu, cpu, cpu]
    assert process_group_backend(cpu) == "gloo"


def test_ranks_on_cuda_take_one_gpu_each_from_rank_0s_over_nccl(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    assert rank_devices(torch.device("cuda"), 2) == [
        torch.device("cuda", 0),
        torch.device("cuda", 1),
    ]
    assert rank_devices(torch.device("cuda", 1), 3) == [torch.device("cuda", i) for i in (1, 2, 3)]
    assert process_group_backend(torch.device("cuda", 1)) == "nccl"


def test_fewer_gpus_than_ranks_are_refused_naming_both_counts(checkpoints, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ModelLoadError) as error:
        LLM(str(checkpoints["llama"]), device="cuda", tensor_parallel_size=2, **ENGINE_ARGS)
    assert str(error.value) == (
        "tensor_parallel_size=2 from cuda:0 needs 2 visible GPUs (one per rank: cuda:0 to "
        "cuda:1), but 1 is visible: lower tensor_parallel_size or make more GPUs visible "
        "(CUDA_VISIBLE_DEVICES)"
    )
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    with pytest.raises(ModelLoadError, match=r"from cuda:3 needs 5 visible GPUs .* but 4 are"):
        rank_devices(torch.device("cuda", 3), 2)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_each_rank_loads_its_slices_of_the_checkpoint(checkpoints, arch):
    """Two ranks' runners built in one process (no collectives run): their slices put side by
    side are the one-rank model's tensors."""
    model_dir = checkpoints[arch]
    cfg = load_model_config(model_dir)
    whole, *ranks = (
        ModelRunner(model_dir, cfg, 16, torch.float32, torch.device("cpu"), group).model
        for group in (TPGroup(), TPGroup(0, 2), TPGroup(1, 2))
    )
    first, second = (dict(rank.named_parameters()) for rank in ranks)
    q, kv = cfg.num_heads * cfg.head_dim // 2, cfg.num_kv_heads * cfg.head_dim // 2
    row_parts = {"qkv_proj": [q, kv, kv], "gate_up_proj": [cfg.intermediate_size // 2] * 2}
    for name, tensor in whole.named_parameters():
        kind = name.split(".")[-2]
        if kind in row_parts:  # column-parallel: each part of a fused tensor split by rows
            sizes = row_parts[kind]
            ours = zip(first[name].split(sizes), second[name].split(sizes), strict=True)
            joined = torch.cat([torch.cat(pair) for pair in ours])
        elif kind in ("o_proj", "down_proj"):  # row-parallel: split by columns
            joined = torch.cat([first[name], second[name]], dim=1)
        elif kind in ("embed_tokens", "lm_head"):  # vocabulary-parallel
            joined = torch.cat([first[name], second[name]])
        else:  # the norms: on every rank
            assert torch.equal(first[name], second[name]), name
            joined = first[name]
        assert torch.equal(joined, tensor), name


def test_vocabulary_split_unevenly_pads_the_last_rank_and_sums_to_the_embedding(checkpoints):
    name = "model.embed_tokens.weight"
    with safe_open(str(checkpoint_files(checkpoints["llama"])[0]), framework="pt") as file:
        full = file.get_tensor(name)
        embeddings = [VocabParallelEmbedding(262, 64, TPGroup(rank, 3)) for rank in range(3)]
        for rank, embedding in enumerate(embeddings):
            _copy_slice(name, embedding.weight.data, file.get_slice(name), 3, rank)
    rows = torch.cat([embedding.weight for embedding in embeddings])
    assert rows.shape[0] == 264 and torch.equal(rows[:262], full) and not rows[262:].any()
    token_ids = torch.tensor([0, 87, 88, 175, 176, 261])
    looked_up = sum(embedding(token_ids) for embedding in embeddings)
    assert torch.equal(looked_up, full[token_ids])


def test_heads_that_do_not_divide_are_rejected_naming_the_counts(checkpoints):
    with pytest.raises(ModelLoadError) as error:
        LLM(str(checkpoints["llama"]), tensor_parallel_size=3, **ENGINE_ARGS)
    message = str(error.value)
    assert "tensor_parallel_size=3" in message
    assert "attention heads (4), KV heads (2), intermediate size (128)" in message
    assert "use one of 1, 2" in message


def test_shared_kv_needs_one_rank(checkpoints):
    with pytest.raises(ValueError, match="KV sharing needs tensor_parallel_size = 1"):
        EngineConfig(model=str(checkpoints["llama"]), share_kv=True, tensor_parallel_size=2)


@pytest.mark.timeout(60)
def test_a_killed_rank_fails_the_next_step_with_an_error_naming_it(checkpoints):
    llm = LLM(str(checkpoints["llama"]), tensor_parallel_size=2, **ENGINE_ARGS)
    try:
        llm.generate([[7, 8, 9]], GREEDY)
        llm.engine.check_ranks()  # every rank alive: nothing to say
        (rank,) = llm.engine.rank_processes
        rank.send_signal(signal.SIGKILL)
        rank.wait()
        # A worker's health check learns of it before any step does.
        with pytest.raises(RankFailedError, match=r"cannot step: rank 1 \(pid \d+\) exited with"):
            llm.engine.check_ranks()
        with pytest.raises(RankFailedError, match=r"rank 1 \(pid \d+\) exited with code -9"):
            llm.generate([[7, 8, 9]], GREEDY)
        with pytest.raises(RankFailedError):  # and stays failed, without waiting on anything
            llm.generate([[10, 11]], GREEDY)
    finally:
        llm.close()


def _listening(pids: set[int]) -> set[str]:
    """The local addresses of the TCP sockets the processes `pids` listen on (from `ss`)."""
    table = subprocess.run(["ss", "-Hltnp"], capture_output=True, text=True, check=True).stdout
    return {
        line.split()[3] for line in table.splitlines() if any(f"pid={pid}," in line for pid in pids)
    }


@pytest.mark.timeout(60)
def test_the_ranks_rendezvous_and_collectives_listen_on_loopback_only(checkpoints):
    before = _listening({os.getpid()})
    llm = LLM(str(checkpoints["llama"]), tensor_parallel_size=2, **ENGINE_ARGS)
    try:
        llm.generate([[7, 8, 9]], GREEDY)  # the collectives have connected
        ours = _listening({os.getpid(), *(rank.pid for rank in llm.engine.rank_processes)}) - before
    finally:
        llm.close()
    assert ours, "the store and gloo listen somewhere"
    assert all(address.startswith("127.0.0.1:") for address in ours), ours


@pytest.mark.timeout(60)
def test_closing_dropping_or_exiting_stops_the_other_ranks(checkpoints):
    llm = LLM(str(checkpoints["llama"]), tensor_parallel_size=2, **ENGINE_ARGS)
    (rank,) = llm.engine.rank_processes
    llm.close()
    assert rank.returncode == 0
    llm = LLM(str(checkpoints["llama"]), tensor_parallel_size=2, **ENGINE_ARGS)
    (rank,) = llm.engine.rank_processes
    del llm
    gc.collect()
    assert rank.poll() == 0
    script = f"""
        from halfmoon.engine import LLM
        llm = LLM({str(checkpoints["llama"])!r}, tensor_parallel_size=2, num_pages=8)
        print(*(rank.pid for rank in llm.engine.rank_processes))
        llm.generate("hi")
    """
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)], capture_output=True, text=True, timeout=50
    )
    assert done.returncode == 0, done.stderr
    with pytest.raises(ProcessLookupError):
        os.kill(int(done.stdout.split()[0]), 0)


@pytest.mark.timeout(60)
def test_generate_local_at_two_ranks_prints_the_tokens_of_one(checkpoints):
    model_dir = checkpoints["qwen2"]
    args = ("--max-tokens", "6", "--ignore-eos", "--json", "Hello there")
    one, two = (
        json.loads(generate_local(model_dir, "--tensor-parallel-size", ranks, *args).stdout)
        for ranks in ("1", "2")
    )
    assert two["token_ids"] == one["token_ids"] and len(one["token_ids"]) == 6
