"""CPU-only: programmable attention's host side (cuflash/programmable.py, and programmable_simt.py for float32): the
argument checks before any kernel (fake CuPy arrays: metadata only), the gate while its kernels are unvalidated, the
kernel's variant and configuration, and the ProgParams a launch would pass."""
from __future__ import annotations

import numpy as np
import pytest

from conftest import fake_cupy_array as arr

from cuflash import heuristics, options, params, programmable, programmable_simt
from cuflash.variants import MaskVariant

B, NQ, NK, HQ, HKV, D = 2, 100, 130, 4, 2, 64


def _qkv(dtype=np.float16):
    return arr((B, NQ, HQ, D), dtype), arr((B, NK, HKV, D), dtype), arr((B, NK, HKV, D), dtype)


def _check(**kw):
    q = kw.pop("q", _qkv()[0])
    return programmable.check_arguments(q, batch=B, heads_q=HQ, seqlen_q=NQ, seqlen_k=NK, device_id=0, **kw)


@pytest.mark.parametrize("kw,error,match", [
    (dict(bias=np.zeros((NQ, NK), np.float32)), TypeError, "bias must be a CuPy array"),
    (dict(bias="bias"), TypeError, "bias must be a CuPy array"),
    (dict(bias=arr((NQ, NK), np.float64)), TypeError, "bias must be float32 or q's dtype"),
    (dict(bias=arr((1, 1, 1, NQ, NK), np.float32)), ValueError, "at most 4 dimensions"),
    (dict(bias=arr((B, HQ, NQ, NK + 1), np.float32)), ValueError, "bias must broadcast"),
    (dict(bias=arr((3, 1, 1, NK), np.float32)), ValueError, "bias must broadcast"),
    (dict(bias=arr((NQ, NK), np.float32, device_id=1)), ValueError, "bias is on device 1"),
    (dict(dropout_p=1.0, seed=1), ValueError, r"dropout_p must be in \[0, 1\)"),
    (dict(dropout_p=-0.1, seed=1), ValueError, r"dropout_p must be in \[0, 1\)"),
    (dict(dropout_p="0.1", seed=1), TypeError, "dropout_p must be a float"),
    (dict(dropout_p=0.1), ValueError, "needs a seed"),
    (dict(dropout_p=0.1, seed=-1), ValueError, "seed must be in"),
    (dict(dropout_p=0.1, seed=1.5), TypeError, "seed must be an int"),
    (dict(dropout_p=0.1, seed=1, offset=2**64), ValueError, "offset must be in"),
    (dict(dropout_p=0.1, seed=arr((3,), np.uint64)), ValueError, r"uint64 \(or int64\) array \(2,\)"),
    (dict(dropout_p=0.1, seed=arr((2,), np.int32)), ValueError, r"uint64 \(or int64\) array \(2,\)"),
    (dict(block_mask=arr((1, 1, 2, 2), np.bool_)), ValueError, "block_mask must have shape"),
    (dict(block_mask=arr((1, 1, 1, 2), np.int8)), TypeError, "dtype bool"),
    (dict(block_mask=np.ones((1, 1, 1, 2), bool)), TypeError, "block_mask must be a CuPy array"),
    (dict(block_mask=arr((1, 1, 4, 5), np.bool_), block_size=0), ValueError, "block_size"),
    (dict(score_mod="return score;"), TypeError, "score_mod must be a cuflash.ScoreMod"),
    (dict(mask_mod="return true;"), TypeError, "mask_mod must be a cuflash.MaskMod"),
    (dict(q=arr((B, NQ, HQ, D), np.float32), bias=arr((NQ, NK), np.float16)), TypeError,
     "bias must be float32 or q's dtype float32"),
])
def test_bad_arguments_raise_before_any_kernel(kw, error, match):
    with pytest.raises(error, match=match):
        _check(**kw)


def test_a_modifier_that_does_not_compile_names_its_line():
    from cuflash import MaskMod, ModifierCompileError

    with pytest.raises(ModifierCompileError, match=r"mask_mod, line 1: return q_idx >= kv_idxx;"):
        _check(mask_mod=MaskMod("return q_idx >= kv_idxx;"))
    from cuflash import ScoreMod

    with pytest.raises(TypeError, match="modifier tensor 'table' must be a CuPy array"):
        _check(score_mod=ScoreMod("return score + table[0];", tensors={"table": np.zeros(2, np.float32)}))


def test_the_public_call_checks_before_the_device(device_forbidden):
    import cuflash

    q, k, v = _qkv()
    with pytest.raises(ValueError, match="bias must broadcast"):
        cuflash.forward(q, k, v, bias=arr((3, NK), np.float32))
    with pytest.raises(ValueError, match="needs a seed"):
        cuflash.forward(q, k, v, dropout_p=0.5)


def test_variant_and_configuration():
    from cuflash import MaskMod
    from cuflash.modifiers import Modifiers

    mods = Modifiers(None, MaskMod("return q_idx != kv_idx;"))
    prog = programmable.ProgArgs(bias=arr((B, HQ, NQ, NK), np.float32), dropout_p=0.1, seed=1, modifiers=mods)
    var = prog.variant(MaskVariant(local=True))
    assert (var.bias, var.dropout, var.block_sparse, var.mods, var.local) == ("float32", True, True, mods.key, True)
    assert var.template_arg(True) == (f"ProgVariant<MaskVariant<true, true, false, false, false, false>, float, true, "
                                      f"true, CuflashMods_{mods.key}>")
    assert not var.plain and var.programmable and "+Bfloat32DXM" in var.tag()
    for d in (32, 64, 96, 128, 192, 256, 512):
        for cc in (80, 86, 90):
            cfg = heuristics.prog_fwd_config("bfloat16", d, True, cc, var)
            if cc == 90 and d <= 256:   # Hopper's own kernel, at most 64 keys a tile with dropout or a mask
                assert cfg.family == "sm90_fwd_prog" and cfg.block_n <= heuristics.PROG_SM90_FWD_MAX_BLOCK_N
                assert cfg.block_m == 128 and cfg.num_warps == 12
                assert cfg.name_expression().startswith("fwd_prog_overlap_kernel<bf16_tag")
                with options.override(fwd_backend="sm80"):   # the portable kernels asked for
                    assert heuristics.prog_fwd_config("bfloat16", d, True, cc, var).family == "sm80_fwd_prog"
                continue
            assert cfg.family == "sm80_fwd_prog" and cfg.block_n <= heuristics.PROG_FWD_MAX_BLOCK_N
            assert cfg.variant == var and cfg.name_expression().startswith("fwd_prog_kernel<bf16_tag")

    # The plain variants keep their C++ types and keys.
    assert MaskVariant().template_arg(False) == "MaskVariant<false, false, false, false, false, false>"
    assert MaskVariant(local=True).tag() == "L"


def test_prog_params_of_a_broadcast_bias_and_dropout():
    q = _qkv()[0]
    prog = _check(q=q, bias=arr((B, 1, 1, NK), np.float16), dropout_p=0.1, seed=2**40 + 5, offset=9)
    blob = programmable.prog_params(prog, seqlen_q=NQ, seqlen_k=NK, block_m=128, block_n=32, keep=[])
    p = np.frombuffer(blob, params.PROG_PARAMS)[0]
    assert (p["bias_batch_stride"], p["bias_head_stride"], p["bias_row_stride"], p["bias_col_stride"]) == (NK, 0, 0, 1)
    assert (p["seed"], p["offset"], p["rng_state"]) == (2**40 + 5, 9, 0)
    assert p["dropout_threshold"] == round(0.1 * 65536) and abs(p["dropout_scale"] - 1 / 0.9) < 1e-6
    assert p["kv_tile_count"] == 0 and p["block_mask"] == 0
    keys_broadcast = _check(q=q, bias=arr((B, HQ, NQ, 1), np.float32))
    p = np.frombuffer(programmable.prog_params(keys_broadcast, seqlen_q=NQ, seqlen_k=NK, block_m=128, block_n=32,
                                               keep=[]), params.PROG_PARAMS)[0]
    assert (p["bias_batch_stride"], p["bias_head_stride"], p["bias_row_stride"], p["bias_col_stride"]) == \
        (HQ * NQ, NQ, 1, 0)


def test_tile_lists_combine_the_block_mask_and_the_mask_modifiers_coverage():
    """A tile is visited where an on block and the modifier both show something, untested only where both show
    everything; a modifier alone gives its own coverage."""
    from cuflash import block_sparse

    rng = np.random.default_rng(3)
    nq, nk, bm, bn = 100, 130, 32, 32
    mt, nt = 4, 5
    blocks = rng.random((1, HQ, 2, 3)) < 0.6            # 64 x 64 user blocks
    cov_any = rng.random((B, 1, mt, nt)) < 0.8
    cov_all = cov_any & (rng.random((B, 1, mt, nt)) < 0.5)
    prog = programmable.ProgArgs(block_mask=blocks, block_size=(64, 64))
    got = programmable._tile_lists(prog, nq, nk, bm, bn, (cov_any, cov_all))
    b_any, b_all = block_sparse.tile_coverage(blocks, (64, 64), nq, nk, bm, bn)
    want = block_sparse.lists_from_coverage(b_any & cov_any, b_all & cov_all)
    for x, y in zip(got, want):
        np.testing.assert_array_equal(x, y)
    assert got[0].shape == (B, HQ, mt)
    alone = programmable._tile_lists(programmable.ProgArgs(), nq, nk, bm, bn, (cov_any, cov_all))
    for x, y in zip(alone, block_sparse.lists_from_coverage(cov_any, cov_all)):
        np.testing.assert_array_equal(x, y)


def test_the_backward_checks_before_the_device(device_forbidden):
    import cuflash
    from cuflash import ScoreMod

    q, k, v = _qkv()
    out, dout = arr(q.shape, np.float16), arr(q.shape, np.float16)
    lse = arr((B, HQ, NQ), np.float32)
    with pytest.raises(ValueError, match="bias must broadcast"):
        cuflash.backward(dout, q, k, v, out, lse, bias=arr((3, NK), np.float32))
    with pytest.raises(ValueError, match="needs its grad"):
        cuflash.backward(dout, q, k, v, out, lse, score_mod=ScoreMod("return score * 2.f;"))
    big = arr((B, NQ, HQ, 320), np.float16), arr((B, NK, HKV, 320), np.float16)
    with pytest.raises(ValueError, match="head dims up to 256 in the backward"):
        cuflash.backward(arr((B, NQ, HQ, 320), np.float16), big[0], big[1], big[1], arr((B, NQ, HQ, 320), np.float16),
                         lse, dropout_p=0.1, seed=3)


def test_backward_configuration():
    var = MaskVariant(bias="float16", dropout=True)
    for cc in (80, 86, 90):
        for deterministic in (False, True):
            cfgs = heuristics.prog_bwd_configs("float16", 128, True, cc, var, deterministic=deterministic)
            if cc == 90 and not deterministic:   # Hopper's: the tiled dQ kernel with its postprocess
                assert (cfgs.dkdv.family, cfgs.dq, cfgs.postprocess.family) == (
                    "sm90_bwd_dkdv_dqtile_prog", None, "bwd_postprocess_tiled")
                assert (cfgs.dkdv.block_m, cfgs.dkdv.block_n, cfgs.postprocess.block_m) == (64, 64, 64)
                assert cfgs.dkdv.name_expression().startswith("bwd_dkdv_dqtile_prog_kernel<f16_tag, 128, 64, 64, 12")
                continue
            assert (cfgs.dkdv.family, cfgs.dq.family, cfgs.postprocess) == ("sm80_bwd_dkdv_prog", "sm80_bwd_dq_prog",
                                                                            None)
            assert cfgs.dkdv.name_expression().startswith("bwd_dkdv_prog_kernel<f16_tag, 128")
    with options.override(bwd_backend="sm80"):   # the portable kernels asked for
        assert heuristics.prog_bwd_configs("float16", 64, False, 90, var).dkdv.family == "sm80_bwd_dkdv_prog"
    # A bias with rows per query: split-D tiles (its reads go ahead of the GEMMs); key padding: 64 x 128.
    bias = heuristics.prog_bwd_configs("bfloat16", 128, False, 90, MaskVariant(bias="float32"))
    assert (bias.dkdv.block_m, bias.dkdv.block_n, bias.dkdv.num_warps) == (64, 64, 12)
    keypad = heuristics.prog_bwd_configs("bfloat16", 128, False, 90, MaskVariant(bias="float32"), bias_per_query=False)
    assert (keypad.dkdv.block_m, keypad.dkdv.block_n, keypad.dkdv.num_warps) == (64, 128, 12)


def test_a_seed_without_dropout_is_the_plain_call(device_forbidden, monkeypatch):
    """dropout_p 0 with a seed (a training loop's) takes the plain kernels, without the gate."""
    import cuflash
    from cuflash import api

    q, k, v = _qkv()
    seen = {}
    monkeypatch.setattr(api, "_run_forward", lambda *a, **kw: seen.setdefault("plain", True))
    cuflash.forward(q, k, v, dropout_p=0.0, seed=5)
    assert seen == {"plain": True}


class _Launches:
    """Stands in for the device: records what programmable.launch_forward / launch_backward would launch (kernel
    configs, grids, both parameter blocks), with fake allocations and the compile skipped."""

    def __init__(self, monkeypatch, cc: int = 80):
        import cupy

        from cuflash import capture, dispatch, launch

        self.calls = []
        monkeypatch.setattr(capture, "keep_if_capturing", lambda *arrays: None)
        monkeypatch.setattr(dispatch, "device_info", lambda dev, opts=None: (cc, 166912))
        monkeypatch.setattr(dispatch, "get_kernel", lambda cfg, dev, defines=(): ("kernel", cfg))
        monkeypatch.setattr(dispatch, "smem_bytes", lambda cfg, dev=None, defines=(): 1024)
        monkeypatch.setattr(launch, "launch", lambda kern, cfg, grid, p, smem, extra=(), programmatic=False:
                            self.calls.append((cfg, grid, p, extra)))
        monkeypatch.setattr(cupy, "empty", lambda shape, dtype=np.float32: arr(shape, dtype))
        monkeypatch.setattr(cupy, "zeros", lambda shape, dtype=np.float32: arr(shape, dtype))
        programmable._plans.clear()
        programmable_simt._plans.clear()

    def prog(self, i: int):
        blob = self.calls[i][3][-1]   # after the tensor maps of a Hopper kernel
        return np.frombuffer(blob.tobytes(), params.PROG_PARAMS)[0]


def test_forward_launch_glue_without_a_device(monkeypatch):
    from cuflash import api, variants

    rec = _Launches(monkeypatch)
    q, k, v = _qkv()
    out, lse = arr(q.shape, np.float16), arr((B, HQ, NQ), np.float32)
    prog = _check(q=q, bias=arr((B, 1, 1, NK), np.float16), dropout_p=0.25, seed=77, offset=5)
    var = variants.from_arguments((-1, -1), 0, 0.0, None, None, causal=True, batch=B, heads_q=HQ, device_id=None)
    programmable.launch_forward(q, k, v, out, lse, prog, causal=True, scale=0.125, dims=(B, NQ, NK, HQ, HKV, D),
                                device_id=0, opts=api.options.current(), var=var)
    (cfg, grid, p, extra), = rec.calls
    assert cfg.family == "sm80_fwd_prog" and cfg.variant.bias == "float16" and cfg.variant.dropout and cfg.causal
    assert grid == (-(-NQ // cfg.block_m), HQ, B)
    fwd = np.frombuffer(p, params.FWD_PARAMS)[0]
    assert (fwd["seqlen_q"], fwd["seqlen_k"], fwd["heads_q"], fwd["heads_per_kv"]) == (NQ, NK, HQ, HQ // HKV)
    pp = rec.prog(0)
    assert (pp["seed"], pp["offset"], pp["dropout_threshold"]) == (77, 5, round(0.25 * 65536))
    assert (pp["bias_batch_stride"], pp["bias_head_stride"], pp["bias_row_stride"], pp["bias_col_stride"]) == (NK, 0, 0, 1)


def _launch_backward(**prog_kwargs):
    """programmable.launch_backward of a non-causal call with ``prog_kwargs`` on fake arrays (under _Launches):
    its result and dq."""
    from cuflash import api, variants

    q, k, v = _qkv()
    out, dout = arr(q.shape, np.float16), arr(q.shape, np.float16)
    lse = arr((B, HQ, NQ), np.float32)
    dq, dk, dv = arr(q.shape, np.float16), arr(k.shape, np.float16), arr(v.shape, np.float16)
    prog = _check(q=q, **prog_kwargs)
    var = variants.from_arguments((-1, -1), 0, 0.0, None, None, causal=False, batch=B, heads_q=HQ, device_id=None)
    return programmable.launch_backward(dout, q, k, v, out, lse, dq, dk, dv, prog, causal=False, scale=0.125,
                                        dims=(B, NQ, NK, HQ, HKV, D), device_id=0, opts=api.options.current(),
                                        var=var), dq


@pytest.mark.parametrize("tma", [True, False])
def test_hopper_forward_launch_glue(monkeypatch, tma):
    """On Hopper the forward launches sm90_fwd_prog with the tensor maps, then ProgParams; where TMA cannot address
    the inputs, the portable kernel with ProgParams alone."""
    from cuflash import api, launch, sm90, variants

    rec = _Launches(monkeypatch, cc=90)
    monkeypatch.setattr(sm90, "fwd_tensor_maps", lambda cfg, q, k, v: "MAPS" if tma else None)
    q, k, v = _qkv()
    out, lse = arr(q.shape, np.float16), arr((B, HQ, NQ), np.float32)
    prog = _check(q=q, bias=arr((B, 1, 1, NK), np.float16), dropout_p=0.25, seed=77)
    var = variants.from_arguments((-1, -1), 0, 0.0, None, None, causal=True, batch=B, heads_q=HQ, device_id=None)
    programmable.launch_forward(q, k, v, out, lse, prog, causal=True, scale=0.125, dims=(B, NQ, NK, HQ, HKV, D),
                                device_id=0, opts=api.options.current(), var=var)
    (cfg, grid, p, extra), = rec.calls
    assert cfg.family == ("sm90_fwd_prog" if tma else "sm80_fwd_prog")
    assert grid == launch.fwd_grid(cfg, B, HQ, NQ) and len(extra) == (2 if tma else 1)
    assert extra[0] == "MAPS" if tma else True
    pp = rec.prog(0)
    assert (pp["seed"], pp["dropout_threshold"], pp["bias_col_stride"]) == (77, round(0.25 * 65536), 1)


def test_hopper_backward_launch_glue(monkeypatch):
    """On Hopper the backward runs the plain Hopper backward's launches (preprocess, dK / dV with dQ tiles,
    postprocess) with the programmable dK / dV kernel, its tensor maps, then ProgParams."""
    from cuflash import api, sm90

    rec = _Launches(monkeypatch, cc=90)
    monkeypatch.setattr(sm90, "bwd_tensor_maps", lambda cfg, q, k, v, dout: "MAPS")
    _launch_backward(dropout_p=0.1, seed=3)
    families = [c.family for c, *_ in rec.calls]
    assert families == ["bwd_preprocess", "sm90_bwd_dkdv_dqtile_prog", "bwd_postprocess_tiled"]
    dkdv_cfg, _, _, extra = rec.calls[1]
    assert extra[0] == "MAPS" and len(extra) == 2 and rec.prog(1)["seed"] == 3
    assert rec.calls[2][0].block_m == dkdv_cfg.block_m == 64   # the postprocess reads the dQ tiles of the dK / dV kernel
    with api.options.override(bwd_backend="sm80"):   # or deterministic: the portable pair
        rec.calls.clear()
        _launch_backward(dropout_p=0.1, seed=3)
        assert [c.family for c, *_ in rec.calls] == ["bwd_preprocess", "sm80_bwd_dkdv_prog", "sm80_bwd_dq_prog"]


def test_backward_launch_glue_without_a_device(monkeypatch):
    rec = _Launches(monkeypatch)
    (dsinks, dbias, grads), dq = _launch_backward(dropout_p=0.1, seed=3)
    assert dsinks is None and dbias is None and grads == {}
    families = [c.family for c, *_ in rec.calls]
    assert families == ["bwd_preprocess", "sm80_bwd_dkdv_prog", "sm80_bwd_dq_prog"]
    bwd = np.frombuffer(rec.calls[0][2], params.BWD_PARAMS)[0]
    assert (bwd["dq_accum"], bwd["dq"], bwd["seqlen_q"], bwd["heads_q"]) == (0, dq.data.ptr, NQ, HQ)
    for i in (1, 2):
        assert rec.prog(i)["seed"] == 3 and rec.prog(i)["dropout_threshold"] == round(0.1 * 65536)
    dkdv_cfg, dkdv_grid = rec.calls[1][:2]
    assert dkdv_grid == (-(-NK // dkdv_cfg.block_n), HKV, B)


def test_float32_configuration():
    """float32 takes the exact kernels' programmable families on every GPU, the plain float32 kernels' tiles, its
    variant in the kernels' names and cache keys; head dims above 256 are refused before any kernel."""
    var = MaskVariant(bias="float32", dropout=True, block_sparse=True)
    for cc in (80, 86, 90):
        for d in (32, 64, 96, 128, 192, 256):
            for causal in (False, True):
                cfg = heuristics.prog_fwd_config("float32", d, causal, cc, var)
                plain = heuristics.fwd_config("float32", d, causal, cc, variant=var)
                assert cfg.family == "simt_fwd_prog" and plain.family == "simt_fwd"
                assert (cfg.block_m, cfg.block_n, cfg.num_warps) == (plain.block_m, plain.block_n, plain.num_warps)
                assert cfg.name_expression().startswith(f"fwd_prog_kernel<float, {d}, ")
                assert "ProgVariant<" in cfg.name_expression() and "+Bfloat32DX" in cfg.key()
                for deterministic in (False, True):
                    cfgs = heuristics.prog_bwd_configs("float32", d, causal, cc, var, deterministic=deterministic)
                    assert (cfgs.preprocess.family, cfgs.dkdv.family, cfgs.dq.family, cfgs.postprocess) == (
                        "bwd_preprocess", "simt_bwd_dkdv_prog", "simt_bwd_dq_prog", None)
                    assert cfgs.dkdv.name_expression().startswith("bwd_dkdv_prog_kernel<float, ")
                    assert cfgs.dq.name_expression().startswith("bwd_dq_prog_kernel<float, ")
                    assert cfgs.dkdv.variant == cfgs.dq.variant == var
    assert heuristics.prog_fwd_config("float32", 64, False, 80, MaskVariant(dropout=True)).key() != \
        heuristics.prog_fwd_config("float32", 64, False, 80, MaskVariant(bias="float32")).key()
    with pytest.raises(ValueError, match="head dims up to 256 in float32"):
        heuristics.prog_fwd_config("float32", 512, False, 80, var)
    with pytest.raises(ValueError, match="head dims up to 256 in the backward"):
        heuristics.prog_bwd_configs("float32", 320, False, 80, var)


def test_float32_arguments():
    """float32 q takes every programmable part, a float32 bias (q's dtype) only."""
    q = arr((B, NQ, HQ, D), np.float32)
    prog = _check(q=q, bias=arr((B, 1, 1, NK), np.float32), dropout_p=0.1, seed=4,
                  block_mask=arr((1, HQ, 1, 2), np.bool_))
    assert prog.variant(MaskVariant()).bias == "float32" and prog.dropout_p == 0.1 and prog.block_sparse


@pytest.mark.parametrize("cc", [80, 90])
def test_float32_launch_glue_without_a_device(monkeypatch, cc):
    """float32 launches the simt programmable kernels on every GPU, Hopper too (no tensor maps): the forward with
    FwdParams and ProgParams, the backward's preprocess, dK / dV (its dbias fields) and dQ."""
    from cuflash import api, launch, variants

    rec = _Launches(monkeypatch, cc=cc)
    q, k, v = _qkv(np.float32)
    out, lse = arr(q.shape, np.float32), arr((B, HQ, NQ), np.float32)
    prog = _check(q=q, bias=arr((B, 1, 1, NK), np.float32), dropout_p=0.25, seed=77, offset=5)
    var = variants.from_arguments((-1, -1), 0, 0.0, None, None, causal=True, batch=B, heads_q=HQ, device_id=None)
    programmable.launch_forward(q, k, v, out, lse, prog, causal=True, scale=0.125, dims=(B, NQ, NK, HQ, HKV, D),
                                device_id=0, opts=api.options.current(), var=var)
    (cfg, grid, p, extra), = rec.calls
    assert cfg.family == "simt_fwd_prog" and cfg.variant.bias == "float32" and cfg.variant.dropout and cfg.causal
    assert grid == launch.fwd_grid(cfg, B, HQ, NQ) and len(extra) == 1
    fwd = np.frombuffer(p, params.FWD_PARAMS)[0]
    assert (fwd["seqlen_q"], fwd["seqlen_k"], fwd["heads_q"], fwd["heads_per_kv"]) == (NQ, NK, HQ, HQ // HKV)
    pp = rec.prog(0)
    assert (pp["seed"], pp["offset"], pp["dropout_threshold"]) == (77, 5, round(0.25 * 65536))
    assert (pp["bias_batch_stride"], pp["bias_head_stride"], pp["bias_row_stride"], pp["bias_col_stride"]) == \
        (NK, 0, 0, 1)

    rec.calls.clear()
    monkeypatch.setattr(programmable, "_dbias", lambda prog, sums: sums)   # its dtype conversion needs a device
    dout, dq, dk, dv = (arr(x.shape, np.float32) for x in (q, q, k, v))
    dsinks, dbias, grads = programmable.launch_backward(
        dout, q, k, v, out, lse, dq, dk, dv, prog, causal=True, scale=0.125, dims=(B, NQ, NK, HQ, HKV, D),
        device_id=0, opts=api.options.current(), var=var)
    assert dsinks is None and grads == {} and dbias.shape == (B, 1, 1, NK)
    assert [c.family for c, *_ in rec.calls] == ["bwd_preprocess", "simt_bwd_dkdv_prog", "simt_bwd_dq_prog"]
    bwd = np.frombuffer(rec.calls[0][2], params.BWD_PARAMS)[0]
    assert (bwd["dq_accum"], bwd["dq"], bwd["seqlen_q"], bwd["heads_q"]) == (0, dq.data.ptr, NQ, HQ)
    dkdv_cfg, dkdv_grid = rec.calls[1][:2]
    assert dkdv_grid == launch.bwd_dkdv_grid(dkdv_cfg, B, HKV, NK)
    for i in (1, 2):
        pp = rec.prog(i)
        assert pp["seed"] == 77 and pp["dropout_threshold"] == round(0.25 * 65536)
        assert pp["dbias_accum"] != 0 and (pp["dbias_batch_stride"], pp["dbias_row_stride"], pp["dbias_col_stride"]) \
            == (NK, 0, 1)
