"""``python -m adaptree.cli``: the ``adaptree`` command."""

import sys

from adaptree.cli import main

sys.exit(main())
