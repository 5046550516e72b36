"""Public API: forward (and, with the backward kernels, backward / vjp).

Layout as flash-attn: q (batch, seqlen_q, heads_q, head_dim), k and v
(batch, seqlen_k, heads_kv, head_dim) with heads_q % heads_kv == 0.
"""
from __future__ import annotations

import math
from typing import Optional, Union

import numpy as np

from . import _checks, heuristics, launch, params, sm90
from .dispatch import device_info, get_kernel, smem_bytes

HEAD_DIMS = range(8, heuristics.MAX_HEAD_DIM + 1, 8)
LOG2E = 1.4426950408889634


def forward(q, k, v, *, causal: bool = False, softmax_scale: Optional[float] = None,
            return_lse: bool = False, out=None):
    """Exact attention ``softmax(q k^T * softmax_scale) v``, computed tile by tile.

    Args:
        q: ``(batch, seqlen_q, heads_q, head_dim)`` CuPy array, float16, bfloat16 or float32.
        k: ``(batch, seqlen_k, heads_kv, head_dim)``, same dtype and device; heads_q % heads_kv == 0.
        v: like ``k``.
        causal: mask keys after the query, aligned to the bottom-right corner: query i sees
            keys j <= i + seqlen_k - seqlen_q.
        softmax_scale: defaults to ``1 / sqrt(head_dim)``.
        return_lse: also return the log-sum-exp.
        out: optional output buffer shaped and typed like ``q``.

    Returns:
        ``out`` (shaped like q), or ``(out, lse)`` with ``lse`` float32 ``(batch, heads_q, seqlen_q)``,
        the natural-log log-sum-exp of the scaled scores. A query row that sees no key gets
        output 0 and lse -inf. seqlen_q == 0 gives empty results; seqlen_k == 0 gives zeros and -inf.
    """
    import cupy

    b, nq, nk, hq, hkv, d = _checks.check_qkv(q, k, v, HEAD_DIMS)
    scale = _checks.check_scale(softmax_scale, d)
    dev = q.device.id
    if out is not None:
        _checks.check_out("out", out, q.shape, q.dtype, dev)
    with cupy.cuda.Device(dev):
        if out is None:
            out = cupy.empty(q.shape, dtype=q.dtype)
        lse = cupy.empty((b, hq, nq), dtype=np.float32) if return_lse else None
        if b and nq:
            if nk == 0:
                out.fill(0)
                if lse is not None:
                    lse.fill(-np.inf)
            else:
                _launch_fwd(q, k, v, out, lse, causal=bool(causal), scale=scale,
                            dims=(b, nq, nk, hq, hkv, d), device_id=dev)
    return (out, lse) if return_lse else out


# (dtype, head_dim, causal, device) -> (kernel, config, shared memory bytes): keeps the
# heuristics and the module lookup off the hot path. Tuning scripts clear it.
_fwd_plans: dict = {}


def _fwd_plan(dtype, head_dim: int, causal: bool, device_id: int):
    key = (dtype, head_dim, causal, device_id)
    plan = _fwd_plans.get(key)
    if plan is None:
        cc, _ = device_info(device_id)
        cfg = heuristics.fwd_config(_checks.dtype_name(dtype), head_dim, causal, cc)
        plan = _fwd_plans[key] = (get_kernel(cfg, device_id), cfg, smem_bytes(cfg))
    return plan


def _launch_fwd(q, k, v, out, lse, *, causal: bool, scale: float, dims, device_id: int) -> None:
    b, nq, nk, hq, hkv, d = dims
    kern, cfg, smem = _fwd_plan(q.dtype, d, causal, device_id)
    extra = ()
    if cfg.fam.arch_specific:  # sm90 (opt-in): tensor maps, or sm80 where TMA cannot address the inputs
        kern, cfg, smem, extra = sm90.fwd_launch_args(kern, cfg, smem, q, k, v, device_id)
    p = params.pack_values(params.FWD_PARAMS, (
        q.data.ptr, k.data.ptr, v.data.ptr, out.data.ptr, lse.data.ptr if lse is not None else 0,
        *params.element_strides(q), *params.element_strides(k), *params.element_strides(v),
        *params.element_strides(out),
        b, nq, nk, hq, hq // hkv, d, scale, scale * LOG2E))
    launch.launch(kern, cfg, launch.fwd_grid(cfg, b, hq, nq), p, smem, extra)
