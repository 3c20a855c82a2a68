"""Disaster recovery: keeping a ``role: dr`` cluster ready to take over (replication ahead of need,
reconciliation), declaring a cluster down and back up (fencing, failback), and drills."""
