"""NCCL weight-transfer engine for wtransfer, shipped as its own distribution.

Nothing here is imported until wtransfer resolves the ``nccl`` engine name.
"""

__version__ = "0.1.0"
