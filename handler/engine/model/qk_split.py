"""What a layer's ``split`` runs: the qkv projection's output ``[rows, (heads + 2 kv_heads) * head_dim]`` cut into
q, k and v per head, q and k normed where the family norms them (qwen3 and gemma3_text per head, olmo2 over the
whole projection) and rotated where the layer uses RoPE. ``helpers`` picks their form for a device and dtype: eager
on a GPU, TorchScript on CPU, and there in fp32 the common split and RoPE in our kernel (``kernels/rope.c``).
``family.LayerBuilder`` binds one to each layer at load.

May import: ``model.kernels`` (the int8 kernel's library, which carries the RoPE kernel). Nothing else of the engine."""

from __future__ import annotations

from functools import cache

import torch

from handler.engine.model.kernels import int8_kernel


def split_and_rotate(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int, num_kv_heads: int,
                     head_dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """qkv ``[rows, (heads + 2 kv_heads) * head_dim]`` -> q, k (RoPE applied) and v, per head. Scripted on CPU
    (``SCRIPTED``): these dozen small ops per layer cost more in Python dispatch than in arithmetic."""
    rows = qkv.shape[0]
    qk = qkv[:, : (num_heads + num_kv_heads) * head_dim].view(rows, -1, head_dim)
    half = head_dim // 2
    rotated = torch.cat((-qk[..., half:], qk[..., :half]), dim=-1)
    qk = qk * cos + rotated * sin  # [rows, heads + kv_heads, head_dim]
    v = qkv[:, (num_heads + num_kv_heads) * head_dim:].view(rows, num_kv_heads, head_dim)
    return qk[:, :num_heads], qk[:, num_heads:], v


def split(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int, num_kv_heads: int,
          head_dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``split_and_rotate`` for a layer without RoPE (smollm3's no-rope layers): cos and sin are not read."""
    rows = qkv.shape[0]
    q = qkv[:, : num_heads * head_dim].view(rows, num_heads, head_dim)
    k = qkv[:, num_heads * head_dim: (num_heads + num_kv_heads) * head_dim].view(rows, num_kv_heads, head_dim)
    v = qkv[:, (num_heads + num_kv_heads) * head_dim:].view(rows, num_kv_heads, head_dim)
    return q, k, v


def rotate(qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = qk.shape[-1] // 2
    return qk * cos + torch.cat((-qk[..., half:], qk[..., :half]), dim=-1) * sin


def split_head_norm_rotate(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int,
                           num_kv_heads: int, head_dim: int, qk_norm: torch.Tensor,
                           eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """qwen3: RMSNorm over each q and k head (``qk_norm`` ``[heads + kv_heads, head_dim]``: q_norm's weight,
    carrying the attention scale, on the query heads, k_norm's on the KV heads), then RoPE."""
    rows = qkv.shape[0]
    qk = qkv[:, : (num_heads + num_kv_heads) * head_dim].view(rows, -1, head_dim)
    qk = rotate(torch.rms_norm(qk, [head_dim], None, eps) * qk_norm, cos, sin)
    v = qkv[:, (num_heads + num_kv_heads) * head_dim:].view(rows, num_kv_heads, head_dim)
    return qk[:, :num_heads], qk[:, num_heads:], v


def split_norm_rotate(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int, num_kv_heads: int,
                      head_dim: int, q_norm: torch.Tensor, k_norm: torch.Tensor,
                      eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """olmo2: RMSNorm over the whole q projection and the whole k projection (q_norm carrying the attention
    scale), then per-head RoPE."""
    rows = qkv.shape[0]
    q_size, k_size = num_heads * head_dim, num_kv_heads * head_dim
    q = torch.rms_norm(qkv[:, :q_size], [q_size], q_norm, eps).view(rows, num_heads, head_dim)
    k = torch.rms_norm(qkv[:, q_size: q_size + k_size], [k_size], k_norm, eps).view(rows, num_kv_heads, head_dim)
    v = qkv[:, q_size + k_size:].view(rows, num_kv_heads, head_dim)
    return rotate(q, cos, sin), rotate(k, cos, sin), v


# What a layer's ``split`` calls: on CPU the scripted helpers (no Python dispatch per op); on a GPU the plain ones,
# whose kernels are torch's own from the first call on. TorchScript's GPU fuser can replace a function's ops by one
# generated kernel after its first profiled calls, which rounds bf16 differently (its intermediates stay fp32):
# the same request's tokens could then differ between the first calls and later ones, and a CUDA graph recorded
# after them (``runners.cuda_graphs``) from what an eager step computes. A graphed decode step pays no dispatch.
EAGER = {"split_and_rotate": split_and_rotate, "split": split, "split_norm_rotate": split_norm_rotate,
         "split_head_norm_rotate": split_head_norm_rotate}
SCRIPTED = {name: torch.jit.script(function) for name, function in EAGER.items()}


@cache
def _cpu_helpers(dtype: torch.dtype) -> dict:
    """The scripted helpers; in fp32 with our kernels, the common split and RoPE in one call (``kernels/rope.c``, the
    same bits)."""
    kernel = int8_kernel() if dtype == torch.float32 else None
    if kernel is None:
        return SCRIPTED
    scripted = SCRIPTED["split_and_rotate"]

    def split_and_rotate(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int, num_kv_heads: int,
                         head_dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if (qkv.dtype is torch.float32 and cos.dtype is torch.float32 and sin.dtype is torch.float32
                and qkv.is_contiguous() and cos.is_contiguous() and sin.is_contiguous()
                and cos.numel() == sin.numel() == qkv.shape[0] * head_dim):
            return kernel.split_rotate(qkv, cos, sin, num_heads, num_kv_heads, head_dim)
        return scripted(qkv, cos, sin, num_heads, num_kv_heads, head_dim)

    return {**SCRIPTED, "split_and_rotate": split_and_rotate}


def helpers(dtype: torch.dtype, device: torch.device) -> dict:
    """The helpers a layer of this dtype on this device calls, by name (``EAGER``'s keys)."""
    return _cpu_helpers(dtype) if device.type == "cpu" else EAGER
