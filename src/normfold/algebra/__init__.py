"""Pure functions on tensors: center writers, fold affines, compress/decompress, fuse offline norms."""

from .layouts import Layout, is_linear_reader, layout_of, register_layout
from .offline import fold_into_writer, offline_affine
from .tensors import (
    center,
    center_writer,
    compress_reader,
    compress_writer,
    decompress_reader,
    decompress_writer,
    fold_affine,
    fold_offline_norm,
)

__all__ = [
    "Layout", "layout_of", "register_layout", "is_linear_reader",
    "center", "center_writer", "fold_affine", "compress_reader", "compress_writer",
    "decompress_reader", "decompress_writer", "fold_offline_norm", "offline_affine", "fold_into_writer",
]
