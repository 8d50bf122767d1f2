"""Batched token sampling on the logits' device: biases and penalties, grammar masks, then greedy,
temperature, top-k, top-p, min-p."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from halfmoon.engine.device_copy import device_tensor
from halfmoon.engine.grammar import mask_logits
from halfmoon.engine.penalties import apply_penalties
from halfmoon.engine.sequence import Sequence, TokenLogprobs


@dataclass(slots=True)
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]


def sample(logits: torch.Tensor, seqs: list[Sequence]) -> SamplerOutput:
    """One token per row of `logits` ([N, vocab], fp32), by each row's sequence's parameters."""
    params = [seq.params for seq in seqs]
    processed = apply_penalties(logits, seqs)
    if any(seq.grammar is not None for seq in seqs):
        if processed is logits:  # keep the model's own logits for the logprobs
            processed = logits.clone()
        mask_logits(processed, seqs)
    greedy_ids = processed.argmax(dim=-1)
    if all(p.greedy for p in params):
        token_ids = greedy_ids
    else:
        token_ids = _sample_random(processed, seqs, greedy_ids)
    ids = token_ids.tolist()
    # Logprobs of the model's own distribution, before biases, penalties and temperature:
    # vLLM's default (`logprobs_mode="raw_logprobs"`).
    return SamplerOutput(ids, _logprobs(logits, seqs, ids))


def _sample_random(logits: torch.Tensor, seqs: list[Sequence], greedy_ids: torch.Tensor):
    # Which filters apply is decided from the parameters on the host: asking the tensors
    # (`bool(t.any())`) would wait for the GPU in the middle of the step.
    device = logits.device
    params = [s.params for s in seqs]
    temps = device_tensor([p.temperature for p in params], device)
    greedy = temps == 0
    scaled = logits / torch.where(greedy, 1.0, temps)[:, None]
    vocab = logits.shape[-1]
    top_k_list = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
    top_p_list = [p.top_p for p in params]
    if any(k < vocab for k in top_k_list) or any(p < 1 for p in top_p_list):
        top_k = device_tensor(top_k_list, device)
        top_p = device_tensor(top_p_list, device)
        scaled = _top_k_top_p(scaled, top_k, top_p)
    probs = torch.softmax(scaled, dim=-1)
    if any(p.min_p > 0 for p in params):
        min_p = device_tensor([p.min_p for p in params], device)
        floor = min_p[:, None] * probs.max(dim=-1, keepdim=True).values
        probs = probs.masked_fill(probs < floor, 0.0)
    # argmax(p / E) with E ~ Exp(1) draws from p (the exponential race).
    noise = torch.empty_like(probs).exponential_()
    for row, seq in enumerate(seqs):
        if seq.generator is not None:
            noise[row].exponential_(generator=seq.generator)
    sampled = (probs / noise).argmax(dim=-1)
    return torch.where(greedy, greedy_ids, sampled)


def _top_k_top_p(scaled: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    ordered, order = scaled.sort(dim=-1, descending=True)
    ranks = torch.arange(scaled.shape[-1], device=scaled.device)[None, :]
    drop = ranks >= top_k[:, None]
    probs = torch.softmax(ordered.masked_fill(drop, float("-inf")), dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    drop |= mass_before >= top_p[:, None]
    ordered = ordered.masked_fill(drop, float("-inf"))
    return torch.empty_like(scaled).scatter_(-1, order, ordered)


def _logprobs(logits: torch.Tensor, seqs: list[Sequence], ids: list[int]):
    wanted = [s.params.logprobs for s in seqs]
    if all(n is None for n in wanted):
        return [None] * len(seqs)
    logp = torch.log_softmax(logits, dim=-1)
    most = max(n or 0 for n in wanted)
    chosen = logp.gather(-1, device_tensor(ids, logits.device)[:, None])
    top_ids: list[list[int]] = [[] for _ in seqs]
    values = chosen
    if most:
        top_values, top_index = logp.topk(most, dim=-1)
        values = torch.cat((chosen, top_values), dim=1)
        top_ids = top_index.tolist()
    values = values.tolist()  # one copy to the host for the whole batch, not one per row
    out: list[TokenLogprobs | None] = []
    for row, n in enumerate(wanted):
        if n is None:
            out.append(None)
            continue
        top = list(zip(top_ids[row][:n], values[row][1 : n + 1], strict=True)) if n else []
        out.append(TokenLogprobs(ids[row], values[row][0], top))
    return out
