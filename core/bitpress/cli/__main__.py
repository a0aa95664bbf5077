"""``python -m bitpress.cli``: the same as ``bitpress`` (and ``python -m bitpress``)."""

import sys

from bitpress.cli import main

sys.exit(main())
