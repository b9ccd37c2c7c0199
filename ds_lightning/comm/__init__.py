"""Communication hooks shared by the strategies and callbacks."""

from ds_lightning.comm.compression import COMPRESSIONS, CompressionName, GradientCompressor

__all__ = ["COMPRESSIONS", "CompressionName", "GradientCompressor"]
