"""``gradient_compression="fp16"``: gradients cross the wire as float16 (torch's ``fp16_compress_wrapper``)."""

import torch
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from ds_lightning.comm.compression.half import HalfWidth, half_width_hook
from ds_lightning.comm.compression.registry import register

__all__ = ["FP16"]


@register
class FP16(HalfWidth):
    """float16 all-reduce, inter-host stage and pushes; gradients are divided by the world size before the cast."""

    name = "fp16"
    wire_dtype = torch.float16
    hook = half_width_hook(default_hooks.fp16_compress_wrapper, "_fp16_hook")
    auto_candidate = True
