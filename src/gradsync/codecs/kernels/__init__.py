"""Fused kernels for the codecs' resident (GPU, host-free) path, written in Triton.

Each function is pure: tensors in, results written into tensors the caller gives (so that a
caller can keep static buffers, e.g. for CUDA-graph capture), no allocation that depends on the
data, no read of a device value by the host, no torch.distributed. Error feedback's add is
fused: given ``b``, a kernel reads ``v = a + b`` (rounded as ``torch.add``) in its first pass,
can write ``v`` (``v_out``), and where the commit fits in the same pass writes the new residual.

- :mod:`~gradsync.codecs.kernels.topk`: per-chunk top-k (one read);
- :mod:`~gradsync.codecs.kernels.threshold`: statistics, threshold selection (the rule of
  ``selection_on_device.above``: DGC, GradDrop, bsearch), DGC's sampled threshold;
- :mod:`~gradsync.codecs.kernels.approx_topk`: MSTopK in five reads for up to 24 bisection steps;
- :mod:`~gradsync.codecs.kernels.quantize`: onebit, TBQ, stochastic quantization (TernGrad),
  16-bit casts, with their residuals;
- :mod:`~gradsync.codecs.kernels.random`: stratified random-k positions in O(k);
- :mod:`~gradsync.codecs.kernels.launch`: where the kernels run (:func:`available`).

Every function has a ``*_torch`` twin with the same signature and outputs; the function itself
runs it where triton does not (:func:`available`), or for dtypes the kernels do not take.
:mod:`~gradsync.codecs.kernels.jit` holds the ``@triton.jit`` kernels, imported only when one
runs.
"""

from gradsync.codecs.kernels.approx_topk import MAX_ITERS, mstopk, mstopk_layout, mstopk_torch
from gradsync.codecs.kernels.launch import KERNEL_DTYPES, ScratchLayout, available, interpreting, use_kernels
from gradsync.codecs.kernels.quantize import (
    cast_encode,
    cast_encode_torch,
    lut_residual,
    onebit_encode,
    onebit_encode_torch,
    onebit_layout,
    stochastic_encode,
    stochastic_encode_torch,
    tbq_encode,
    tbq_encode_torch,
)
from gradsync.codecs.kernels.random import stratified_randomk, stratified_randomk_torch
from gradsync.codecs.kernels.threshold import (
    as_device_stats,
    fill_slots,
    fused_stats,
    fused_stats_torch,
    largest_of,
    sampled_threshold,
    select_above,
    select_above_torch,
    select_layout,
    stats_layout,
)
from gradsync.codecs.kernels.topk import chunked_topk, chunked_topk_torch

__all__ = [
    "KERNEL_DTYPES",
    "MAX_ITERS",
    "ScratchLayout",
    "as_device_stats",
    "available",
    "cast_encode",
    "cast_encode_torch",
    "chunked_topk",
    "chunked_topk_torch",
    "fill_slots",
    "fused_stats",
    "fused_stats_torch",
    "interpreting",
    "largest_of",
    "lut_residual",
    "mstopk",
    "mstopk_layout",
    "mstopk_torch",
    "onebit_encode",
    "onebit_encode_torch",
    "onebit_layout",
    "sampled_threshold",
    "select_above",
    "select_above_torch",
    "select_layout",
    "stats_layout",
    "stochastic_encode",
    "stochastic_encode_torch",
    "stratified_randomk",
    "stratified_randomk_torch",
    "tbq_encode",
    "tbq_encode_torch",
    "use_kernels",
]
