"""A cluster declared down and back up: its gangs checkpointed and stopped and its serving drained, the DAG's task units, and failback."""
