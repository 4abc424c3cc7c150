"""wtransfer's weight-transfer engines as verl checkpoint engines (``checkpoint_engine.backend=wtransfer:gloo``).

Installing this distribution is the only step: verl imports :mod:`wtransfer_verl.engine` through its
``verl.plugins`` entry point, which registers every installed wtransfer engine. This module imports
neither verl nor torch.
"""
