"""``python -m sdpa_ref`` is the ``sdpa-ref`` command."""

import sys

from .cli import main

sys.exit(main())
