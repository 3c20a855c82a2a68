"""HybridFlow pages in the Airflow UI: the training runs list (top navigation) and, on every DAG
run, a *Placement & record* tab. The pages live in :mod:`hybridflow.ui.runs`."""

from __future__ import annotations

from airflow.plugins_manager import AirflowPlugin

from hybridflow.ui.runs import create_app

URL_PREFIX = "/hybridflow"


class HybridFlowUIPlugin(AirflowPlugin):
    name = "hybridflow_ui"
    fastapi_apps = [{"app": create_app(), "url_prefix": URL_PREFIX, "name": "HybridFlow runs"}]
    external_views = [
        {
            "name": "Training runs",
            "href": f"{URL_PREFIX}/runs",
            "destination": "nav",
            "category": "browse",
            "url_route": "hybridflow-runs",
        },
        {
            "name": "Placement & record",
            # The UI fills in the placeholders for the DAG run being viewed.
            "href": f"{URL_PREFIX}/runs/{{DAG_ID}}/{{RUN_ID}}",
            "destination": "dag_run",
            "url_route": "hybridflow-run",
        },
    ]
