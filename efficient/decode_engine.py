"""Deprecated import path: the decode engine lives in `efficient.decoding.engine` (also exported
as `efficient.decoding.DecodeEngine`)."""

import warnings

from efficient.decoding.engine import CHUNK_BUCKETS, WINDOW_STEP, DecodeEngine, run_layerwise, run_speculative

warnings.warn("efficient.decode_engine is deprecated; import DecodeEngine from efficient.decoding", DeprecationWarning, stacklevel=2)

__all__ = ["CHUNK_BUCKETS", "WINDOW_STEP", "DecodeEngine", "run_layerwise", "run_speculative"]
