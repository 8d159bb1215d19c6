"""``python -m blockspec.cli``: the same as ``blockspec``."""

import sys

from . import main

sys.exit(main())
