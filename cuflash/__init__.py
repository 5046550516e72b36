"""cuflash: FlashAttention for CuPy. CUDA C kernels compiled at run time with NVRTC; no PyTorch."""
from __future__ import annotations

__version__ = "0.1.0"

from . import options  # noqa: E402 - cuflash.options: the settings (Options, set, override, reload)
from .api import (backward, backward_varlen, combine, forward, forward_fp8, forward_kvcache,  # noqa: E402
                  forward_varlen, quantize_fp8, vjp)
from .reference import attention_reference, attention_reference_backward, attention_reference_chunked  # noqa: E402
from .modifiers import MaskMod, ModifierCompileError, ScoreMod  # noqa: E402
from .philox import dropout_keep_mask  # noqa: E402
from .block_sparse import block_mask_from_document_ids, block_mask_from_predicate  # noqa: E402

__all__ = ["forward", "backward", "vjp", "forward_varlen", "backward_varlen", "forward_kvcache", "combine",
           "forward_fp8", "quantize_fp8", "attention_reference",
           "attention_reference_backward", "attention_reference_chunked", "options", "ScoreMod", "MaskMod",
           "ModifierCompileError", "dropout_keep_mask", "block_mask_from_document_ids", "block_mask_from_predicate",
           "__version__"]
