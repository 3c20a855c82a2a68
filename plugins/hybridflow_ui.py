"""HybridFlow pages in the Airflow UI: the training runs list, GPU costs & budgets, the resource
reaper, DR drills and Clusters & DR (top navigation) and, on every DAG run, *Placement & record*
and *Cost & budget* tabs. The pages live in :mod:`hybridflow.ui.runs`, :mod:`hybridflow.ui.costs`,
:mod:`hybridflow.ui.reaper`, :mod:`hybridflow.ui.drills` and :mod:`hybridflow.ui.clusters`."""

from __future__ import annotations

from airflow.plugins_manager import AirflowPlugin

from hybridflow.ui.clusters import add_cluster_pages
from hybridflow.ui.costs import add_cost_pages
from hybridflow.ui.drills import add_drill_pages
from hybridflow.ui.reaper import add_reaper_pages
from hybridflow.ui.runs import create_app

URL_PREFIX = "/hybridflow"

app = create_app()
add_cost_pages(app)
add_reaper_pages(app)
add_drill_pages(app)
add_cluster_pages(app)


class HybridFlowUIPlugin(AirflowPlugin):
    name = "hybridflow_ui"
    fastapi_apps = [{"app": app, "url_prefix": URL_PREFIX, "name": "HybridFlow runs"}]
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
        {
            "name": "GPU costs & budgets",
            "href": f"{URL_PREFIX}/costs",
            "destination": "nav",
            "category": "browse",
            "url_route": "hybridflow-costs",
        },
        {
            "name": "Cost & budget",
            "href": f"{URL_PREFIX}/costs/runs/{{DAG_ID}}/{{RUN_ID}}",
            "destination": "dag_run",
            "url_route": "hybridflow-run-cost",
        },
        {
            "name": "Resource reaper",
            "href": f"{URL_PREFIX}/reaper",
            "destination": "nav",
            "category": "browse",
            "url_route": "hybridflow-reaper",
        },
        {
            "name": "DR drills",
            "href": f"{URL_PREFIX}/drills",
            "destination": "nav",
            "category": "browse",
            "url_route": "hybridflow-drills",
        },
        {
            "name": "Clusters & DR",
            "href": f"{URL_PREFIX}/clusters",
            "destination": "nav",
            "category": "browse",
            "url_route": "hybridflow-clusters",
        },
    ]
