"""Tile-level kernels written in Triton (the chapter's Triton route)."""
