"""Ragged paged attention for GPU (Pallas, Triton)."""
