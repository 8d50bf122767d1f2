"""Mixture-of-experts checkpoints: the experts' weights as each rank holds them, the stacked
layout transformers 5 may save, what `init-model --arch` writes, and what tensor parallelism
refuses. (Greedy tokens and logits against transformers: test_exactness.py and, at two ranks,
test_tensor_parallel.py; the kernels: tests/kernels/test_moe.py.)"""

from __future__ import annotations

import json
import shutil
from dataclasses import replace

import pytest
import torch
from isa_testkit import RUNNABLE, variant
from safetensors.torch import load_file, save_file

from halfmoon.cluster.cli import main
from halfmoon.engine import LLM, ModelLoadError, SamplingParams
from halfmoon.engine.init_model import SHAPES, init_model
from halfmoon.engine.kv_sizing import forward_bytes
from halfmoon.engine.model_config import load_model_config
from halfmoon.engine.model_runner import ModelRunner
from halfmoon.engine.tensor_parallel import TPGroup, check_divisible
from halfmoon.kernels import cpu_attention, cpu_elementwise, cpu_gemm

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
PROMPTS = [[7, 8, 9, 10], list(range(20, 60))]


def _runners(model_dir):
    cfg = load_model_config(model_dir)
    return cfg, [
        ModelRunner(model_dir, cfg, 16, torch.float32, torch.device("cpu"), group).model
        for group in (TPGroup(), TPGroup(0, 2), TPGroup(1, 2))
    ]


def test_each_rank_holds_its_slice_of_every_expert_and_the_whole_router(checkpoints):
    """Qwen2-MoE at two ranks: each expert's gate and up rows and its down columns split as a
    dense MLP's are; the shared expert likewise; the router and the shared gate whole."""
    cfg, (whole, first, second) = _runners(checkpoints["qwen2-moe"])
    assert cfg.moe.sparse_layers == (1,), "mlp_only_layers=[0]: the first layer is dense"
    block, halves = whole.layers[1].mlp, (first.layers[1].mlp, second.layers[1].mlp)
    half = cfg.moe.expert_intermediate_size // 2
    for expert in range(cfg.moe.num_experts):
        gate, up = block.experts.gate_up_proj[expert].split(2 * [2 * half])
        for rank, ours in enumerate(halves):
            rows = slice(rank * half, (rank + 1) * half)
            assert torch.equal(ours.experts.gate_up_proj[expert], torch.cat([gate[rows], up[rows]]))
            assert torch.equal(
                ours.experts.down_proj[expert], block.experts.down_proj[expert][:, rows]
            )
    shared = cfg.moe.shared_expert_intermediate_size // 2
    assert halves[0].shared_expert.down_proj.weight.shape == (cfg.hidden_size, shared)
    x = torch.randn(3, cfg.hidden_size)
    for ours in halves:  # (the linear layers' weights may be packed for the CPU's GEMM)
        assert torch.equal(ours.gate(x), block.gate(x))
        assert torch.equal(ours.shared_expert_gate(x), block.shared_expert_gate(x))


def _stack_experts(model_dir, out_dir) -> None:
    """Rewrite a per-expert checkpoint with transformers 5's stacked expert tensors."""
    shutil.copytree(model_dir, out_dir)
    tensors = load_file(out_dir / "model.safetensors")
    cfg = load_model_config(model_dir)
    for layer in cfg.moe.sparse_layers:
        prefix = f"model.layers.{layer}.mlp.experts"
        per_expert = [
            {
                proj: tensors.pop(f"{prefix}.{e}.{proj}.weight")
                for proj in ("gate_proj", "up_proj", "down_proj")
            }
            for e in range(cfg.moe.num_experts)
        ]
        tensors[f"{prefix}.gate_up_proj"] = torch.stack(
            [torch.cat([w["gate_proj"], w["up_proj"]]) for w in per_expert]
        )
        tensors[f"{prefix}.down_proj"] = torch.stack([w["down_proj"] for w in per_expert])
    save_file(tensors, out_dir / "model.safetensors", metadata={"format": "pt"})


def test_stacked_expert_tensors_load_as_the_per_expert_ones(checkpoints, tmp_path):
    model_dir = checkpoints["qwen3-moe"]
    _stack_experts(model_dir, tmp_path / "stacked")
    per_expert = LLM(str(model_dir), num_pages=16).generate(PROMPTS, GREEDY)
    stacked = LLM(str(tmp_path / "stacked"), num_pages=16).generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in stacked] == [o.token_ids for o in per_expert]


@pytest.mark.parametrize(
    "arch,architecture",
    [
        ("mixtral", "MixtralForCausalLM"),
        ("qwen2-moe", "Qwen2MoeForCausalLM"),
        ("qwen3-moe", "Qwen3MoeForCausalLM"),
    ],
)
def test_init_model_writes_each_architecture_that_transformers_and_we_load(
    tmp_path, capsys, arch, architecture
):
    from transformers import AutoModelForCausalLM

    assert main(["init-model", "--arch", arch, str(tmp_path / arch)]) == 0
    assert f"wrote a tiny-moe {architecture} checkpoint" in capsys.readouterr().out
    assert json.loads((tmp_path / arch / "config.json").read_text())["architectures"] == [
        architecture
    ]
    moe = load_model_config(tmp_path / arch).moe
    assert (moe.num_experts, moe.top_k, moe.expert_intermediate_size) == (4, 2, 32)
    assert moe.shared_expert_intermediate_size == (128 if arch == "qwen2-moe" else 0)
    reference = AutoModelForCausalLM.from_pretrained(tmp_path / arch)
    ids = torch.tensor([PROMPTS[1]])
    expected = reference.generate(ids, max_new_tokens=6, min_new_tokens=6, do_sample=False)
    ours = LLM(str(tmp_path / arch), num_pages=16).generate([PROMPTS[1]], GREEDY)[0]
    assert ours.token_ids == expected[0, ids.shape[1] :].tolist()


def test_init_model_refuses_a_shape_that_does_not_fit_the_architecture(tmp_path):
    with pytest.raises(ModelLoadError, match="needs a shape with experts: tiny-moe, moe"):
        init_model(tmp_path / "a", SHAPES["tiny"], arch="qwen3-moe")
    with pytest.raises(ModelLoadError, match="--arch llama is dense"):
        init_model(tmp_path / "b", SHAPES["tiny-moe"], arch="llama")
    with pytest.raises(SystemExit):
        main(["init-model", "--arch", "deepseek", str(tmp_path / "c")])


def test_ranks_that_do_not_divide_an_experts_width_are_refused_naming_it(checkpoints):
    cfg = load_model_config(checkpoints["qwen2-moe"])
    odd = replace(cfg, moe=replace(cfg.moe, expert_intermediate_size=33))
    with pytest.raises(ModelLoadError, match=r"expert intermediate size \(33\)"):
        check_divisible(odd, 2)
    check_divisible(cfg, 2)


def test_the_activation_budget_counts_each_tokens_k_experts(checkpoints):
    """A token's routed experts take k times an expert's buffers (and their outputs before the
    sum); the budget must hold them where they exceed the dense MLP's."""
    cfg = load_model_config(checkpoints["qwen3-moe"])
    wide = replace(cfg, moe=replace(cfg.moe, top_k=4, expert_intermediate_size=512))
    assert forward_bytes(wide, 256, 8) - forward_bytes(cfg, 256, 8) >= 4 * 256 * 3 * 4 * 480


def test_the_start_up_profile_of_an_moe_engine_fits_the_cost_model(checkpoints):
    from halfmoon.engine.profiling import profile_engine
    from halfmoon.router.cost_model import CostModel

    llm = LLM(str(checkpoints["qwen2-moe"]), num_pages=128, block_size=16, prefill_chunk_size=64)
    samples = profile_engine(llm.engine)
    CostModel.fit(samples.prefill, samples.decode)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("isa", RUNNABLE)
def test_the_cpu_expert_path_matches_transformers_on_every_cpu_variant(checkpoints, isa, dtype):
    """The experts' packed CPU linear layers on each kernel variant this CPU runs (an AVX2-only
    machine's included): fp32 tokens equal transformers'; bf16 (transformers in bf16 beside it)
    agrees on the first token of each prompt."""
    from transformers import AutoModelForCausalLM

    model_dir = checkpoints["qwen3-moe"]
    with variant(isa, cpu_attention.LIBRARY, cpu_elementwise.LIBRARY, cpu_gemm.LIBRARY):
        outputs = LLM(str(model_dir), dtype=dtype, num_pages=16).generate(PROMPTS, GREEDY)
    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype))
    for prompt, output in zip(PROMPTS, outputs, strict=True):
        ids = torch.tensor([prompt])
        expected = reference.generate(ids, max_new_tokens=6, min_new_tokens=6, do_sample=False)
        expected = expected[0, ids.shape[1] :].tolist()
        if dtype == "float32":
            assert output.token_ids == expected
        else:
            assert output.token_ids[0] == expected[0]
