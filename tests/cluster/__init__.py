"""A multi-host test cluster built from Linux network namespaces (see :mod:`ds_lightning.testing.netns`)."""
