"""Which local address a torch.distributed rank's gloo device binds and advertises.

Not what the host name resolves to (often 127.0.0.1): by default the address on the route to the trainer
(workers, other sending ranks) or the one the rendezvous listens on (trainer). ``local_address`` or
``interface`` (worker options, trainer ``init_info``) or ``GLOO_SOCKET_IFNAME`` choose by hand. Every
rank chooses once, before its groups are built. NCCL picks its own (``NCCL_SOCKET_IFNAME``).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from wtransfer.options import option_value


def check_local_address(owner: str, local_address: Any, interface: Any) -> None:
    """A user's ``local_address``/``interface``: non-empty strings, and not both."""
    for key, value in (("local_address", local_address), ("interface", interface)):
        if value is not None and (not isinstance(value, str) or not value):
            raise ValueError(f"{owner}{key!r} must be a non-empty string, got {value!r}")
    if local_address and interface:
        raise ValueError(f"{owner}give 'local_address' or 'interface', not both")


class LocalAddressChoice:
    """The address (or interface) this rank's gloo device uses; part of the torch.distributed backend."""

    local_address: str | None = None
    """The address this rank's gloo device binds and advertises (set before groups are made)."""
    local_interface: str | None = None
    """Or a network interface name, when the user named one."""

    def gloo_device(self) -> Any:
        """The user's ``interface`` or ``local_address``, else ``GLOO_SOCKET_IFNAME``, else the automatic choice."""
        from torch._C._distributed_c10d import ProcessGroupGloo

        if self.local_interface:
            return ProcessGroupGloo.create_device(interface=self.local_interface)
        if self.local_address and not self._address_from_env():
            return ProcessGroupGloo.create_device(hostname=self.local_address)
        return ProcessGroupGloo.create_default_device()

    _address_chosen_by_user = False

    def _address_from_env(self) -> bool:
        """Whether ``GLOO_SOCKET_IFNAME`` decides (set, and the user named no address here)."""
        return bool(os.environ.get("GLOO_SOCKET_IFNAME")) and not self._address_chosen_by_user

    def choose_local_address(self, options: Any, automatic: Callable[[], str | None]) -> None:
        """Apply a user's ``local_address``/``interface`` option (parsed options or a dict), else ``automatic()``."""
        address, interface = option_value(options, "local_address"), option_value(options, "interface")
        check_local_address(f"{type(self).__name__}: ", address, interface)
        self._address_chosen_by_user = bool(address or interface)
        self.local_interface = interface
        self.local_address = address or (None if interface or self._address_from_env() else automatic())
