"""Common operators from which every codec is written (the CompLL idea, on torch).

Each operator is defined in torch (any device, traceable by torch.compile) and, for contiguous
float32 CPU tensors, runs a fused native kernel when ``gradsync._native`` is available.

- reductions: :func:`tensor_stats` (sum/max of |x|, non-finite count, sum of squares);
  :func:`device_stats`, the same left on the device
- threshold selection: :func:`count_ge`, :func:`kth_largest`, :class:`CandidateSet`, :func:`topk`
- compaction and sparse add: :meth:`CandidateSet.select`, :func:`sparse_add_`, :func:`gather`
- bit packing: :func:`pack_codes`, :func:`unpack_codes`, :func:`lut_decode`, :func:`sign_pack`,
  :func:`threshold_pack`, :func:`stochastic_pack`
- randomness: :func:`make_generator`, :func:`hashed_uniform`, :func:`stochastic_round`,
  :func:`random_subset`
- 16-bit floats: :func:`cast_checked`, :func:`uncast`
- low rank: :func:`orthogonalize_`
"""

from gradsync.codecs.ops.backend import BACKENDS, backend
from gradsync.codecs.ops.bits import (
    SignStats,
    lut_decode,
    pack_codes,
    packed_nbytes,
    sign_pack,
    sign_pack_on_device,
    stochastic_pack,
    threshold_pack,
    threshold_pack_on_device,
    unpack_codes,
)
from gradsync.codecs.ops.floats import FORMAT_MAX, CastStats, cast_checked, cast_on_device, uncast
from gradsync.codecs.ops.lowrank import orthogonalize_, orthogonalize_on_device
from gradsync.codecs.ops.random import (
    device_words,
    draw_index,
    draw_words,
    hashed_uniform,
    hashed_uniform16,
    make_generator,
    random_subset,
    stochastic_round,
    stream_seed,
)
from gradsync.codecs.ops.reduce import (
    DeviceStats,
    TensorStats,
    abs_max,
    abs_max_on_device,
    device_stats,
    stats_vector,
    tensor_stats,
)
from gradsync.codecs.ops.select import (
    CandidateSet,
    Key,
    chunk_positions,
    count_ge,
    dgc_sample,
    f32,
    f32_above,
    keyed,
    kth_largest,
    topk,
)
from gradsync.codecs.ops.sparse import gather, sparse_add_, sparse_to_dense_
from gradsync.codecs.ops.workspace import Workspace

__all__ = [
    "BACKENDS",
    "FORMAT_MAX",
    "CandidateSet",
    "CastStats",
    "DeviceStats",
    "Key",
    "SignStats",
    "TensorStats",
    "Workspace",
    "abs_max",
    "abs_max_on_device",
    "backend",
    "cast_checked",
    "cast_on_device",
    "chunk_positions",
    "count_ge",
    "device_stats",
    "device_words",
    "dgc_sample",
    "draw_index",
    "draw_words",
    "f32",
    "f32_above",
    "gather",
    "hashed_uniform",
    "hashed_uniform16",
    "keyed",
    "kth_largest",
    "lut_decode",
    "make_generator",
    "orthogonalize_",
    "orthogonalize_on_device",
    "pack_codes",
    "packed_nbytes",
    "random_subset",
    "sign_pack",
    "sign_pack_on_device",
    "sparse_add_",
    "sparse_to_dense_",
    "stats_vector",
    "stochastic_pack",
    "stochastic_round",
    "stream_seed",
    "tensor_stats",
    "threshold_pack",
    "threshold_pack_on_device",
    "topk",
    "uncast",
    "unpack_codes",
]
