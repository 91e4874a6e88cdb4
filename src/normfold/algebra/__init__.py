"""Pure functions on tensors: center writers, fold affines, compress/decompress, fuse offline norms."""

from .ccwt import (
    RECURRENT_GATES,
    center_conv_writer,
    center_grouped,
    center_recurrent,
    fold_affine_conv,
    grouped_writer_exact,
    is_conv_reader,
)
from .layouts import Layout, is_linear_reader, layout_of, register_layout
from .offline import fold_into_writer, offline_affine
from .rotation import (
    fix_ones,
    hadamard_matrix,
    has_hadamard,
    random_orthogonal,
    rotate_axis,
    rotation_matrix,
    unfold_gamma_bias,
)
from .tensors import (
    center,
    center_writer,
    compress_reader,
    compress_writer,
    decompress_reader,
    decompress_writer,
    fold_affine,
    fold_offline_norm,
    result_buffer,
    reused_buffers,
    scale_writer,
)

__all__ = [
    "center_grouped", "center_conv_writer", "grouped_writer_exact", "fold_affine_conv", "is_conv_reader",
    "center_recurrent", "RECURRENT_GATES",
    "Layout", "layout_of", "register_layout", "is_linear_reader",
    "center", "center_writer", "scale_writer", "fold_affine", "reused_buffers", "result_buffer", "compress_reader", "compress_writer",
    "decompress_reader", "decompress_writer", "fold_offline_norm", "offline_affine", "fold_into_writer",
    "fix_ones", "hadamard_matrix", "has_hadamard", "random_orthogonal", "rotate_axis", "rotation_matrix",
    "unfold_gamma_bias",
]
