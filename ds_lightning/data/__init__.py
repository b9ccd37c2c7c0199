"""Data helpers shared by the strategies: keeping every rank at the same number of batches."""

from ds_lightning.data.even_batches import even_batches

__all__ = ["even_batches"]
