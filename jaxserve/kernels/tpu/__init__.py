"""Ragged paged attention for TPU (Pallas, Mosaic)."""
