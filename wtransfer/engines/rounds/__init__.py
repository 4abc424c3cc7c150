"""What a round is and how it reaches the model, whatever carries it: the manifest, the cast, the packing plan,
digests, sources, shards, node staging, delta records and the all-or-nothing commit.

Private: import from :mod:`wtransfer`, :mod:`wtransfer.engines` or :mod:`wtransfer.engines.wire`."""
