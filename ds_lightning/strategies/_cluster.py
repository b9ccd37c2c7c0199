"""Old import path of the cluster set-up, kept while ``pipeline`` and ``parameter_server`` still import it.

Everything here lives in :mod:`ds_lightning.strategies.base`; delete this module once no strategy imports it.
"""

from ds_lightning.strategies.base import (
    BACKENDS,
    StartMethod,
    adopt_tf_config,
    check_launch_options,
    destroy_process_group_at_exit,
    pin_interfaces,
)

__all__ = [
    "BACKENDS",
    "StartMethod",
    "adopt_tf_config",
    "check_launch_options",
    "destroy_process_group_at_exit",
    "pin_interfaces",
]
