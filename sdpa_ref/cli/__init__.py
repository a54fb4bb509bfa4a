"""The ``sdpa-ref`` command line.

Run ``sdpa-ref --help`` or ``sdpa-ref COMMAND --help``. The parser is in
:mod:`.parser`; each command's work, and :func:`main`, which runs one, in
:mod:`.commands`; tables, JSON, CSV, progress and plots in :mod:`.output`.
"""

from .commands import main
from .output import format_rows
from .parser import build_parser

__all__ = ["main", "build_parser", "format_rows"]

if __name__ == "__main__":  # pragma: no cover
    import sys

    sys.exit(main())
