"""``ds_model_parallel``'s ``devices`` option: one torch device per stage, and the root device that must match it."""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["check_root_device", "parse_stage_devices"]

_CPU = torch.device("cpu")


def check_root_device(device: str | torch.device | int | None, stage_devices: list[torch.device]) -> None:
    if device is None:
        return
    try:
        root = torch.device(device)
    except (RuntimeError, TypeError) as err:
        raise ValueError(f"device={device!r} is not a torch device; leave it unset (the first stage's).") from err
    if root != stage_devices[0]:
        raise ValueError(
            f"device={device!r} must be the first stage's device, {str(stage_devices[0])!r} (devices="
            f"{[str(d) for d in stage_devices]}); leave device unset, or list it first in devices."
        )


def parse_stage_devices(devices: Sequence[str | torch.device] | None) -> list[torch.device]:
    """Turn the ``devices`` option into torch devices, or pick the default: every CUDA device, else two CPUs."""
    if devices is None:
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        return [torch.device("cuda", i) for i in range(count)] if count else [_CPU, _CPU]
    if isinstance(devices, (str, torch.device)) or not isinstance(devices, Sequence) or len(devices) == 0:
        raise ValueError(
            f"devices={devices!r} must be a non-empty list with one device per stage, e.g. "
            "LayerSplitStrategy(devices=['cuda:0', 'cuda:1']) or devices=['cpu', 'cpu']."
        )
    parsed = []
    for entry in devices:
        try:
            device = torch.device(entry)
        except (RuntimeError, TypeError) as err:
            raise ValueError(
                f"devices={list(devices)!r}: {entry!r} is not a torch device; write each one like 'cuda:0' or 'cpu'."
            ) from err
        if device.type == "cuda" and device.index is None:
            raise ValueError(
                f"devices={list(devices)!r}: {entry!r} has no index, so every stage would land on the current GPU;"
                " name each GPU, e.g. devices=['cuda:0', 'cuda:1']."
            )
        parsed.append(device)
    types = sorted({d.type for d in parsed})
    if len(types) > 1:
        first = parsed[0].type
        example = [f"cuda:{i}" for i in range(len(parsed))] if first == "cuda" else [first] * len(parsed)
        raise ValueError(
            f"devices={list(devices)!r} mixes device types {types}; one Trainer drives one accelerator, so use one"
            f" type for every stage, e.g. devices={example!r}."
        )
    return parsed
