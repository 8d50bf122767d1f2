"""KV cache in 8 bits (`--kv-cache-dtype`): the formats, and the torch reference of their rows.

A quantized cache keeps each token's row of each KV head as `head_dim` 8-bit values followed
by that row's scale as 2 bytes of fp16: pages of `[num_pages, block_size, num_kv_heads,
head_dim + 2]` in the format's storage dtype (`torch.int8`, `torch.float8_e4m3fn`,
`torch.float8_e5m2`). The storage dtype names the format and the wider last dimension says a
scale follows, so the kernels need nothing else to read a cache, and every path that moves
pages (lent pages, the arena, the store, Redis, the transfer engine) moves the scales with
the values, as bytes, without knowing of them.

One scale per token and head (the per-token scheme of KIVI's values and of vLLM's
per-token-head FP8 KV): a row's largest magnitude maps to the format's largest value, so no
calibration is needed and a prefill worker and a decode worker never have to agree on one.
The 2 bytes cost `2 / head_dim` of the row: KV is 0.516x of bf16 at head size 64, 0.508x at
128 (0.258x / 0.254x of fp32).
"""

from __future__ import annotations

import torch

# The names vLLM uses where they exist ("fp8" is e4m3, as there); "auto" keeps the model's dtype.
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2", "int8")
STORAGE: dict[str, torch.dtype] = {
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
    "int8": torch.int8,
}
# A row's largest magnitude becomes this value of the format. e5m2 keeps the same relative
# precision across its range, so its row maximum sits well inside it (and the fp16 scale far
# from underflow); e4m3's largest normal is 448.
QMAX: dict[torch.dtype, float] = {
    torch.int8: 127.0,
    torch.float8_e4m3fn: 448.0,
    torch.float8_e5m2: 256.0,
}
SCALE_BYTES = 2  # the fp16 scale after each row's values
# The code the compiled and Triton kernels know each storage dtype by (0: a cache of values).
FORMAT_CODES: dict[torch.dtype, int] = {torch.int8: 1, torch.float8_e4m3fn: 2, torch.float8_e5m2: 3}


def canonical(kv_cache_dtype: str) -> str:
    """The one name of a format ("fp8" is "fp8_e4m3"): block keys hash it, so blocks written
    under either name are shared and blocks of two formats never mix."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype {kv_cache_dtype!r}: expected one of {KV_CACHE_DTYPES}")
    return "fp8_e4m3" if kv_cache_dtype == "fp8" else kv_cache_dtype


def storage_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The dtype a cache of this format is allocated in (the model's own for "auto")."""
    return STORAGE.get(canonical(kv_cache_dtype), model_dtype)


def is_quantized(cache: torch.Tensor | torch.dtype) -> bool:
    """Whether a cache (or a storage dtype) holds quantized rows with their scales."""
    dtype = cache if isinstance(cache, torch.dtype) else cache.dtype
    return dtype in QMAX


def row_width(head_dim: int, dtype: torch.dtype) -> int:
    """The last dimension of a cache's pages: the head size, plus the scale when quantized."""
    return head_dim + SCALE_BYTES if is_quantized(dtype) else head_dim


def head_dim_of(cache: torch.Tensor) -> int:
    """The head size a cache's rows hold."""
    width = cache.shape[-1]
    return width - SCALE_BYTES if is_quantized(cache) else width


def quantize(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows `[..., D]` (any float dtype) as `[..., D + 2]` rows of `dtype`: the values, each row
    over its scale (its largest magnitude / QMAX, in fp16: `fp16_scale`), then the scale."""
    x = x.float()
    amax = x.abs().amax(dim=-1, keepdim=True)
    scale = fp16_scale(amax, QMAX[dtype])
    # Times the scale's reciprocal (one division a row: the kernels do the same, bit for bit),
    # clamped (fp8 casts turn overflow into NaN).
    scaled = (x * (1.0 / scale.float())).clamp(-QMAX[dtype], QMAX[dtype])
    values = scaled.round().to(torch.int8) if dtype == torch.int8 else scaled.to(dtype)
    out = torch.empty((*x.shape[:-1], x.shape[-1] + SCALE_BYTES), dtype=dtype, device=x.device)
    out[..., : x.shape[-1]].view(torch.uint8).copy_(values.view(torch.uint8))
    out[..., x.shape[-1] :].view(torch.uint8).copy_(scale.view(torch.uint8))
    return out


def fp16_scale(amax: torch.Tensor, qmax: float) -> torch.Tensor:
    """`amax / qmax` as an fp16 no smaller than it (rounded up a step where fp16 rounded it
    down, as it may where it is subnormal: else a value would clamp), 1 for an all-zero row."""
    scale = (amax / qmax).to(torch.float16)
    low = scale.float() * qmax < amax
    scale = torch.where(low, (scale.view(torch.int16) + 1).view(torch.float16), scale)
    return torch.where(scale > 0, scale, torch.ones_like(scale))


def dequantize(rows: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """`[..., D + 2]` rows of a quantized cache back as `[..., D]` values in `out_dtype`."""
    head_dim = rows.shape[-1] - SCALE_BYTES
    scale = rows[..., head_dim:].contiguous().view(torch.uint8).view(torch.float16)
    return rows[..., :head_dim].float().mul_(scale).to(out_dtype)


def as_bytes(cache: torch.Tensor) -> torch.Tensor:
    """A quantized cache seen as uint8 (torch's CPU index ops do not all take float8); other
    caches as they are."""
    return cache.view(torch.uint8) if is_quantized(cache) else cache
