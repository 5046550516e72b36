"""The XLA FFI handler's error path on the CPU, without JAX (cuflash/xla_ffi.py imports neither JAX nor CuPy):
a stand-in API table whose Error_Create records the message. A failing body becomes an error, and when
making that error fails too, the handler still returns an error (the pre-built one of last resort), never
NULL, which XLA would read as success with the outputs unwritten."""
from __future__ import annotations

import ctypes

from cuflash import xla_ffi


class FakeApi:
    """An XLA_FFI_Api whose Error_Create returns distinct fake addresses and records each message."""

    def __init__(self) -> None:
        self.messages: list = []

        def create(args):
            self.messages.append((args.contents.message, args.contents.errc))
            return 0x1000 + len(self.messages)

        self._create = xla_ffi._ErrorCreate(create)   # kept alive with the table
        self.table = xla_ffi.Api(ctypes.sizeof(xla_ffi.Api))
        self.table.XLA_FFI_Error_Create = ctypes.cast(self._create, ctypes.c_void_p).value

    def frame(self, stage: int = xla_ffi.STAGE_EXECUTE):
        f = xla_ffi.CallFrame(xla_ffi.CALL_FRAME_SIZE, None, ctypes.addressof(self.table), None, stage)
        f.args.size = f.rets.size = f.attrs.size = 0
        return f


def _call(handler, frame):
    return handler(ctypes.pointer(frame))


def test_success_returns_null():
    api = FakeApi()
    assert _call(xla_ffi.make_handler(lambda call: None), api.frame()) is None
    assert api.messages == []


def test_body_error_becomes_an_xla_error():
    api = FakeApi()

    def body(call):
        raise xla_ffi.FfiError("bad argument", xla_ffi.ERROR_INVALID_ARGUMENT)

    assert _call(xla_ffi.make_handler(body), api.frame()) == 0x1001
    assert api.messages == [(b"bad argument", xla_ffi.ERROR_INVALID_ARGUMENT)]


class _Unprintable(Exception):
    def __str__(self):
        raise RuntimeError("__str__ failed")


def test_an_error_that_cannot_be_described_still_fails_the_call(capfd):
    api = FakeApi()

    def body(call):
        raise _Unprintable()

    error = _call(xla_ffi.make_handler(body), api.frame())
    assert error == 0x1001
    assert api.messages == [(xla_ffi._FALLBACK_MESSAGE, xla_ffi.ERROR_INTERNAL)]
    assert "__str__ failed" in capfd.readouterr().err


def test_making_the_error_fails(monkeypatch):
    api = FakeApi()

    def failing_error(*args, **kwargs):
        raise MemoryError()

    monkeypatch.setattr(xla_ffi, "_error", failing_error)

    def body(call):
        raise ValueError("x")

    assert _call(xla_ffi.make_handler(body), api.frame()) == 0x1001
    assert api.messages[-1][0] == xla_ffi._FALLBACK_MESSAGE


def test_no_error_to_make_aborts_rather_than_succeed(monkeypatch):
    """An execute-stage frame without an API table: no error can be made, so the handler aborts (here a
    stand-in records it) instead of returning NULL."""
    aborted = []
    monkeypatch.setattr(xla_ffi, "_abort", lambda: aborted.append(True))
    frame = FakeApi().frame()
    frame.api = None

    def body(call):
        raise ValueError("x")

    _call(xla_ffi.make_handler(body), frame)
    assert aborted == [True]


def test_wrong_stage_is_an_error():
    api = FakeApi()
    assert _call(xla_ffi.make_handler(lambda call: None), api.frame(stage=0)) == 0x1001
    assert b"execute stage" in api.messages[0][0]

