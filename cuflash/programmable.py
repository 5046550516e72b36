"""Programmable attention on the host (issue #45): a call's bias, dropout, block mask and user modifiers checked,
turned into the kernel's variant and its ``ProgParams`` (kernels_cu/common/params.cuh), and launched.

Forward and backward (dq, dk, dv, dbias, the modifiers' tensors), fp16 / bf16, dense: on Hopper its own kernels
(``sm90_fwd_prog``, ``sm90_bwd_dkdv_dqtile_prog``), elsewhere, where TMA cannot address the inputs and for the
deterministic backward the portable ones (``sm80_fwd_prog``, ``sm80_bwd_dkdv_prog`` / ``sm80_bwd_dq_prog``), which
also serve packed (varlen) batches on every GPU.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Optional, Tuple

import numpy as np

from . import block_sparse, params, philox
from .modifiers import MaskMod, Modifiers, ScoreMod

_checked_modifiers: set = set()   # Modifiers.key of those that compiled in this process


@dataclass(frozen=True)
class ProgArgs:
    """A call's programmable arguments after their checks (device arrays as given or made usable)."""

    bias: Any = None                  # CuPy array viewed as 4-D (batch, heads_q, seqlen_q, seqlen_k), 0-strides
    bias_shape: Tuple[int, ...] = ()  # the bias's own shape (dbias's)
    dropout_p: float = 0.0
    seed: int = 0
    offset: int = 0
    rng_state: Any = None             # CuPy uint64 (2,): (seed, offset) read by the kernel, or None
    block_mask: Any = None            # CuPy bool (B or 1, H or 1, query blocks, key blocks)
    block_size: Tuple[int, int] = (block_sparse.DEFAULT_BLOCK_SIZE, block_sparse.DEFAULT_BLOCK_SIZE)
    modifiers: Optional[Modifiers] = None

    @property
    def empty(self) -> bool:
        """No programmable part (e.g. a seed given with dropout_p 0): the plain kernels serve."""
        return self.bias is None and self.dropout_p == 0 and self.block_mask is None and self.modifiers is None

    @property
    def block_sparse(self) -> bool:
        return self.block_mask is not None or (self.modifiers is not None and self.modifiers.has_mask_mod)

    def variant(self, base):
        """The kernel's MaskVariant: ``base`` (the built-in pattern's) with the programmable parts."""
        return replace(base, bias="" if self.bias is None else str(self.bias.dtype), dropout=self.dropout_p > 0,
                       block_sparse=self.block_sparse, mods="" if self.modifiers is None else self.modifiers.key)


def given(bias, dropout_p, seed, block_mask, score_mod, mask_mod) -> bool:
    """Whether a call asks for any programmable part (the plain path's one test)."""
    return not (bias is None and not dropout_p and seed is None and block_mask is None and score_mod is None
                and mask_mod is None)


def _device_array(name: str, x, device_id: Optional[int]):
    import cupy

    if not isinstance(x, cupy.ndarray):
        raise TypeError(f"{name} must be a CuPy array (or a CUDA array of the framework of q), got {type(x).__name__}")
    if device_id is not None and x.data.device_id != device_id:
        raise ValueError(f"{name} is on device {x.data.device_id}, q on device {device_id}")
    return x


def _check_bias(bias, q_dtype, full: tuple, device_id: Optional[int]):
    """bias as a 4-D view broadcast to ``full`` (B, Hq, Nq, Nk) with stride 0 in its broadcast dims and key
    stride 0 or 1 (a copy where it is neither)."""
    import cupy

    bias = _device_array("bias", bias, device_id)
    if np.dtype(bias.dtype) not in (np.dtype(np.float32), np.dtype(q_dtype)):
        raise TypeError(f"bias must be float32 or q's dtype {np.dtype(q_dtype)}, got {bias.dtype}")
    if bias.ndim > 4:
        raise ValueError(f"bias must have at most 4 dimensions (batch, heads_q, seqlen_q, seqlen_k), got shape "
                         f"{bias.shape}")
    shape4 = (1,) * (4 - bias.ndim) + tuple(bias.shape)
    if any(n not in (1, f) for n, f in zip(shape4, full)):
        raise ValueError(f"bias must broadcast to (batch, heads_q, seqlen_q, seqlen_k) = {full} (each dim 1 or "
                         f"that size), got shape {tuple(bias.shape)}")
    b4 = bias.reshape(shape4)
    if shape4[3] > 1 and b4.strides[3] != b4.itemsize:
        b4 = cupy.ascontiguousarray(b4)   # the kernel steps along the keys by 0 or 1 element
    return cupy.broadcast_to(b4, full)


def _check_seed(dropout_p, seed, offset, device_id: Optional[int]):
    """(dropout_p, seed, offset, rng_state) checked: seed an int in [0, 2^64) or a CuPy uint64 array (2,)
    holding (seed, offset) on the device (then read by the kernel at each launch and replay)."""
    if isinstance(dropout_p, (bool, np.bool_)) or not isinstance(dropout_p, (int, float, np.integer, np.floating)):
        raise TypeError(f"dropout_p must be a float in [0, 1), got {type(dropout_p).__name__} {dropout_p!r}")
    p = float(dropout_p)
    if not 0.0 <= p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p!r}")
    if p == 0.0:
        return 0.0, 0, 0, None
    if seed is None:
        raise ValueError("dropout_p > 0 needs a seed (an int, or a CuPy uint64 array (2,) of (seed, offset) on the "
                         "device): the backward regenerates the mask from it")
    if hasattr(seed, "dtype") and hasattr(seed, "shape"):
        state = _device_array("seed", seed, device_id)
        if np.dtype(state.dtype) not in (np.dtype(np.uint64), np.dtype(np.int64)) or tuple(state.shape) != (2,):
            raise ValueError(f"a device seed must be a uint64 (or int64) array (2,) holding (seed, offset), got "
                             f"{state.dtype} {tuple(state.shape)}")
        if not state.flags.c_contiguous:
            raise ValueError("a device seed must be contiguous")
        return p, 0, 0, state.view(np.uint64)
    return p, philox._check_u64("seed", seed), philox._check_u64("offset", offset), None


def check_arguments(q, *, bias=None, dropout_p=0.0, seed=None, offset=0, block_mask=None, block_size=None,
                    score_mod=None, mask_mod=None, batch: int, heads_q: int, seqlen_q: int, seqlen_k: int,
                    device_id: Optional[int]) -> ProgArgs:
    """The checked programmable arguments of a call (TypeError / ValueError naming the argument; a modifier that
    does not compile raises ModifierCompileError), before any kernel. ``device_id`` None: no device checks."""
    from ._checks import dtype_name

    if dtype_name(q.dtype) not in ("float16", "bfloat16", "float32"):
        raise ValueError(f"bias, dropout, block masks and modifiers take float16, bfloat16 or float32 q, got {q.dtype}")
    full = (batch, heads_q, seqlen_q, seqlen_k)
    b4 = None if bias is None else _check_bias(bias, q.dtype, full, device_id)
    p, seed_, offset_, state = _check_seed(dropout_p, seed, offset, device_id)
    mask, bs = None, block_sparse.check_block_size(block_sparse.DEFAULT_BLOCK_SIZE if block_size is None
                                                   else block_size)
    if block_mask is not None:
        mask, bs = block_sparse.check_block_mask(_device_array("block_mask", block_mask, device_id), batch, heads_q,
                                                 seqlen_q, seqlen_k, bs)
    mods = None
    if score_mod is not None or mask_mod is not None:
        if score_mod is not None and not isinstance(score_mod, ScoreMod):
            raise TypeError(f"score_mod must be a cuflash.ScoreMod, got {type(score_mod).__name__}")
        if mask_mod is not None and not isinstance(mask_mod, MaskMod):
            raise TypeError(f"mask_mod must be a cuflash.MaskMod, got {type(mask_mod).__name__}")
        mods = Modifiers(score_mod, mask_mod)
        for name, t in mods.slots.items():
            _device_array(f"modifier tensor {name!r}", t, device_id)
        if mods.key not in _checked_modifiers:
            mods.check_compiles()
            _checked_modifiers.add(mods.key)
    return ProgArgs(b4, () if bias is None else tuple(bias.shape), p, seed_, offset_, state, mask, bs, mods)


MASK_TILES_WARPS = 4


def mask_mod_coverage(mods: Modifiers, *, batch: int, heads: int, seqlen_q: int, seqlen_k: int, block_m: int,
                      block_n: int, device_id: int, opts):
    """(any, all): bool (B', H', query tiles, key tiles), whether the mask modifier shows some / every element of
    each block_m x block_n tile (B' = batch or 1 where it does not depend on b, H' likewise), evaluated on the
    device once per shape and tile and cached on the MaskMod (kernels_cu/aux/mask_tiles.cu)."""
    import cupy

    from . import launch
    from .config import KernelConfig
    from .dispatch import get_kernel
    from .variants import MaskVariant

    mm = mods.mask_mod
    nb, nh = (batch if mm.per_batch else 1), (heads if mm.per_head else 1)
    mt, nt = -(-seqlen_q // block_m), -(-seqlen_k // block_n)
    key = (nb, nh, seqlen_q, seqlen_k, block_m, block_n, device_id, mods.key,
           tuple(t.data.ptr for t in mods.tensor_arrays()))
    found = mm.tile_cache.get(key)
    if found is None:
        cfg = KernelConfig("mask_tiles", "float16", 0, False, block_m, block_n, MASK_TILES_WARPS,
                           MaskVariant(mods=mods.key))
        kern = get_kernel(cfg, device_id, opts.nvrtc_defines)
        state = cupy.empty((nb, nh, mt, nt), dtype=np.uint8)
        t = params.pack_bytes(params.MASK_TILES_PARAMS, (state.data.ptr, seqlen_q, seqlen_k, nh, mt, nt))
        pp = prog_params(ProgArgs(modifiers=mods), seqlen_q=seqlen_q, seqlen_k=seqlen_k, block_m=block_m,
                         block_n=block_n, keep=[])
        launch.launch(kern, cfg, (nt, mt, nb * nh), t, 0, (np.frombuffer(pp, dtype=f"V{len(pp)}"),))
        found = mm.tile_cache[key] = (state >= 1, state == 2)
    return found


def _coverage(prog: ProgArgs, seqlen_q: int, seqlen_k: int, block_m: int, block_n: int, coverage=None):
    """(any, all) of the kernel's block_m x block_n tiles: whether some / every element is shown by the block mask
    and the mask modifier's ``coverage`` (mask_mod_coverage); None without either."""
    if prog.block_mask is None:
        return coverage
    any_on, all_on = block_sparse.tile_coverage(prog.block_mask, prog.block_size, seqlen_q, seqlen_k, block_m, block_n)
    if coverage is not None:
        any_on, all_on = any_on & coverage[0], all_on & coverage[1]
    return any_on, all_on


def _tile_lists(prog: ProgArgs, seqlen_q: int, seqlen_k: int, block_m: int, block_n: int, coverage=None):
    """(kv_count, kv_index) of the kernel's tiles: per query tile the key tiles that some on block and the mask
    modifier show, partial where either hides an element (_coverage)."""
    return block_sparse.key_tile_lists(*_coverage(prog, seqlen_q, seqlen_k, block_m, block_n, coverage))


BLOCK_LISTS_WARPS = 4


def _device_tile_lists(prog: ProgArgs, seqlen_q: int, seqlen_k: int, block_m: int, block_n: int, coverage,
                       device_id: int, opts):
    """_tile_lists by one kernel (kernels_cu/aux/block_lists.cu): (kv_count, kv_index) with the same entries up to
    each count (those past it unwritten)."""
    import cupy

    from . import launch
    from .config import KernelConfig
    from .dispatch import get_kernel

    mt, nt = -(-seqlen_q // block_m), -(-seqlen_k // block_n)
    shapes = []
    mask = prog.block_mask
    if mask is not None:
        if not mask.flags.c_contiguous:
            mask = cupy.ascontiguousarray(mask)
        shapes.append(mask.shape[:2])
    state = None
    if coverage is not None:   # mask_mod_coverage's (any, all) as its states 0 / 1 / 2
        state = coverage[0].astype(np.uint8) + coverage[1].astype(np.uint8)
        shapes.append(state.shape[:2])
    nb, nh = max(s[0] for s in shapes), max(s[1] for s in shapes)
    count = cupy.empty((nb, nh, mt), dtype=np.int32)
    index = cupy.empty((nb, nh, mt, nt), dtype=np.int32)
    values = dict(block_mask=0, mask_batch_stride=0, mask_head_stride=0, mask_row_stride=0, state=0,
                  state_batch_stride=0, state_head_stride=0, count=count.data.ptr, index=index.data.ptr, heads=nh,
                  seqlen_q=seqlen_q, seqlen_k=seqlen_k, block_q=prog.block_size[0], block_k=prog.block_size[1],
                  block_m=block_m, block_n=block_n, m_tiles=mt, n_tiles=nt)
    if mask is not None:
        qb, kb = mask.shape[2], mask.shape[3]
        values.update(block_mask=mask.data.ptr, mask_batch_stride=_stride(mask.shape, 0, mask.shape[1] * qb * kb),
                      mask_head_stride=_stride(mask.shape, 1, qb * kb), mask_row_stride=kb)
    if state is not None:
        values.update(state=state.data.ptr, state_batch_stride=_stride(state.shape, 0, state.shape[1] * mt * nt),
                      state_head_stride=_stride(state.shape, 1, mt * nt))
    cfg = KernelConfig("block_lists", "float16", 0, False, 0, 0, BLOCK_LISTS_WARPS)
    kern = get_kernel(cfg, device_id, opts.nvrtc_defines)
    p = params.pack_bytes(params.BLOCK_LISTS_PARAMS, tuple(values[n] for n in params.BLOCK_LISTS_PARAMS.names))
    launch.launch(kern, cfg, (mt, nb * nh, 1), p, 0)
    from . import capture

    capture.keep_if_capturing(mask, state)   # inputs made here, read by the kernel
    return count, index


def _stride(shape: tuple, axis: int, elems: int) -> int:
    """Elements between (b, h) groups along ``axis`` of a (B', H', ...) array, 0 where it is broadcast."""
    return 0 if shape[axis] == 1 else elems


def prog_params(prog: ProgArgs, *, seqlen_q: int, seqlen_k: int, block_m: int, block_n: int, keep: list,
                coverage=None, lists: bool = True, device: Optional[tuple] = None) -> bytes:
    """The ProgParams bytes of a launch; ``keep`` receives the arrays made here (the tile lists), which must live
    until the kernel has run; ``coverage``: the mask modifier's (mask_mod_coverage), where it has one; ``lists``:
    whether the kernel reads the key-tile lists (the dK / dV kernels read tile_state instead); ``device``:
    (device id, Options) of the launch, where one kernel builds the lists (aux/block_lists.cu); without it they come
    from array operations (_tile_lists: the tests' reference, numpy or CuPy)."""
    p = {name: 0 for name in params.PROG_PARAMS.names}
    if prog.bias is not None:
        b = prog.bias
        p["bias"] = b.data.ptr
        for name, st in zip(("batch", "head", "row", "col"), b.strides):
            p[f"bias_{name}_stride"] = st // b.itemsize
    if prog.dropout_p > 0:
        p["rng_state"] = 0 if prog.rng_state is None else prog.rng_state.data.ptr
        p["seed"], p["offset"] = prog.seed, prog.offset
        p["dropout_threshold"] = philox.dropout_threshold(prog.dropout_p)
        p["dropout_scale"] = 1.0 / (1.0 - prog.dropout_p)
    if lists and (prog.block_mask is not None or coverage is not None):
        if device is not None:
            kv_count, kv_index = found = _device_tile_lists(prog, seqlen_q, seqlen_k, block_m, block_n, coverage,
                                                            *device)
        else:
            kv_count, kv_index = found = _tile_lists(prog, seqlen_q, seqlen_k, block_m, block_n, coverage)
        keep.extend(found)
        mt, nt = kv_count.shape[2], kv_index.shape[3]
        p.update(kv_tile_count=kv_count.data.ptr, kv_tile_index=kv_index.data.ptr, q_tiles=mt, kv_tiles=nt,
                 kv_tiles_batch_stride=_stride(kv_count.shape, 0, kv_count.shape[1] * mt),
                 kv_tiles_head_stride=_stride(kv_count.shape, 1, mt))
    if prog.block_mask is not None:
        m = prog.block_mask
        if not m.flags.c_contiguous:
            import cupy

            m = cupy.ascontiguousarray(m)
            keep.append(m)
        nqb, nkb = m.shape[2], m.shape[3]
        p.update(block_mask=m.data.ptr, block_mask_batch_stride=_stride(m.shape, 0, m.shape[1] * nqb * nkb),
                 block_mask_head_stride=_stride(m.shape, 1, nqb * nkb), block_mask_row_stride=nkb,
                 block_q=prog.block_size[0], block_k=prog.block_size[1])
    if prog.modifiers is not None:
        for i, t in enumerate(prog.modifiers.tensor_arrays()):
            p[f"mod_tensor{i}"] = t.data.ptr
    return params.pack_bytes(params.PROG_PARAMS, tuple(p[name] for name in params.PROG_PARAMS.names))


def _plan(dtype, head_dim: int, causal: bool, variant, device_id: int, opts, head_dim_v: int, portable: bool = False):
    """(kernel, config, shared memory) of the programmable forward, cached per call shape like the plain plans;
    ``portable``: the portable kernel's even on Hopper (where TMA cannot address the inputs)."""
    from . import heuristics
    from ._checks import dtype_name
    from .dispatch import device_info, get_kernel, smem_bytes

    key = (dtype_name(dtype), head_dim, causal, variant, device_id, opts.token, head_dim_v, portable)
    plan = _plans.get(key)
    if plan is None:
        cc, smem_limit = device_info(device_id, opts)
        cc = 80 if portable else cc
        cfg = heuristics.prog_fwd_config(dtype_name(dtype), head_dim, causal, cc, variant, head_dim_v=head_dim_v,
                                         opts=opts)
        cfg = heuristics.fit_shared_memory(cfg, smem_limit, lambda c: smem_bytes(c, device_id, opts.nvrtc_defines))
        plan = _plans[key] = (get_kernel(cfg, device_id, opts.nvrtc_defines), cfg,
                              smem_bytes(cfg, device_id, opts.nvrtc_defines))
    return plan


_plans: dict = {}


def launch_forward(q, k, v, out, lse, prog: ProgArgs, *, causal: bool, scale: float, dims, device_id: int, opts,
                   var) -> None:
    """The programmable forward on the current stream (arguments as api._launch_fwd's, and the checked
    ``prog``)."""
    if q.dtype == np.float32:   # the exact float32 kernels
        from . import programmable_simt
        return programmable_simt.launch_forward(q, k, v, out, lse, prog, causal=causal, scale=scale, dims=dims,
                                                device_id=device_id, opts=opts, var=var)
    from . import sm90
    from .api import LOG2E

    b, nq, nk, hq, hkv, d = dims
    variant = prog.variant(var.kernel)
    kern, cfg, smem = _plan(q.dtype, d, causal, variant, device_id, opts, v.shape[3])
    maps = ()
    if cfg.fam.sm90_fwd:   # the tensor maps of q, k and v, or the portable kernel where TMA cannot address them
        found = sm90.fwd_tensor_maps(cfg, q, k, v)
        if found is None:
            kern, cfg, smem = _plan(q.dtype, d, causal, variant, device_id, opts, v.shape[3], portable=True)
        else:
            maps = (found,)
    fwd = params.pack_bytes(params.FWD_PARAMS, (
        q.data.ptr, k.data.ptr, v.data.ptr, out.data.ptr, lse.data.ptr if lse is not None else 0,
        *params.element_strides(q), *params.element_strides(k), *params.element_strides(v),
        *params.element_strides(out), b, nq, nk, hq, hq // hkv, d, scale, scale * LOG2E,
        *var.param_values(nq, nk, scale), *params.DENSE_VARLEN_VALUES))
    _launch_fwd_prog(kern, cfg, smem, fwd, maps, prog, batch=b, heads=hq, seqlen_q=nq, seqlen_k=nk,
                     device_id=device_id, opts=opts)


def _launch_fwd_prog(kern, cfg, smem, fwd: bytes, maps: tuple, prog: ProgArgs, *, batch: int, heads: int,
                     seqlen_q: int, seqlen_k: int, device_id: int, opts) -> None:
    """Launches a programmable forward kernel with FwdParams ``fwd`` and its ProgParams (a varlen call's at its
    longest sequence's lengths) on the current stream."""
    from . import capture, launch

    keep: list = []
    coverage = None
    if prog.modifiers is not None and prog.modifiers.has_mask_mod:
        coverage = mask_mod_coverage(prog.modifiers, batch=batch, heads=heads, seqlen_q=seqlen_q, seqlen_k=seqlen_k,
                                     block_m=cfg.block_m, block_n=cfg.block_n, device_id=device_id, opts=opts)
    blob = prog_params(prog, seqlen_q=seqlen_q, seqlen_k=seqlen_k, block_m=cfg.block_m, block_n=cfg.block_n,
                       keep=keep, coverage=coverage, device=(device_id, opts))
    extra = np.frombuffer(blob, dtype=f"V{len(blob)}")   # the second by-value parameter
    launch.launch(kern, cfg, launch.fwd_grid(cfg, batch, heads, seqlen_q), fwd, smem, (*maps, extra))
    for x in keep:   # made for this launch: alive until it has run, captured graphs included
        capture.keep_if_capturing(x)


def launch_forward_varlen(q, k, v, out, lse, lay, prog: ProgArgs, *, causal: bool, scale: float, opts, var) -> None:
    """The programmable forward of a packed (varlen) batch on the current stream (``lay``: varlen.VarlenLayout):
    the portable kernel on every GPU, each sequence a problem of its own (common/varlen.cuh) whose bias rows,
    block mask, dropout stream and modifier indices are those of batch index b at its own positions, as if the
    sequences were padded to (batch, max_seqlen_q, max_seqlen_k)."""
    import dataclasses

    from .api import LOG2E, _packed_strides, _varlen_values

    max_q, max_k = lay.max_seqlen_q, lay.max_seqlen_k
    variant = prog.variant(dataclasses.replace(var.kernel, varlen=True))
    kern, cfg, smem = _plan(q.dtype, lay.head_dim_qk, causal, variant, lay.device_id, opts, lay.head_dim_v,
                            portable=True)
    fwd = params.pack_bytes(params.FWD_PARAMS, (
        q.data.ptr, k.data.ptr, v.data.ptr, out.data.ptr, lse.data.ptr if lse is not None else 0,
        *_packed_strides(q), *_packed_strides(k), *_packed_strides(v), *_packed_strides(out),
        lay.batch, max_q, max_k, lay.heads_q, lay.heads_q // lay.heads_kv, lay.head_dim_qk, scale, scale * LOG2E,
        *var.param_values(max_q, max_k, scale), *_varlen_values(lay)))
    _launch_fwd_prog(kern, cfg, smem, fwd, (), prog, batch=lay.batch, heads=lay.heads_q, seqlen_q=max_q,
                     seqlen_k=max_k, device_id=lay.device_id, opts=opts)


def _tile_state(prog: ProgArgs, coverage, seqlen_q: int, seqlen_k: int, block_m: int, block_n: int):
    """The backward's dK / dV tiles' states (uint8 (B', H', query tiles, key tiles): 0 hidden, 1 elements to test,
    2 shown whole) from the block mask and the mask modifier's ``coverage`` at those tiles; None without either."""
    found = _coverage(prog, seqlen_q, seqlen_k, block_m, block_n, coverage)
    if found is None:
        return None
    return found[0].astype(np.uint8) + found[1].astype(np.uint8)


def launch_backward(dout, q, k, v, out, lse, dq, dk, dv, prog: ProgArgs, *, causal: bool, scale: float, dims,
                    device_id: int, opts, var, dlse=None, deterministic: bool = False):
    """The programmable backward on the current stream. On Hopper (heuristics.prog_bwd_configs): the plain
    backward's launches (api._launch_bwd) with the Hopper dK / dV kernel that takes ProgParams; elsewhere, where
    TMA cannot address the inputs, or ``deterministic``: the preprocess (delta), dK / dV with dbias and the
    modifiers' tensor gradients (bwd_dkdv_prog_kernel), dQ (bwd_dq_prog_kernel). Returns (dsinks or None, dbias in
    the bias's shape and dtype or None, {tensor name: float32 gradient} of the score modifier's tensor_grads)."""
    if q.dtype == np.float32:   # the exact float32 kernels
        from . import programmable_simt
        return programmable_simt.launch_backward(dout, q, k, v, out, lse, dq, dk, dv, prog, causal=causal, scale=scale,
                                                 dims=dims, device_id=device_id, opts=opts, var=var, dlse=dlse,
                                                 deterministic=deterministic)
    import dataclasses

    import cupy

    from . import capture, sm90

    b, nq, nk, hq, hkv, d = dims
    variant = prog.variant(dataclasses.replace(var.kernel, sink=False))   # the backward has no sink code
    per_query = prog.bias is not None and ((1,) * 4 + tuple(prog.bias_shape))[-2] > 1
    plan = _bwd_plan(q.dtype, d, causal, variant, device_id, opts, deterministic, bias_per_query=per_query)
    hopper = plan[1][1].fam.sm90_bwd
    if hopper and (v.shape[3] != d or sm90.bwd_tensor_maps(plan[1][1], q, k, v, dout) is None
                   or b * hq * 2 * -(-nq // plan[1][1].block_m) * plan[1][1].block_m >= 2**32):
        plan, hopper = _bwd_plan(q.dtype, d, causal, variant, device_id, opts, deterministic, portable=True,
                                 bias_per_query=per_query), False
    kcfg = plan[1][1]
    dbias_accum, grads, extra_fields = _bwd_outputs(prog)
    keep: list = [dbias_accum]
    qcfg = None if hopper else plan[2][1]
    pp_dkdv, pp_dq = _bwd_prog_params(prog, kcfg, qcfg, extra_fields, keep, batch=b, heads=hq, seqlen_q=nq,
                                      seqlen_k=nk, device_id=device_id, opts=opts)
    if hopper:   # the plain backward's workspaces and launches, this dK / dV kernel with ProgParams
        from .api import _launch_bwd

        dsinks, _, _ = _launch_bwd(dout, q, k, v, out, lse, dq, dk, dv, causal=causal, scale=scale,
                                   deterministic=False, dims=dims, device_id=device_id, var=var, dlse=dlse, opts=opts,
                                   plans=plan, dkdv_tail=(_v(pp_dkdv),))
    else:
        delta = cupy.empty((b, hq, nq), dtype=np.float32)
        keep.append(delta)
        _launch_portable_backward(plan, (dout, q, k, v, out, lse, delta, dq, dk, dv), (pp_dkdv, pp_dq),
                                  params.element_strides, sizes=(b, nq, nk, hq, hkv, d), scale=scale, rows=nq, var=var,
                                  dlse=dlse, varlen_values=params.DENSE_VARLEN_VALUES)
        dsinks = _dsinks(var, lse, delta)
    capture.keep_if_capturing(*keep)
    return dsinks, _dbias(prog, dbias_accum), grads


def launch_backward_varlen(dout, q, k, v, out, lse, dq, dk, dv, lay, prog: ProgArgs, *, causal: bool, scale: float,
                           opts, var, dlse=None):
    """The programmable backward of a packed (varlen) batch on the current stream: the preprocess (delta), the
    portable dK / dV kernel with dbias and the modifiers' tensor gradients, then the dQ kernel, each sequence as
    launch_forward_varlen describes. Returns (delta (heads_q, total_q), dbias or None, {tensor name: float32
    gradient}); delta is 0 outside the sequences' rows."""
    import dataclasses

    import cupy

    from . import capture
    from .api import _packed_strides, _varlen_values

    b, hq, hkv, d = lay.batch, lay.heads_q, lay.heads_kv, lay.head_dim_qk
    max_q, max_k, total_q = lay.max_seqlen_q, lay.max_seqlen_k, lay.total_q
    variant = prog.variant(dataclasses.replace(var.kernel, sink=False, varlen=True))
    pkern_plan, kkern_plan, qkern_plan = _bwd_plan(q.dtype, d, causal, variant, lay.device_id, opts, True,
                                                   portable=True)
    kcfg, qcfg = kkern_plan[1], qkern_plan[1]
    dbias_accum, grads, fields = _bwd_outputs(prog)
    keep: list = [dbias_accum]
    pp_dkdv, pp_dq = _bwd_prog_params(prog, kcfg, qcfg, fields, keep, batch=b, heads=hq, seqlen_q=max_q,
                                      seqlen_k=max_k, device_id=lay.device_id, opts=opts)
    delta = cupy.zeros((hq, total_q), dtype=np.float32)   # rows outside every sequence: never written
    keep.append(delta)
    _launch_portable_backward((pkern_plan, kkern_plan, qkern_plan), (dout, q, k, v, out, lse, delta, dq, dk, dv),
                              (pp_dkdv, pp_dq), _packed_strides, sizes=(b, max_q, max_k, hq, hkv, d), scale=scale,
                              rows=total_q, var=var, dlse=dlse, varlen_values=_varlen_values(lay))
    capture.keep_if_capturing(*keep)
    return delta, _dbias(prog, dbias_accum), grads


def _launch_portable_backward(plan, tensors, prog_params, strides, *, sizes, scale: float, rows: int, var, dlse,
                              varlen_values) -> None:
    """The portable programmable backward's three launches on the current stream, one BWD_PARAMS for all: the
    preprocess (delta), dK / dV with ``prog_params[0]``, dQ with ``prog_params[1]``. ``plan``: their (kernel, config,
    shared memory); ``tensors``: (dout, q, k, v, out, lse, delta, dq, dk, dv); ``strides``: a tensor's element
    strides (dense or packed); ``sizes``: (batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim), a packed batch's
    maxima; ``rows``: the rows of lse and delta (seqlen_q, or a packed batch's total_q)."""
    from . import launch
    from .api import LOG2E

    (pkern, pcfg, psmem), (kkern, kcfg, ksmem), (qkern, qcfg, qsmem) = plan
    dout, q, k, v, out, lse, delta, dq, dk, dv = tensors
    b, nq, nk, hq, hkv, d = sizes
    p = params.pack_bytes(params.BWD_PARAMS, (
        q.data.ptr, k.data.ptr, v.data.ptr, out.data.ptr, dout.data.ptr, lse.data.ptr, delta.data.ptr, 0,
        dq.data.ptr, dk.data.ptr, dv.data.ptr, 0,
        *(s for x in (q, k, v, out, dout, dq, dk, dv) for s in strides(x)),
        b, nq, nk, hq, hq // hkv, d, scale, scale * LOG2E, rows, d, 0, 0, 0, 0,
        *var.param_values(nq, nk, scale), dlse.data.ptr if dlse is not None else 0, *varlen_values))
    launch.launch(pkern, pcfg, launch.bwd_row_grid(pcfg, b, hq, nq), p, psmem)
    launch.launch(kkern, kcfg, launch.bwd_dkdv_grid(kcfg, b, hkv, nk), p, ksmem, (_v(prog_params[0]),))
    launch.launch(qkern, qcfg, launch.bwd_row_grid(qcfg, b, hq, nq), p, qsmem, (_v(prog_params[1]),))


def _dsinks(var, lse, delta):
    """The sinks' gradient as the plain backward's: P(sink) (dlse - delta), summed in a fixed order; None without
    sinks."""
    import cupy

    if var.sinks is None:
        return None
    return -(cupy.exp(var.sinks[None, :, None] - lse) * delta).sum(axis=(0, 2))


def _bwd_outputs(prog: ProgArgs):
    """(dbias's float32 sums in the bias's own 4-D shape, broadcast dims at stride 0, or None; {tensor name: float32
    gradient} of the score modifier's tensor_grads; the ProgParams fields that point at them)."""
    import cupy

    dbias_accum = None
    fields = {}
    if prog.bias is not None:
        compact = (1,) * (4 - len(prog.bias_shape)) + prog.bias_shape
        dbias_accum = cupy.zeros(compact, dtype=np.float32)
        strides = [0 if n == 1 else st // 4 for n, st in zip(compact, dbias_accum.strides)]
        fields.update(dbias_accum=dbias_accum.data.ptr, dbias_batch_stride=strides[0],
                      dbias_head_stride=strides[1], dbias_row_stride=strides[2], dbias_col_stride=strides[3])
    grads = {}
    if prog.modifiers is not None and prog.modifiers.score_mod is not None:
        names = list(prog.modifiers.slots)
        for name in prog.modifiers.score_mod.tensor_grads:
            t = prog.modifiers.slots[name]
            grads[name] = cupy.zeros(t.shape, dtype=np.float32)
            fields[f"mod_grad{names.index(name)}"] = grads[name].data.ptr
    return dbias_accum, grads, fields


def _bwd_prog_params(prog: ProgArgs, kcfg, qcfg, fields: dict, keep: list, *, batch: int, heads: int, seqlen_q: int,
                     seqlen_k: int, device_id: int, opts) -> tuple:
    """The ProgParams bytes of the dK / dV kernel (its tiles' states) and of the portable dQ kernel (its key-tile
    lists; None where ``qcfg`` is None), with ``fields`` (_bwd_outputs) set; arrays made here go to ``keep``."""
    def coverage_at(cfg):
        if prog.modifiers is None or not prog.modifiers.has_mask_mod:
            return None
        return mask_mod_coverage(prog.modifiers, batch=batch, heads=heads, seqlen_q=seqlen_q, seqlen_k=seqlen_k,
                                 block_m=cfg.block_m, block_n=cfg.block_n, device_id=device_id, opts=opts)

    kcov = coverage_at(kcfg)
    state = _tile_state(prog, kcov, seqlen_q, seqlen_k, kcfg.block_m, kcfg.block_n)
    dkdv_fields = dict(fields)
    if state is not None:
        keep.append(state)
        dkdv_fields.update(tile_state=state.data.ptr, q_tiles=state.shape[2], kv_tiles=state.shape[3],
                           tile_state_batch_stride=_stride(state.shape, 0, state.shape[1] * state.shape[2]
                                                           * state.shape[3]),
                           tile_state_head_stride=_stride(state.shape, 1, state.shape[2] * state.shape[3]))
    pp_dkdv = _with_fields(prog_params(prog, seqlen_q=seqlen_q, seqlen_k=seqlen_k, block_m=kcfg.block_m,
                                       block_n=kcfg.block_n, keep=keep, coverage=kcov, lists=False), dkdv_fields)
    pp_dq = None
    if qcfg is not None:
        pp_dq = _with_fields(prog_params(prog, seqlen_q=seqlen_q, seqlen_k=seqlen_k, block_m=qcfg.block_m,
                                         block_n=qcfg.block_n, keep=keep, coverage=coverage_at(qcfg),
                                         device=(device_id, opts)), fields)
    return pp_dkdv, pp_dq


def _dbias(prog: ProgArgs, dbias_accum):
    """dbias in the bias's own shape and dtype from its float32 sums (None without a bias)."""
    if dbias_accum is None:
        return None
    return dbias_accum.reshape(prog.bias_shape).astype(prog.bias.dtype)


def _bwd_plan(dtype, head_dim: int, causal: bool, variant, device_id: int, opts, deterministic: bool,
              portable: bool = False, bias_per_query: bool = True) -> tuple:
    """((kernel, config, shared memory) of the preprocess, the dK / dV kernel, then the dQ kernel (portable) or
    the postprocess (Hopper)) of the programmable backward, cached; ``portable``: the portable kernels even on
    Hopper."""
    from . import heuristics
    from ._checks import dtype_name
    from .dispatch import device_info, get_kernel, smem_bytes

    key = ("bwd", dtype_name(dtype), head_dim, causal, variant, device_id, opts.token, deterministic, portable,
           bias_per_query)
    plan = _plans.get(key)
    if plan is None:
        cc, _ = device_info(device_id, opts)
        cfgs = heuristics.prog_bwd_configs(dtype_name(dtype), head_dim, causal, 80 if portable else cc, variant,
                                           deterministic=deterministic, opts=opts, bias_per_query=bias_per_query)
        plan = _plans[key] = tuple((get_kernel(c, device_id, opts.nvrtc_defines), c,
                                    smem_bytes(c, device_id, opts.nvrtc_defines))
                                   for c in (cfgs.preprocess, cfgs.dkdv, cfgs.dq or cfgs.postprocess))
    return plan


def _v(blob: bytes) -> np.ndarray:
    return np.frombuffer(blob, dtype=f"V{len(blob)}")


def _with_fields(blob: bytes, fields: dict) -> bytes:
    """ProgParams bytes with ``fields`` set."""
    if not fields:
        return blob
    rec = np.frombuffer(blob, dtype=params.PROG_PARAMS).copy()
    for name, value in fields.items():
        rec[name] = value
    return rec.tobytes()
