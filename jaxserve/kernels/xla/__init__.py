"""Attention in plain JAX, lowered by XLA on any platform."""
