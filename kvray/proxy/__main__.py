"""``python -m kvray.proxy``: the routing proxy's command line (:func:`kvray.proxy.server.main`)."""

import sys

from kvray.proxy.server import main

sys.exit(main())
