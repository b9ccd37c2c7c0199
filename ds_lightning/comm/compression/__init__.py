"""Gradient compression: the :class:`Compression` protocol, its registry, and one module per method.

Importing this package registers the built-in methods, in this order: ``none``, ``fp16``, ``bf16``, ``powersgd``,
``topk`` (parameter-server pushes only) and ``auto`` (chooses among the others while training). ``ds_mirrored``, the
two-level all-reduce, ``auto`` and ``ds_parameter_server`` all select a method by the one option
``gradient_compression``. See docs/design.md, "Adding a compression method".
"""

# isort: off
# Registration order is the order names are listed in and auto's preference among equally fast candidates.
from ds_lightning.comm.compression import none  # noqa: F401
from ds_lightning.comm.compression import fp16  # noqa: F401
from ds_lightning.comm.compression import bf16  # noqa: F401
from ds_lightning.comm.compression import powersgd  # noqa: F401
from ds_lightning.comm.compression import topk  # noqa: F401
from ds_lightning.comm.compression import auto  # noqa: F401

# isort: on
from ds_lightning.comm.compression.base import Compression, CompressionOptions
from ds_lightning.comm.compression.compressor import GradientCompressor
from ds_lightning.comm.compression.registry import auto_candidates, create, get, names, register, unregister

__all__ = [
    "Compression",
    "CompressionOptions",
    "GradientCompressor",
    "auto_candidates",
    "create",
    "get",
    "names",
    "register",
    "unregister",
]
