"""``python -m sdpa_ref`` is the ``sdpa-ref`` command."""

import sys

from .cli.commands import main

sys.exit(main())
