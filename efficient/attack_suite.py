"""Deprecated import path: this module is now `efficient.attacks.suite` (every public name is also
exported by `efficient.attacks`)."""

import warnings

from efficient.attacks.suite import *  # noqa: F401,F403
from efficient.attacks.suite import __all__  # noqa: F401

warnings.warn("efficient.attack_suite is deprecated; import from efficient.attacks", DeprecationWarning, stacklevel=2)
