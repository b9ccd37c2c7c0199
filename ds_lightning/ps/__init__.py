"""Parameter-server building blocks: sharding, staleness clock, compression; tensors only on the wire."""
