"""Programmable attention in float32 (issue #45): bias with dbias, dropout, block masks and user modifiers on the
exact CUDA-core kernels (kernels_cu/simt/fwd.cu ``fwd_prog_kernel``, kernels_cu/simt/bwd.cu
``bwd_dkdv_prog_kernel`` / ``bwd_dq_prog_kernel``), on every GPU.

programmable.launch_forward / launch_backward hand float32 calls here; the arguments' checks, the ``ProgParams``
bytes, the mask modifier's tile states, the tile lists and the gradients' buffers are programmable.py's. Dropout
draws the 16-bit kernels' mask (DropoutTile in kernels_cu/common/programmable.cuh), so ``cuflash.dropout_keep_mask``
gives it for float32 too. The backward is the portable pair's schedule, deterministic anyway: the preprocess
(delta), dK / dV with dbias and the modifiers' tensor gradients, then dQ.
"""
from __future__ import annotations

import numpy as np

from . import params, programmable

_plans: dict = {}   # call shape -> the kernels' (kernel, config, shared memory) plans, as programmable._plans


def _fwd_plan(head_dim: int, head_dim_v: int, causal: bool, variant, device_id: int, opts):
    """(kernel, config, shared memory) of the float32 programmable forward, cached per call shape; the tile fitted
    to the device's shared memory as the plain forward's."""
    from . import heuristics
    from .dispatch import device_info, fit_to_device, get_kernel, smem_bytes

    key = ("fwd", head_dim, head_dim_v, causal, variant, device_id, opts.token)
    plan = _plans.get(key)
    if plan is None:
        cc, _ = device_info(device_id, opts)
        cfg = heuristics.prog_fwd_config("float32", head_dim, causal, cc, variant, head_dim_v=head_dim_v, opts=opts)
        cfg = fit_to_device(cfg, device_id, opts)
        plan = _plans[key] = (get_kernel(cfg, device_id, opts.nvrtc_defines), cfg,
                              smem_bytes(cfg, device_id, opts.nvrtc_defines))
    return plan


def _bwd_plan(head_dim: int, causal: bool, variant, device_id: int, opts) -> tuple:
    """((kernel, config, shared memory) of the preprocess, the dK / dV kernel and the dQ kernel) of the float32
    programmable backward, cached."""
    from . import heuristics
    from .dispatch import device_info, get_kernel, smem_bytes

    key = ("bwd", head_dim, causal, variant, device_id, opts.token)
    plan = _plans.get(key)
    if plan is None:
        cc, _ = device_info(device_id, opts)
        cfgs = heuristics.prog_bwd_configs("float32", head_dim, causal, cc, variant, deterministic=True, opts=opts)
        plan = _plans[key] = tuple((get_kernel(c, device_id, opts.nvrtc_defines), c,
                                    smem_bytes(c, device_id, opts.nvrtc_defines))
                                   for c in (cfgs.preprocess, cfgs.dkdv, cfgs.dq))
    return plan


def launch_forward(q, k, v, out, lse, prog, *, causal: bool, scale: float, dims, device_id: int, opts, var) -> None:
    """programmable.launch_forward for float32 q, k, v (its arguments)."""
    from .api import LOG2E

    b, nq, nk, hq, hkv, d = dims
    kern, cfg, smem = _fwd_plan(d, v.shape[3], causal, prog.variant(var.kernel), device_id, opts)
    fwd = params.pack_bytes(params.FWD_PARAMS, (
        q.data.ptr, k.data.ptr, v.data.ptr, out.data.ptr, lse.data.ptr if lse is not None else 0,
        *params.element_strides(q), *params.element_strides(k), *params.element_strides(v),
        *params.element_strides(out), b, nq, nk, hq, hq // hkv, d, scale, scale * LOG2E,
        *var.param_values(nq, nk, scale), *params.DENSE_VARLEN_VALUES))
    programmable._launch_fwd_prog(kern, cfg, smem, fwd, (), prog, batch=b, heads=hq, seqlen_q=nq, seqlen_k=nk,
                                  device_id=device_id, opts=opts)


def launch_backward(dout, q, k, v, out, lse, dq, dk, dv, prog, *, causal: bool, scale: float, dims, device_id: int,
                    opts, var, dlse=None, deterministic: bool = False):
    """programmable.launch_backward for float32 (its arguments and result: dsinks or None, dbias in the bias's
    shape and dtype or None, the tensor gradients): the preprocess (delta), dK / dV with dbias and the modifiers'
    tensor gradients, dQ. Deterministic whatever ``deterministic`` says (no dQ atomics; dbias's float32 atomics
    aside, as the portable pair's)."""
    import dataclasses

    import cupy

    from . import capture

    del deterministic
    b, nq, nk, hq, hkv, d = dims
    variant = prog.variant(dataclasses.replace(var.kernel, sink=False))   # the backward has no sink code
    plan = _bwd_plan(d, causal, variant, device_id, opts)
    kcfg, qcfg = plan[1][1], plan[2][1]
    dbias_accum, grads, fields = programmable._bwd_outputs(prog)
    keep: list = [dbias_accum]
    pp_dkdv, pp_dq = programmable._bwd_prog_params(prog, kcfg, qcfg, fields, keep, batch=b, heads=hq, seqlen_q=nq,
                                                   seqlen_k=nk, device_id=device_id, opts=opts)
    delta = cupy.empty((b, hq, nq), dtype=np.float32)
    keep.append(delta)
    programmable._launch_portable_backward(
        plan, (dout, q, k, v, out, lse, delta, dq, dk, dv), (pp_dkdv, pp_dq), params.element_strides,
        sizes=(b, nq, nk, hq, hkv, d), scale=scale, rows=nq, var=var, dlse=dlse,
        varlen_values=params.DENSE_VARLEN_VALUES)
    dsinks = programmable._dsinks(var, lse, delta)
    capture.keep_if_capturing(*keep)
    return dsinks, programmable._dbias(prog, dbias_accum), grads
