"""CPU only: which (batch, seqlen, heads, head_dim) views TMA can address (cuflash/tma.py). A dim of extent 1 is
never stepped along, so its stride may be anything, 0 included (``x[None]``, the varlen calls' batch of one,
which the Hopper kernels would otherwise hand to the portable ones); a dim that is stepped along needs a
positive multiple of 16 bytes."""
from __future__ import annotations

import numpy as np
import pytest

from conftest import fake_cupy_array

pytest.importorskip("cupy")


def test_a_batch_of_one_with_stride_zero_is_addressable():
    from cuflash import tma

    packed = fake_cupy_array((300, 4, 64))
    view = packed[None]
    assert view.strides[0] == 0 and tma.bshd_ok(view)
    strides = tma._bshd_strides(view)
    assert strides[:2] == [4 * 64 * 2, 64 * 2] and strides[2] > 0 and strides[2] % 16 == 0


def test_extent_one_dims_take_a_valid_stride():
    from cuflash import tma

    one_head = fake_cupy_array((2, 10, 1, 64), strides=(10 * 64 * 2, 64 * 2, 0, 2))
    assert tma.bshd_ok(one_head)
    one_row = fake_cupy_array((2, 1, 4, 64), strides=(4 * 64 * 2, 8, 64 * 2, 2))   # an odd stride, never used
    assert tma.bshd_ok(one_row)


def test_strides_that_are_stepped_along_are_still_checked():
    from cuflash import tma

    assert not tma.bshd_ok(fake_cupy_array((2, 10, 4, 64), strides=(0, 4 * 64 * 2, 64 * 2, 2)))   # batch of 2, 0
    assert not tma.bshd_ok(fake_cupy_array((1, 10, 4, 64), strides=(0, 4 * 64 * 2 + 8, 64 * 2, 2)))   # rows by 8
    assert not tma.bshd_ok(fake_cupy_array((1, 10, 4, 64), dtype=np.float16, offset=8))   # base not 16-aligned
