"""Triton kernels with torch references and custom ops. Imports nothing from the rest of efficient."""

if __name__ == "kernels":
    # This folder is installed as `efficient.kernels`. It is reached as a top-level `kernels` only when a checkout's
    # root is on sys.path (`python -m` or a notebook started there, pytest-xdist workers). That name belongs to
    # Hugging Face's `kernels` package, which transformers imports when it is installed (a dependency since
    # transformers 5.25), so hand the name over to it: the import system returns whatever sys.modules holds
    # under the name once this file has run.
    import importlib.machinery
    import importlib.util
    import os
    import sys

    _root = os.path.realpath(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    _elsewhere = [p for p in sys.path if os.path.realpath(p or os.curdir) != _root]
    _spec = importlib.machinery.PathFinder.find_spec("kernels", _elsewhere)
    if _spec is not None and _spec.loader is not None:
        _module = importlib.util.module_from_spec(_spec)
        sys.modules["kernels"] = _module
        _spec.loader.exec_module(_module)
