"""`python -m kdpemb` runs the command-line interface."""

import sys

from kdpemb.cli import main

sys.exit(main())
