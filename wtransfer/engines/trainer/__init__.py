"""The trainer's side of every engine: ``create_trainer``, the round driver, the client's calls, sharded
trainers agreeing on each round, and the delta base and its per-round choice.

Private: import from :mod:`wtransfer`, :mod:`wtransfer.engines` or :mod:`wtransfer.engines.wire`."""
