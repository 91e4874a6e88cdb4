"""Streaming conversion and block-wise verification of checkpoints larger than memory (DESIGN.md)."""
