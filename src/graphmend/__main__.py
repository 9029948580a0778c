"""``python -m graphmend``: the command line."""

import sys

from graphmend.tools.cli import main

sys.exit(main())
