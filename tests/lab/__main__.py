"""``python tests/lab SUITE``: puts ``tests/`` on the path and runs the lab's command line."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from lab.cli import main

sys.exit(main())
