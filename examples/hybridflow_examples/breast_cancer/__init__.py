"""Breast-cancer diagnosis: 30 measurements of a cell nucleus image and whether it is malignant."""
