"""Deprecated import path: this module is now `efficient.attacks.masking` (every public name is also
exported by `efficient.attacks`)."""

import warnings

from efficient.attacks.masking import *  # noqa: F401,F403
from efficient.attacks.masking import __all__  # noqa: F401

warnings.warn("efficient.masking_checks is deprecated; import from efficient.attacks", DeprecationWarning, stacklevel=2)
