"""``python -m ringmpi``: the ``ringmpi`` command (see ringmpi.cli.main)."""

import sys

from .cli.main import main

sys.exit(main())
