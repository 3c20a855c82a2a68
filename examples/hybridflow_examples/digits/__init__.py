"""Handwritten digits: 8x8 images as 64 pixel columns (0..16) and a label (0..9)."""
