"""Core math on tensors: sampling and warping, the verification rule, token trees, decoding statistics.
Imports nothing of specdec above it (errors only)."""
