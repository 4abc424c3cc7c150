"""An example wtransfer plugin distribution."""
