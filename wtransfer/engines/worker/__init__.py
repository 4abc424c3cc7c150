"""The worker's side of every engine: the ``WeightTransferEngine`` contract (vLLM's, kept), its factory,
the helpers built-ins share, and ``module_loader`` for plain torch modules.

Private: import from :mod:`wtransfer`, :mod:`wtransfer.engines` or :mod:`wtransfer.engines.wire`."""
