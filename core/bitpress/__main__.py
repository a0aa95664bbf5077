"""``python -m bitpress``: the command line, for interpreters whose scripts folder is not on PATH.

The host uses it to ask a plugin environment which passes it offers.
"""

import sys

from bitpress.cli import main

sys.exit(main())
