"""The backends' own servers, run by kvray as child processes when no address is
configured (the embedded default): one lifecycle (:mod:`kvray.servers.process`), one
small subclass per server."""
