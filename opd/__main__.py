"""``python -m opd`` runs the ``opd`` command line."""

import sys

from opd.cli import main

sys.exit(main())
