"""``python -m blockspec.bench.report``: see ``blockspec.bench.report.output``."""

import sys

from .output import main

sys.exit(main())
