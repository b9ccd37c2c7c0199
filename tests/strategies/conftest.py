import pytest

from tests.helpers.runner import ds_train
from tests.helpers.sharding_runs import fit_args


@pytest.fixture(scope="session")
def plain_adam_run(tmp_path_factory):
    """Plain ds_mirrored, 2 ranks, 2 epochs under Adam (``tests.helpers.sharding_runs``), in ``<root>/plain``.

    Returns the root: each sharding engine's tests add their own runs beside it.
    """
    root = tmp_path_factory.mktemp("sharding")
    ds_train(fit_args(root / "plain", root / "plain" / "params", 2, False), timeout=240, ranks=2)
    return root
