"""XLA's typed FFI (``xla/ffi/api/c_api.h``) in ctypes: a Python function as an XLA custom-call handler.

cuflash has no compiled extension, so the handler XLA calls is a ``ctypes.CFUNCTYPE`` trampoline into
Python. This module holds the C structures it reads (the call frame with its buffers and attributes,
the API table, the metadata extension), decodes a call frame into plain Python values and turns a Python
exception into an ``XLA_FFI_Error``. It imports neither JAX nor CuPy.

ABI notes: the structs carry their sizes, and those of the call frame, the metadata and the API table are
checked before the fields read; enums are C ints. The layouts are those of FFI API 0.3 (jaxlib 0.10,
checked against its header by tests/test_jax.py); later minor versions only add fields at the ends.
"""
from __future__ import annotations

import ctypes
import re
from ctypes import POINTER, Structure, c_char_p, c_int, c_int32, c_int64, c_size_t, c_uint32, c_void_p
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import numpy as np

# The API version this module's layouts follow; reported to XLA when no jaxlib header says otherwise.
API_MAJOR, API_MINOR = 0, 3

EXTENSION_METADATA = 1
STAGE_EXECUTE = 3
ARG_BUFFER = 1
ATTR_ARRAY, ATTR_DICTIONARY, ATTR_SCALAR, ATTR_STRING = 1, 2, 3, 4
ERROR_INVALID_ARGUMENT, ERROR_UNKNOWN, ERROR_INTERNAL = 3, 2, 13
TRAITS_NONE = 0   # not XLA_FFI_HANDLER_TRAITS_COMMAND_BUFFER_COMPATIBLE: XLA never captures the call in a graph


class ExtensionBase(Structure):
    pass


ExtensionBase._fields_ = [("struct_size", c_size_t), ("type", c_int), ("next", POINTER(ExtensionBase))]


class ApiVersion(Structure):
    _fields_ = [("struct_size", c_size_t), ("extension_start", c_void_p),
                ("major_version", c_int), ("minor_version", c_int)]


class Buffer(Structure):
    _fields_ = [("struct_size", c_size_t), ("extension_start", c_void_p),
                ("dtype", c_int), ("data", c_void_p), ("rank", c_int64), ("dims", POINTER(c_int64))]


class Args(Structure):
    _fields_ = [("struct_size", c_size_t), ("extension_start", c_void_p),
                ("size", c_int64), ("types", POINTER(c_int)), ("args", POINTER(c_void_p))]


class Rets(Structure):
    _fields_ = [("struct_size", c_size_t), ("extension_start", c_void_p),
                ("size", c_int64), ("types", POINTER(c_int)), ("rets", POINTER(c_void_p))]


class ByteSpan(Structure):
    _fields_ = [("ptr", c_void_p), ("len", c_size_t)]


class Scalar(Structure):
    _fields_ = [("dtype", c_int), ("value", c_void_p)]


class Attrs(Structure):
    _fields_ = [("struct_size", c_size_t), ("extension_start", c_void_p),
                ("size", c_int64), ("types", POINTER(c_int)), ("names", POINTER(POINTER(ByteSpan))),
                ("attrs", POINTER(c_void_p))]


class CallFrame(Structure):
    _fields_ = [("struct_size", c_size_t), ("extension_start", POINTER(ExtensionBase)),
                ("api", c_void_p), ("ctx", c_void_p), ("stage", c_int),
                ("args", Args), ("rets", Rets), ("attrs", Attrs), ("future", c_void_p)]


class Metadata(Structure):
    _fields_ = [("struct_size", c_size_t), ("api_version", ApiVersion), ("traits", c_uint32),
                ("state_type_id", c_int64)]


class MetadataExtension(Structure):
    _fields_ = [("extension_base", ExtensionBase), ("metadata", POINTER(Metadata))]


class ErrorCreateArgs(Structure):
    _fields_ = [("struct_size", c_size_t), ("extension_start", c_void_p),
                ("message", c_char_p), ("errc", c_int)]


class StreamGetArgs(Structure):
    _fields_ = [("struct_size", c_size_t), ("extension_start", c_void_p),
                ("ctx", c_void_p), ("stream", c_void_p)]


class DeviceOrdinalGetArgs(Structure):
    _fields_ = [("struct_size", c_size_t), ("extension_start", c_void_p),
                ("ctx", c_void_p), ("device_ordinal", c_int32)]


_API_FUNCTIONS = ("Error_Create", "Error_GetMessage", "Error_Destroy", "Handler_Register", "Stream_Get",
                  "Type_Register", "ExecutionContext_Get", "State_Set", "State_Get", "DeviceMemory_Allocate",
                  "DeviceMemory_Free", "ThreadPool_Schedule", "ThreadPool_NumThreads", "Future_Create",
                  "Future_SetAvailable", "Future_SetError", "RunId_Get", "DeviceOrdinal_Get")


class Api(Structure):
    _fields_ = [("struct_size", c_size_t), ("extension_start", c_void_p), ("api_version", ApiVersion),
                ("internal_api", c_void_p)] + [(f"XLA_FFI_{n}", c_void_p) for n in _API_FUNCTIONS]


def _struct_size(struct: type, last_field: str) -> int:
    """XLA_FFI_STRUCT_SIZE: the offset of the last field plus its size (no trailing padding)."""
    f = getattr(struct, last_field)
    return f.offset + f.size


# The sizes the C API's *_STRUCT_SIZE enums give (the struct up to its last named field).
CALL_FRAME_SIZE = _struct_size(CallFrame, "attrs")
METADATA_SIZE = _struct_size(Metadata, "traits")
METADATA_EXTENSION_SIZE = _struct_size(MetadataExtension, "metadata")
API_VERSION_SIZE = _struct_size(ApiVersion, "minor_version")
BUFFER_SIZE = _struct_size(Buffer, "dims")

_ErrorCreate = ctypes.CFUNCTYPE(c_void_p, POINTER(ErrorCreateArgs))
_StreamGet = ctypes.CFUNCTYPE(c_void_p, POINTER(StreamGetArgs))
_DeviceOrdinalGet = ctypes.CFUNCTYPE(c_void_p, POINTER(DeviceOrdinalGetArgs))
HandlerFunction = ctypes.CFUNCTYPE(c_void_p, POINTER(CallFrame))

# XLA_FFI_DataType -> NumPy dtype name (the ones a handler here can meet; bfloat16 through ml_dtypes).
DTYPES = {1: "bool", 2: "int8", 3: "int16", 4: "int32", 5: "int64", 6: "uint8", 7: "uint16", 8: "uint32",
          9: "uint64", 10: "float16", 11: "float32", 12: "float64", 16: "bfloat16"}
_SCALAR_CTYPES = {1: ctypes.c_bool, 2: ctypes.c_int8, 3: ctypes.c_int16, 4: c_int32, 5: c_int64,
                  6: ctypes.c_uint8, 7: ctypes.c_uint16, 8: c_uint32, 9: ctypes.c_uint64,
                  11: ctypes.c_float, 12: ctypes.c_double}


class FfiError(Exception):
    """An error a handler reports to XLA with a given XLA_FFI_Error_Code (default INVALID_ARGUMENT)."""

    def __init__(self, message: str, code: int = ERROR_INVALID_ARGUMENT):
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class BufferView:
    """One argument or result buffer: its device (or host) address, dtype name and dims (row-major)."""

    ptr: int
    dtype: str
    shape: tuple

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * np.dtype(numpy_dtype(self.dtype)).itemsize


@dataclass
class Call:
    """A decoded call frame: buffers, attributes by name, and access to the execution context."""

    args: list
    rets: list
    attrs: dict
    _api: int = field(repr=False, default=0)
    _ctx: int = field(repr=False, default=0)

    def stream(self) -> int:
        """The platform stream XLA runs this call on (a ``CUstream`` on CUDA); FfiError if it has none."""
        api = Api.from_address(self._api)
        fn = _api_function(api, "Stream_Get")
        args = StreamGetArgs(_struct_size(StreamGetArgs, "stream"), None, self._ctx, None)
        _raise_on_error(api, _StreamGet(fn)(ctypes.byref(args)), "XLA_FFI_Stream_Get")
        return args.stream or 0

    def device_ordinal(self) -> int:
        """XLA's ordinal of the device this call runs on."""
        api = Api.from_address(self._api)
        fn = _api_function(api, "DeviceOrdinal_Get")
        args = DeviceOrdinalGetArgs(_struct_size(DeviceOrdinalGetArgs, "device_ordinal"), None, self._ctx, 0)
        _raise_on_error(api, _DeviceOrdinalGet(fn)(ctypes.byref(args)), "XLA_FFI_DeviceOrdinal_Get")
        return args.device_ordinal


def numpy_dtype(name: str):
    """The NumPy dtype of a ``DTYPES`` name (bfloat16 is ml_dtypes')."""
    if name == "bfloat16":
        import ml_dtypes

        return ml_dtypes.bfloat16
    return np.dtype(name)


def _api_function(api: Api, name: str) -> int:
    """The address of ``XLA_FFI_<name>`` in the API table, if the runtime's table is long enough to hold it."""
    f = getattr(Api, f"XLA_FFI_{name}")
    if api.struct_size < f.offset + f.size:
        raise FfiError(f"XLA's FFI API table has no XLA_FFI_{name} (struct size {api.struct_size})", ERROR_INTERNAL)
    fn = getattr(api, f"XLA_FFI_{name}")
    if not fn:
        raise FfiError(f"XLA_FFI_{name} is null in XLA's FFI API table", ERROR_INTERNAL)
    return fn


class _ErrorArgs(Structure):
    """XLA_FFI_Error_GetMessage_Args; XLA_FFI_Error_Destroy_Args is its prefix up to ``error``."""

    _fields_ = [("struct_size", c_size_t), ("extension_start", c_void_p), ("error", c_void_p), ("message", c_void_p)]


_ErrorCall = ctypes.CFUNCTYPE(None, POINTER(_ErrorArgs))


def _raise_on_error(api: Api, error: Optional[int], what: str) -> None:
    """An XLA_FFI_Error returned by an API call becomes an FfiError (its message is read, then it is freed)."""
    if not error:
        return
    message = f"{what} failed"
    try:
        args = _ErrorArgs(_struct_size(_ErrorArgs, "message"), None, error, None)
        _ErrorCall(_api_function(api, "Error_GetMessage"))(ctypes.byref(args))
        if args.message:
            message += ": " + ctypes.string_at(args.message).decode(errors="replace")
        args = _ErrorArgs(_struct_size(_ErrorArgs, "error"), None, error, None)
        _ErrorCall(_api_function(api, "Error_Destroy"))(ctypes.byref(args))
    except FfiError:
        pass
    raise FfiError(message, ERROR_INTERNAL)


def _buffers(count: int, types, pointers, kind: str) -> list:
    out = []
    for i in range(count):
        if types[i] != ARG_BUFFER:
            raise FfiError(f"{kind} {i} is not a buffer (type {types[i]})")
        b = Buffer.from_address(pointers[i])
        if b.dtype not in DTYPES:
            raise FfiError(f"{kind} {i} has an XLA dtype cuflash does not handle ({b.dtype})")
        out.append(BufferView(b.data or 0, DTYPES[b.dtype], tuple(b.dims[j] for j in range(b.rank))))
    return out


def _attributes(attrs: Attrs) -> dict:
    """Scalar and string attributes by name (arrays and dictionaries are refused: no handler here takes one)."""
    out = {}
    for i in range(attrs.size):
        span = attrs.names[i].contents
        name = ctypes.string_at(span.ptr, span.len).decode()
        kind = attrs.types[i]
        if kind == ATTR_SCALAR:
            s = Scalar.from_address(attrs.attrs[i])
            ctype = _SCALAR_CTYPES.get(s.dtype)
            if ctype is None:
                raise FfiError(f"attribute {name!r} has a scalar dtype cuflash does not read ({s.dtype})")
            out[name] = ctype.from_address(s.value).value
        elif kind == ATTR_STRING:
            span = ByteSpan.from_address(attrs.attrs[i])
            out[name] = ctypes.string_at(span.ptr, span.len).decode()
        else:
            raise FfiError(f"attribute {name!r} is of a kind cuflash does not read ({kind})")
    return out


def decode(frame: CallFrame) -> Call:
    """The buffers and attributes of an execute-stage call frame."""
    if frame.struct_size < CALL_FRAME_SIZE:
        raise FfiError(f"XLA_FFI_CallFrame of {frame.struct_size} bytes, expected at least {CALL_FRAME_SIZE}")
    args = _buffers(frame.args.size, frame.args.types, frame.args.args, "argument")
    rets = _buffers(frame.rets.size, frame.rets.types, frame.rets.rets, "result")
    return Call(args, rets, _attributes(frame.attrs), frame.api or 0, frame.ctx or 0)


def _write_metadata(extension: MetadataExtension, version: tuple) -> None:
    """Answers XLA's metadata query (made at registration, with no API table): the API version the
    handler speaks and its traits (none: not command-buffer compatible)."""
    md = extension.metadata.contents
    if md.struct_size < METADATA_SIZE:
        raise FfiError(f"XLA_FFI_Metadata of {md.struct_size} bytes, expected at least {METADATA_SIZE}")
    md.api_version = ApiVersion(API_VERSION_SIZE, None, version[0], version[1])
    md.traits = TRAITS_NONE
    if md.struct_size >= _struct_size(Metadata, "state_type_id"):
        md.state_type_id = 0   # XLA_FFI_UNKNOWN_TYPE_ID: a stateless handler


def _error(frame: CallFrame, message: str, code: int) -> Optional[int]:
    """A new XLA_FFI_Error (XLA takes ownership), or None where the frame has no API table to make one."""
    if not frame.api:
        return None
    api = Api.from_address(frame.api)
    create = _ErrorCreate(_api_function(api, "Error_Create"))
    args = ErrorCreateArgs(_struct_size(ErrorCreateArgs, "errc"), None, message.encode(errors="replace"), code)
    return create(ctypes.byref(args))


# The error of last resort: when building the handler's own error fails (a message that cannot be made,
# memory, an API table without Error_Create at that moment), a handler must still not return NULL, which
# XLA reads as success with the outputs unwritten. Everything it needs is made ahead: the arguments (with
# a static message; XLA copies it) here, and each API table's Error_Create before the handler's body runs.
_FALLBACK_MESSAGE = (b"cuflash: the custom call failed, and reporting its error failed too "
                     b"(see stderr); its outputs were not written")
_fallback_args = ErrorCreateArgs(_struct_size(ErrorCreateArgs, "errc"), None, _FALLBACK_MESSAGE, ERROR_INTERNAL)
# API table address -> (its Error_Create's address, that function as ctypes). The address is compared on
# every call: a table that goes away and another one at its address (test stand-ins) must not reuse a stale one.
_fallback_creates: dict = {}


def _prepare_fallback(api_address: int) -> None:
    """Resolves the API table's Error_Create, before a handler's body runs on it (again where it changed)."""
    if not api_address:
        return
    address = _api_function(Api.from_address(api_address), "Error_Create")
    found = _fallback_creates.get(api_address)
    if found is None or found[0] != address:
        _fallback_creates[api_address] = (address, _ErrorCreate(address))


def _fallback_error(frame_ptr) -> Optional[int]:
    """The error of last resort for this frame (pre-built arguments, a pre-resolved Error_Create); when
    there is none to make, the process is aborted rather than report success with unwritten outputs."""
    try:
        create = _fallback_creates.get(frame_ptr.contents.api, (None, None))[1]
        if create is not None:
            error = create(ctypes.byref(_fallback_args))
            if error:
                return error
    except BaseException:   # noqa: BLE001 - nothing may escape to XLA
        pass
    _abort()
    return None


def _abort() -> None:
    """Writes one line to stderr and aborts: the only answer left that is not a false success."""
    import os

    try:
        os.write(2, b"cuflash: an XLA custom call failed and no XLA_FFI_Error could be made: aborting\n")
    finally:
        os.abort()


def make_handler(body: Callable[[Call], None], version: tuple = (API_MAJOR, API_MINOR)):
    """A C function pointer (``XLA_FFI_Handler*``) that runs ``body(call)`` on each execute-stage call.

    ``body`` reads its inputs from ``call.args`` and writes ``call.rets``; an exception it raises reaches
    the caller of the XLA computation as an error with its message. The returned object must be kept
    alive for as long as XLA may call it (for ever, once registered). ctypes takes the GIL on entry.
    """

    def entry(frame_ptr):
        try:
            frame = frame_ptr.contents
            ext = frame.extension_start
            if ext and ext.contents.type == EXTENSION_METADATA:
                _write_metadata(ctypes.cast(ext, POINTER(MetadataExtension)).contents, version)
                return None
            _prepare_fallback(frame.api)
            if frame.stage != STAGE_EXECUTE:
                raise FfiError(f"cuflash handlers run at the execute stage only, called at stage {frame.stage}")
            body(decode(frame))
            return None
        except BaseException as e:   # an escaped exception would read as success (ctypes returns NULL)
            return _report(frame_ptr, e)

    return HandlerFunction(entry)


def _report(frame_ptr, e: BaseException) -> Optional[int]:
    """The XLA_FFI_Error for ``e``, or the error of last resort if making it fails; never raises."""
    try:
        frame = frame_ptr.contents
        if isinstance(e, FfiError):
            error = _error(frame, str(e), e.code)
        else:
            error = _error(frame, f"{type(e).__name__}: {e}", ERROR_UNKNOWN)
        if error:
            return error
        raise FfiError("the call frame has no API table to make an error with", ERROR_INTERNAL)
    except BaseException as failure:   # noqa: BLE001
        try:
            import sys
            import traceback

            traceback.print_exception(type(failure), failure, failure.__traceback__, file=sys.stderr)
        except BaseException:   # noqa: BLE001
            pass
        return _fallback_error(frame_ptr)


def capsule(handler) -> object:
    """A PyCapsule holding the handler's address, as ``jax.ffi.register_ffi_target`` takes it."""
    new = ctypes.pythonapi.PyCapsule_New
    new.restype = ctypes.py_object
    new.argtypes = (c_void_p, c_char_p, c_void_p)
    return new(ctypes.cast(handler, c_void_p).value, None, None)


def header_version(include_dir: str) -> Optional[tuple]:
    """(major, minor) of ``xla/ffi/api/c_api.h`` under ``include_dir`` (jaxlib ships the header its XLA
    was built with), or None when it is not there."""
    path = Path(include_dir) / "xla" / "ffi" / "api" / "c_api.h"
    try:
        text = path.read_text()
    except OSError:
        return None
    major = re.search(r"#define\s+XLA_FFI_API_MAJOR\s+(\d+)", text)
    minor = re.search(r"#define\s+XLA_FFI_API_MINOR\s+(\d+)", text)
    return (int(major.group(1)), int(minor.group(1))) if major and minor else None
