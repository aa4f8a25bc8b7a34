"""`python -m efficient` (also what `torchrun -m efficient` runs)."""

import sys

from efficient.cli import main

sys.exit(main())
