"""``python -m enginesim``."""

import sys

from .cli import main

sys.exit(main())
