"""`python -m shmloader ...`: the same as the `shmloader` command."""

import sys

from .tools.cli import main

sys.exit(main())
