"""Keeping the ``role: dr`` cluster ready: what a takeover needs copied into its store ahead of need, checked daily, repaired only by copying."""
