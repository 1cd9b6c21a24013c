"""`python -m evict …` is `evict …`."""

import sys

from evict.cli import main

sys.exit(main())
