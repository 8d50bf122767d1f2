"""Logit biases and repetition, frequency and presence penalties, for a whole batch at once."""

from __future__ import annotations

import numpy as np
import torch

from halfmoon.engine.device_copy import device_tensor
from halfmoon.engine.sequence import Sequence


def apply_penalties(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """`logits` ([N, vocab]) with each row's sequence's biases and penalties applied, in vLLM's
    order: logit_bias, then repetition, then frequency and presence. A new tensor: `logits`
    is left as the model gave it. `logits` itself when no sequence asks for any."""
    if not any(seq.params.penalized for seq in seqs):
        return logits
    out = logits.clone(memory_format=torch.contiguous_format)
    _add_bias(out, seqs)
    rows = [row for row, seq in enumerate(seqs) if seq.params.repeats_penalized]
    if rows:
        _penalize_repeats(out, rows, [seqs[row] for row in rows])
    return out


def _add_bias(logits: torch.Tensor, seqs: list[Sequence]) -> None:
    """Every row's biases in one `index_put_`, from the arrays each request made once (at most
    `MAX_LOGIT_BIAS` entries a row)."""
    arrays = [(row, *seq.params.bias_arrays()) for row, seq in enumerate(seqs)]
    arrays = [entry for entry in arrays if len(entry[1])]
    if not arrays:
        return
    rows = np.concatenate([np.full(len(ids), row, np.int64) for row, ids, _ in arrays])
    token_ids = np.concatenate([ids for _, ids, _ in arrays])
    values = np.concatenate([biases for _, _, biases in arrays])
    device = logits.device
    index = (device_tensor(rows, device), device_tensor(token_ids, device))
    logits.index_put_(index, device_tensor(values, device, logits.dtype), accumulate=True)


def _penalize_repeats(logits: torch.Tensor, rows: list[int], seqs: list[Sequence]) -> None:
    """Repetition over the prompt and the generated tokens (transformers' and vLLM's rule), then
    OpenAI's frequency and presence over the generated tokens only, on `logits[rows]`.

    Only the seen tokens' logits are read and written ([rows, tokens], not [rows, vocab]): a
    token seen twice gets the same value written twice."""
    device, dtype = logits.device, logits.dtype
    token_ids, generated = _token_ids(seqs)
    token_ids = device_tensor(token_ids, device)
    counts = torch.zeros(len(seqs), logits.shape[1], dtype=dtype, device=device)
    counts = counts.scatter_add_(1, token_ids, device_tensor(generated, device, dtype))
    counts = counts.gather(1, token_ids)
    params = [seq.params for seq in seqs]
    repetition = device_tensor([p.repetition_penalty for p in params], device, dtype)[:, None]
    frequency = device_tensor([p.frequency_penalty for p in params], device, dtype)[:, None]
    presence = device_tensor([p.presence_penalty for p in params], device, dtype)[:, None]
    # Flat offsets: gather and scatter on one dimension are several times faster than 2-D
    # advanced indexing.
    flat = logits.view(-1)
    seen = (device_tensor(rows, device)[:, None] * logits.shape[1] + token_ids).view(-1)
    values = flat.gather(0, seen).view_as(counts)
    values = torch.where(values > 0, values / repetition, values * repetition)
    values = values - frequency * counts - presence * (counts > 0).to(dtype)
    flat.scatter_(0, seen, values.view(-1))


def _token_ids(seqs: list[Sequence]) -> tuple[np.ndarray, np.ndarray]:
    """Every sequence's tokens as rows of one array, padded with the row's first token, and
    which of them were generated, here or by an earlier attempt (not the client's prompt, not
    the padding)."""
    lengths = np.array([len(seq) for seq in seqs])
    num_prompt = np.array([seq.num_prompt_tokens - seq.num_prior_output_tokens for seq in seqs])
    token_ids = np.empty((len(seqs), lengths.max()), dtype=np.int64)
    for row, seq in enumerate(seqs):
        token_ids[row, : len(seq)] = seq.token_ids
        token_ids[row, len(seq) :] = seq.token_ids[0]
    positions = np.arange(token_ids.shape[1])[None, :]
    generated = (positions >= num_prompt[:, None]) & (positions < lengths[:, None])
    return token_ids, generated
