"""``python -m blockspec``: the ``blockspec`` command line."""

import sys

from .cli import main

sys.exit(main())
