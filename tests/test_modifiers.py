"""CPU-only: user modifiers written in CUDA C (cuflash.ScoreMod / MaskMod): their checks, the generated struct
(compiled with NVRTC, no GPU), and compile errors raised as ModifierCompileError naming the user's line."""
from __future__ import annotations

import numpy as np
import pytest

from cuflash.modifiers import MaskMod, ModifierCompileError, Modifiers, ScoreMod

TABLE = np.zeros(16 * 64, np.float32)
REL_BIAS = "return score + table[h * 64 + min(abs(q_idx - kv_idx), 63)];"
REL_GRAD = "atomicAdd(&d_table[h * 64 + min(abs(q_idx - kv_idx), 63)], dscore);"


def test_relative_bias_and_document_mask_compile():
    docs = np.zeros(100, np.int32)
    mods = Modifiers(ScoreMod(REL_BIAS, grad="return 1.f;", tensors={"table": TABLE}, tensor_grads={"table": REL_GRAD}),
                     MaskMod("return docs[q_idx] == docs[kv_idx];", tensors={"docs": docs}))
    mods.check_compiles()
    assert mods.tensor_arrays() == [TABLE, docs]
    assert mods.struct_name in mods.source and "d_table(pp.mod_grad0)" in mods.source


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float64", "int64", "uint8", "bool", "int8", "int16"])
def test_every_tensor_type_compiles(dtype):
    import ml_dtypes

    t = np.zeros(8, ml_dtypes.bfloat16 if dtype == "bfloat16" else dtype)
    read = {"float16": "half_to_float(t[0])", "bfloat16": "bf16_to_float(t[0])"}.get(dtype, "(float)t[0]")
    Modifiers(ScoreMod(f"return score + {read};", tensors={"t": t})).check_compiles()


def test_same_source_same_key_other_source_other_key():
    a = Modifiers(ScoreMod(REL_BIAS, tensors={"table": TABLE}))
    b = Modifiers(ScoreMod(REL_BIAS, tensors={"table": np.ones(4, np.float32)}))
    c = Modifiers(ScoreMod(REL_BIAS.replace("63", "31"), tensors={"table": TABLE}))
    d = Modifiers(ScoreMod(REL_BIAS, tensors={"table": np.ones(4, np.float64)}))
    assert a.key == b.key   # the arrays are run-time values
    assert len({a.key, c.key, d.key}) == 3


def test_compile_error_names_the_users_line():
    mods = Modifiers(None, MaskMod("int d = docs[q_idx];\nreturn d == dcs[kv_idx];", tensors={"docs": np.zeros(3, np.int32)}))
    with pytest.raises(ModifierCompileError, match=r'(?s)mask_mod\(2\): error: identifier "dcs" is undefined.*'
                                                   r"mask_mod, line 2: return d == dcs\[kv_idx\];"):
        mods.check_compiles()
    assert issubclass(ModifierCompileError, ValueError)
    with pytest.raises(ModifierCompileError, match=r"score_mod grad\(1\)"):
        Modifiers(ScoreMod("return score;", grad="return nope;")).check_compiles()


@pytest.mark.parametrize("make,error,match", [
    (lambda: ScoreMod(""), TypeError, "CUDA C source"),
    (lambda: ScoreMod(3), TypeError, "CUDA C source"),
    (lambda: ScoreMod("score * 2;"), ValueError, "must return"),
    (lambda: ScoreMod("return score;", tensors={"score": TABLE}), ValueError, "taken by the generated code"),
    (lambda: ScoreMod("return score;", tensors={"d_x": TABLE}), ValueError, "taken by the generated code"),
    (lambda: ScoreMod("return score;", tensors={"int": TABLE}), ValueError, "C identifier"),
    (lambda: ScoreMod("return score;", tensors={"a-b": TABLE}), ValueError, "C identifier"),
    (lambda: ScoreMod("return score;", tensors={"t": np.zeros(2, np.complex64)}), TypeError, "dtype complex64"),
    (lambda: ScoreMod("return score;", tensors={"t": [1.0]}), TypeError, "array with a dtype"),
    (lambda: ScoreMod("return score;", tensor_grads={"t": REL_GRAD}), ValueError, "not among the tensors"),
    (lambda: ScoreMod("return score;", tensors={"t": TABLE}, tensor_grads={"t": REL_GRAD}), ValueError, "needs grad"),
    (lambda: Modifiers(MaskMod("return true;")), TypeError, "score_mod must be a cuflash.ScoreMod"),
    (lambda: Modifiers(None, ScoreMod("return score;")), TypeError, "mask_mod must be a cuflash.MaskMod"),
    (lambda: Modifiers(ScoreMod("return score;", tensors={"t": TABLE}),
                       MaskMod("return true;", tensors={"t": np.zeros(2, np.float32)})), ValueError, "different arrays"),
    (lambda: Modifiers(ScoreMod("return score;", tensors={f"t{i}": TABLE for i in range(9)})), ValueError, "at most 8"),
])
def test_bad_modifiers_raise(make, error, match):
    with pytest.raises(error, match=match):
        make()
