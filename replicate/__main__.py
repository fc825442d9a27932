"""``python -m replicate`` is the ``replicate`` command."""

import sys

from replicate.cli import main

sys.exit(main())
