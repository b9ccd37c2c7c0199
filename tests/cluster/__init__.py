"""A multi-host test cluster built from Linux network namespaces (see :mod:`tests.cluster.netns`)."""
