"""Rounds over a private torch.distributed group (gloo here, NCCL in its plugin): the backend, both sides,
their options and bounded collective waits.

Private: import from :mod:`wtransfer`, :mod:`wtransfer.engines` or :mod:`wtransfer.engines.wire`."""
