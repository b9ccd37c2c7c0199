"""The samples one micro-step takes, as the accumulation, LR-scaling and backup callbacks read them."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from ds_lightning.callbacks import DynamicLoadBalancer
from ds_lightning.callbacks._batch_geometry import samples_per_micro_step
from ds_lightning.data.share_plan import SharePlan


@pytest.mark.parametrize("given", [None, 48])
def test_a_balancer_plan_sets_the_samples_whether_given_or_read_from_the_loader(given):
    # DynamicLoadBalancer() without global_batch_size builds its plan from the DataLoader's batch size; the
    # callbacks then read the plan's global batch, not the None the balancer was built with.
    balancer = DynamicLoadBalancer(global_batch_size=given)
    trainer = SimpleNamespace(callbacks=[balancer])
    balancer.plan = SharePlan(48, 2, min_share=0.1, ema=0.5, hysteresis=0.1)
    assert samples_per_micro_step(trainer, "test") == 48
