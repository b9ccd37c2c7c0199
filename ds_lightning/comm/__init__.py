"""Communication hooks shared by the strategies and callbacks."""

from ds_lightning.comm.compression import Compression, CompressionOptions, GradientCompressor
from ds_lightning.comm.wire import WireLog

__all__ = ["Compression", "CompressionOptions", "GradientCompressor", "WireLog"]
