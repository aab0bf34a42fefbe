"""``python -m ringmpi``: the ``ringmpi`` command (see ringmpi.cli)."""

import sys

from .cli import main

sys.exit(main())
