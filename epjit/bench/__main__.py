"""``python -m epjit.bench``: see epjit.bench."""

import sys

from epjit.bench import main

sys.exit(main())
