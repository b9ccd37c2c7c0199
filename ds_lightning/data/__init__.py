"""Data order and helpers shared by the strategies and callbacks.

Every rank at the same number of batches (:func:`even_batches`), each rank's share of every global batch
(:class:`ShareBatchSampler`), and a loader a restored run continues at the exact sample (:class:`DataCursor`).
"""

from ds_lightning.data.even_batches import even_batches
from ds_lightning.data.resumable import DataCursor, ResumableDataLoader, resumable_loader
from ds_lightning.data.share_plan import SharePlan
from ds_lightning.data.share_sampler import ShareBatchSampler

__all__ = ["DataCursor", "ResumableDataLoader", "ShareBatchSampler", "SharePlan", "even_batches", "resumable_loader"]
