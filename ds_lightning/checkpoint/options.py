"""The ``state_dict_type`` option: how a strategy writes checkpoints (Lightning FSDP's "full" or "sharded")."""

from __future__ import annotations

from typing import Literal

__all__ = ["STATE_DICT_TYPES", "StateDictType", "check_state_dict_type"]

#: ``"full"``: one file, gathered on rank 0; ``"sharded"``: a folder every rank writes its own part of.
StateDictType = Literal["full", "sharded"]
STATE_DICT_TYPES: tuple[StateDictType, ...] = ("full", "sharded")


def check_state_dict_type(value: object, owner: str) -> StateDictType:
    """``value`` as a :data:`StateDictType`.

    Args:
        value: what the user passed.
        owner: the class taking it, named in the error's example.

    Raises:
        ValueError: naming the value and the fix.

    """
    if not isinstance(value, str) or value not in STATE_DICT_TYPES:
        raise ValueError(
            f"{owner} got state_dict_type={value!r}; use 'full' (one checkpoint file gathered on rank 0) or"
            f" 'sharded' (a folder every rank writes its own part of, with torch.distributed.checkpoint), e.g."
            f" {owner}(state_dict_type='sharded')."
        )
    return value
