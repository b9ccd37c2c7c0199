"""``gradient_compression="bf16"``: gradients cross the wire as bfloat16 (torch's ``bf16_compress_wrapper``)."""

import torch
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from ds_lightning.comm.compression.half import HalfWidth, half_width_hook
from ds_lightning.comm.compression.registry import register

__all__ = ["BF16"]


@register
class BF16(HalfWidth):
    """bfloat16 all-reduce, inter-host stage and pushes (float32's range, fewer mantissa bits; ``auto`` skips it)."""

    name = "bf16"
    wire_dtype = torch.bfloat16
    hook = half_width_hook(default_hooks.bf16_compress_wrapper, "_bf16_hook")
