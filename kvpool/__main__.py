"""``python -m kvpool``: the ``kvpool`` command, for launchers and tests that run it without the console
script (a child started as ``sys.executable -m kvpool`` uses the same interpreter as its parent)."""

import sys

from kvpool.commands.main import main

sys.exit(main())
