"""Serving while a cluster is down: its endpoints onto a server on the disaster-recovery side from the replicated model, and back only through the deploy gate."""
