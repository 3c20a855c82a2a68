"""hybridflow: Airflow 3 pipelines from data to a served model across private and public GPU clusters."""

__version__ = "0.1.0"
