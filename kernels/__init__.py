"""Triton kernels with torch references and custom ops. Imports nothing from the rest of efficient."""
