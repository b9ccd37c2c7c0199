"""Lightning's own CLI with no ``import ds_lightning``: strategies must resolve from their class path alone."""

import sys

from lightning.pytorch.cli import LightningCLI

if __name__ == "__main__":
    assert "ds_lightning" not in sys.modules
    LightningCLI(model_class=None, datamodule_class=None, save_config_kwargs={"overwrite": True})
