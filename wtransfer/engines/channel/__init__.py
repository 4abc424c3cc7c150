"""How the processes of a sync talk: length-framed JSON over sockets (a binary word per bucket), an authenticated
rendezvous store, and the protocol's version and limits. Nothing here knows what a round carries.

Private: import from :mod:`wtransfer`, :mod:`wtransfer.engines` or :mod:`wtransfer.engines.wire`."""
