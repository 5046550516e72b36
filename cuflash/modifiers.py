"""User score and mask modifiers written in CUDA C (issue #45): ``cuflash.ScoreMod`` and ``cuflash.MaskMod``.

A modifier is a few lines of CUDA C over FlexAttention's names: ``score`` (the scaled score, after
softmax_scale, float), ``b``, ``h`` (batch and query head), ``q_idx``, ``kv_idx`` (the sequence's own query
row and key, 0 .. seqlen - 1, ints) and the tensors passed with it, each by its name as a typed pointer.
cuflash builds it into the kernels' source as one struct (:meth:`Modifiers.source`), compiled with NVRTC once
per source text and configuration like every kernel. A modifier that does not compile raises
:class:`ModifierCompileError` (a ValueError) before any kernel runs, with NVRTC's message and the user's line.

A score modifier's ``grad`` is its derivative by the score (CUDA C returning float; the backward needs it);
``tensor_grads`` maps a tensor's name to CUDA C statements that accumulate ``dscore`` (the gradient of the
modifier's output, a float) into ``d_<name>``, a float32 array of the tensor's shape, e.g. with ``atomicAdd``:
CUDA C has no autodiff, so the user writes them, as for any custom op.
"""
from __future__ import annotations

import hashlib
import keyword
import re
from typing import Any, Mapping, Optional

from .params import MOD_TENSOR_SLOTS

# The C type a tensor is read as, by NumPy dtype name. 16-bit floats are raw words: the preamble's
# half_to_float / bf16_to_float convert them (the kernels compile without CUDA's headers).
TENSOR_TYPES = {"float32": "float", "float64": "double", "int32": "int", "int64": "long long", "int16": "short",
                "int8": "signed char", "uint8": "unsigned char", "bool": "unsigned char", "float16": "u16",
                "bfloat16": "u16"}

# Names the generated code takes for itself.
RESERVED = frozenset({"score", "b", "h", "q_idx", "kv_idx", "dscore", "pp"})
_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
_CXX_KEYWORDS = frozenset("""alignas alignof and asm auto bool break case catch char class const constexpr
    const_cast continue decltype default delete do double dynamic_cast else enum explicit export extern false float
    for friend goto if inline int long mutable namespace new noexcept not nullptr operator or private protected
    public register reinterpret_cast return short signed sizeof static static_assert static_cast struct switch
    template this throw true try typedef typeid typename union unsigned using virtual void volatile wchar_t while
    xor""".split())

PREAMBLE = r"""
// Helpers a modifier may call: 16-bit tensors are read as raw words.
__device__ __forceinline__ float half_to_float(u16 x) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(x));
    return f;
}
__device__ __forceinline__ float bf16_to_float(u16 x) { return __uint_as_float(static_cast<u32>(x) << 16); }
"""


# Every Modifiers built in this process, by key: the kernels' sources append the struct of their variant's key.
_REGISTRY: dict[str, str] = {}


def struct_name(key: str) -> str:
    """The C++ name of the struct generated for modifiers of this key."""
    return f"CuflashMods_{key}"


def source_of(key: str) -> str:
    """The generated source of the modifiers of ``key`` (built in this process)."""
    try:
        return _REGISTRY[key]
    except KeyError:
        raise KeyError(f"no modifiers of key {key!r} were built in this process (cuflash.modifiers.Modifiers)") \
            from None


class ModifierCompileError(ValueError):
    """A user modifier that NVRTC rejects: the message names the modifier's part and line."""


def _dtype_name(x) -> str:
    dtype = getattr(x, "dtype", None)
    if dtype is None:
        raise TypeError(f"a modifier's tensor must be an array with a dtype, got {type(x).__name__}")
    name = str(dtype).replace("torch.", "")
    return {"bool_": "bool"}.get(name, name)


def _check_name(name: Any, what: str) -> str:
    if not isinstance(name, str) or not _IDENT.match(name) or name in _CXX_KEYWORDS or keyword.iskeyword(name):
        raise ValueError(f"{what} must be a C identifier, got {name!r}")
    if name in RESERVED or name.startswith("d_") or name.startswith("cuflash"):
        raise ValueError(f"{what} {name!r} is taken by the generated code (reserved: {sorted(RESERVED)}, d_*, "
                         f"cuflash*)")
    return name


def _check_source(source: Any, what: str) -> str:
    if not isinstance(source, str) or not source.strip():
        raise TypeError(f"{what} must be CUDA C source text (a non-empty str), got {source!r}")
    if "return" not in source and what != "tensor_grads":
        raise ValueError(f"{what} must return a value (CUDA C statements ending in a return), got {source!r}")
    return source


class _Modifier:
    """What ScoreMod and MaskMod share: the tensors, checked."""

    kind = ""

    def __init__(self, source: str, tensors: Optional[Mapping[str, Any]]):
        self.source = _check_source(source, self.kind)
        tensors = dict(tensors or {})
        for name, t in tensors.items():
            _check_name(name, f"{self.kind} tensor name")
            dtype = _dtype_name(t)
            if dtype not in TENSOR_TYPES:
                raise TypeError(f"{self.kind} tensor {name!r} has dtype {dtype}; supported: {sorted(TENSOR_TYPES)}")
        self.tensors = tensors

    def tensor_types(self) -> dict[str, str]:
        return {name: TENSOR_TYPES[_dtype_name(t)] for name, t in self.tensors.items()}


class ScoreMod(_Modifier):
    """``score_mod``: CUDA C statements returning the new score (float) from ``score``, ``b``, ``h``, ``q_idx``,
    ``kv_idx`` and ``tensors`` (name -> array, read by name as typed pointers). ``grad``: statements returning
    d(new score) / d(score) (needed by the backward); ``tensor_grads``: name -> statements that accumulate
    ``dscore`` into ``d_<name>`` (float32, the tensor's shape), returned by the backward.

    Example: ``ScoreMod("return score + table[h * 64 + min(abs(q_idx - kv_idx), 63)];", grad="return 1.f;",
    tensors={"table": t}, tensor_grads={"table": "atomicAdd(&d_table[h * 64 + min(abs(q_idx - kv_idx), 63)],
    dscore);"})``."""

    kind = "score_mod"

    def __init__(self, source: str, grad: Optional[str] = None, *, tensors: Optional[Mapping[str, Any]] = None,
                 tensor_grads: Optional[Mapping[str, str]] = None):
        super().__init__(source, tensors)
        self.grad = None if grad is None else _check_source(grad, "score_mod grad")
        tensor_grads = dict(tensor_grads or {})
        for name, stmts in tensor_grads.items():
            if name not in self.tensors:
                raise ValueError(f"tensor_grads names {name!r}, which is not among the tensors "
                                 f"{sorted(self.tensors)}")
            _check_source(stmts, "tensor_grads")
        if tensor_grads and self.grad is None:
            raise ValueError("a score_mod with tensor_grads needs grad (its derivative by the score)")
        self.tensor_grads = tensor_grads


class MaskMod(_Modifier):
    """``mask_mod``: CUDA C statements returning whether key ``kv_idx`` is visible from query row ``q_idx``
    (bool) of batch ``b``, head ``h``, from them and ``tensors``. cuflash evaluates it once per shape over the
    kernel's tiles (cached on this object: build a new MaskMod when its tensors change), so that tiles it hides
    wholly are skipped and those it shows wholly are not tested. ``per_batch`` / ``per_head`` False: the mask does
    not depend on b / h, and is evaluated for one of them."""

    kind = "mask_mod"

    def __init__(self, source: str, *, tensors: Optional[Mapping[str, Any]] = None, per_batch: bool = True,
                 per_head: bool = True):
        super().__init__(source, tensors)
        for name, flag in (("per_batch", per_batch), ("per_head", per_head)):
            if not isinstance(flag, bool):
                raise TypeError(f"{name} must be a bool, got {flag!r}")
        # Whether the mask depends on b / h: where it does not, its tiles are evaluated for one batch / head.
        self.per_batch, self.per_head = per_batch, per_head
        # The tiles' states per shape and tile (programmable.mask_mod_coverage): evaluated once, so a mask whose
        # tensors change in place needs a new MaskMod.
        self.tile_cache: dict = {}


def _function(ret: str, name: str, args: str, body: str, label: str, resume_line: int) -> str:
    """One member function whose body is the user's text, with #line so that NVRTC names the user's lines."""
    return (f"    __device__ __forceinline__ {ret} {name}({args}) const {{\n#line 1 \"{label}\"\n{body}\n"
            f"#line {resume_line} \"cuflash_modifiers\"\n    }}\n")


class Modifiers:
    """A call's score and mask modifiers as one struct of generated CUDA C (``source``), with the tensor slots
    they read; ``key`` names the generated text (the kernels' cache key)."""

    def __init__(self, score_mod: Optional[ScoreMod] = None, mask_mod: Optional[MaskMod] = None):
        if score_mod is not None and not isinstance(score_mod, ScoreMod):
            raise TypeError(f"score_mod must be a cuflash.ScoreMod, got {type(score_mod).__name__}")
        if mask_mod is not None and not isinstance(mask_mod, MaskMod):
            raise TypeError(f"mask_mod must be a cuflash.MaskMod, got {type(mask_mod).__name__}")
        self.score_mod, self.mask_mod = score_mod, mask_mod
        # Tensor slots: a name read by both modifiers must be the same array (one slot).
        self.slots: dict[str, Any] = {}
        for mod in (score_mod, mask_mod):
            for name, t in (mod.tensors.items() if mod is not None else ()):
                if name in self.slots and self.slots[name] is not t:
                    raise ValueError(f"score_mod and mask_mod both name a tensor {name!r}, with different arrays")
                self.slots[name] = t
        if len(self.slots) > MOD_TENSOR_SLOTS:
            raise ValueError(f"the modifiers read {len(self.slots)} tensors; at most {MOD_TENSOR_SLOTS}")
        self.types = {}
        for mod in (score_mod, mask_mod):
            if mod is not None:
                self.types.update(mod.tensor_types())
        self.grads = list(score_mod.tensor_grads) if score_mod is not None else []
        self.source = self._generate()
        self.key = hashlib.sha256(self.source.encode()).hexdigest()[:16]
        self.struct_name = struct_name(self.key)
        self.source = self.source.replace("CUFLASH_MODS_STRUCT", self.struct_name)
        _REGISTRY[self.key] = self.source

    @property
    def has_score_mod(self) -> bool:
        return self.score_mod is not None

    @property
    def has_mask_mod(self) -> bool:
        return self.mask_mod is not None

    def _generate(self) -> str:
        sm, mm = self.score_mod, self.mask_mod
        flag = {True: "true", False: "false"}
        lines = ["struct CUFLASH_MODS_STRUCT {",
                 f"    static constexpr bool kScoreMod = {flag[sm is not None]}, "
                 f"kScoreGrad = {flag[sm is not None and sm.grad is not None]}, "
                 f"kTensorGrads = {flag[bool(self.grads)]}, kMaskMod = {flag[mm is not None]};"]
        names = list(self.slots)
        for name in names:
            lines.append(f"    const {self.types[name]}* __restrict__ {name};")
        for name in self.grads:
            lines.append(f"    float* __restrict__ d_{name};")
        inits = [f"{name}(static_cast<const {self.types[name]}*>(pp.mod_tensor{i}))" for i, name in enumerate(names)]
        inits += [f"d_{name}(pp.mod_grad{names.index(name)})" for name in self.grads]
        ctor = "    __device__ __forceinline__ explicit CUFLASH_MODS_STRUCT(const ProgParams& pp)"
        lines.append(ctor + (" : " + ", ".join(inits) if inits else "") + " {}")
        head = "\n".join(lines) + "\n"
        # Lines are counted after the fact: each #line resumes at the generated text's own line number.
        parts, at = [head], head.count("\n") + 1
        idx = "int b, int h, int q_idx, int kv_idx"
        pieces = []
        if sm is not None:
            pieces.append(("float", "score_mod", f"float score, {idx}", sm.source, "score_mod"))
            if sm.grad is not None:
                pieces.append(("float", "score_grad", f"float score, {idx}", sm.grad, "score_mod grad"))
            if sm.tensor_grads:
                body = "\n".join(sm.tensor_grads[n] for n in sm.tensor_grads)
                pieces.append(("void", "tensor_grads", f"float score, float dscore, {idx}", body, "tensor_grads"))
        if mm is not None:
            pieces.append(("bool", "mask_mod", idx, mm.source, "mask_mod"))
        for ret, name, args, body, label in pieces:
            resume = at + 2 + body.count("\n") + 1   # the line after the body's last
            text = _function(ret, name, args, body, label, resume)
            parts.append(text)
            at += text.count("\n")
        parts.append("};\n")
        return PREAMBLE + "".join(parts)

    def check_compiles(self) -> None:
        """Compiles the modifiers alone (each function called once) with NVRTC for compute_80, so that an
        error is the user's, raised as :class:`ModifierCompileError` before any kernel is built."""
        from cupy.cuda import nvrtc

        from .compile import load_source

        calls = []
        if self.has_score_mod:
            calls.append("s += m.score_mod(s, 0, 1, 2, 3);")
            if self.score_mod.grad is not None:
                calls.append("s += m.score_grad(s, 0, 1, 2, 3);")
            if self.score_mod.tensor_grads:
                calls.append("m.tensor_grads(s, 1.f, 0, 1, 2, 3);")
        if self.has_mask_mod:
            calls.append("s += m.mask_mod(0, 1, 2, 3) ? 1.f : 0.f;")
        probe = (load_source("common/params.cuh") + "\n" + self.source
                 + f'\nextern "C" __global__ void cuflash_modifier_probe(ProgParams pp, float* out) {{\n'
                 f"    const {self.struct_name} m(pp);\n    float s = out[0];\n    "
                 + "\n    ".join(calls) + "\n    out[0] = s;\n}\n")
        prog = nvrtc.createProgram(probe, "cuflash_modifiers.cu", [], [])
        try:
            nvrtc.compileProgram(prog, ["-arch=compute_80", "-std=c++17"])
        except nvrtc.NVRTCError:
            raise ModifierCompileError(self._explain(nvrtc.getProgramLog(prog))) from None
        finally:
            nvrtc.destroyProgram(prog)

    def _user_text(self, label: str) -> str:
        sm, mm = self.score_mod, self.mask_mod
        return {"score_mod": sm and sm.source, "score_mod grad": sm and sm.grad,
                "tensor_grads": sm and "\n".join(sm.tensor_grads.values()), "mask_mod": mm and mm.source}.get(label) or ""

    def _explain(self, log: str) -> str:
        """NVRTC's log, each error of a user's part with that part's line quoted."""
        out = []
        for m in re.finditer(r'^(?:"?)([^"(\n]+)"?\((\d+)\): (error|warning)[^\n]*$', log, re.MULTILINE):
            label, line = m.group(1).strip(), int(m.group(2))
            text = m.group(0)
            user = self._user_text(label).split("\n")
            if label in ("score_mod", "score_mod grad", "tensor_grads", "mask_mod") and 1 <= line <= len(user):
                text += f"\n    {label}, line {line}: {user[line - 1].strip()}"
            out.append(text)
        detail = "\n".join(out) if out else log.strip()
        return f"a user modifier does not compile:\n{detail}"

    def tensor_arrays(self) -> list:
        """The arrays in slot order (ProgParams.mod_tensor0, ...)."""
        return list(self.slots.values())


def bind(score_mod: Optional[ScoreMod], mask_mod: Optional[MaskMod], arrays: Mapping[str, Any]) -> tuple:
    """(score_mod, mask_mod) as given, their tensors replaced by ``arrays`` (name -> array, every slot): the same
    modifiers (and generated code) over another framework's arrays, e.g. CuPy views of JAX's buffers."""
    score = None if score_mod is None else ScoreMod(
        score_mod.source, score_mod.grad, tensors={n: arrays[n] for n in score_mod.tensors},
        tensor_grads=score_mod.tensor_grads)
    mask = None if mask_mod is None else MaskMod(
        mask_mod.source, tensors={n: arrays[n] for n in mask_mod.tensors}, per_batch=mask_mod.per_batch,
        per_head=mask_mod.per_head)
    return score, mask
