"""Old import path of the bound rendezvous store, kept while ``pipeline`` and ``parameter_server`` still import it.

The store lives in :mod:`ds_lightning.environments.rendezvous` and ``setup_distributed`` in
:mod:`ds_lightning.strategies.base`; delete this module once no strategy imports it.
"""

from ds_lightning.environments.rendezvous import ALL_INTERFACES_VARIABLE, bound_listener, rendezvous_store
from ds_lightning.strategies.base import setup_distributed

__all__ = ["ALL_INTERFACES_VARIABLE", "bound_listener", "rendezvous_store", "setup_distributed"]
