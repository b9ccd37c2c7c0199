"""Communication hooks shared by the strategies and callbacks."""

from ds_lightning.comm.compression import COMPRESSIONS, CompressionName, GradientCompressor
from ds_lightning.comm.wire import WireLog

__all__ = ["COMPRESSIONS", "CompressionName", "GradientCompressor", "WireLog"]
