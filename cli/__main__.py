"""``python -m pdfabric.cli``: the ``pdfabric`` command (how the launcher starts worker processes)."""

import sys

from pdfabric.cli.main import main

sys.exit(main())
