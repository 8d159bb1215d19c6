"""``python -m blockspec.cli``: the same as ``blockspec``."""

import sys

from .commands import main

sys.exit(main())
