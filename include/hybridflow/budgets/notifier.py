"""Budget notifications as an Airflow notifier posting JSON to an HTTP webhook Connection.

The Connection (type ``http``) holds the webhook URL as its host, e.g.
``AIRFLOW_CONN_HYBRIDFLOW_BUDGET_WEBHOOK='{"conn_type": "http", "host": "https://hooks.example/T0/B1"}'``,
so a URL carrying a token lives with the other credentials, never in config/ or logs.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from airflow.sdk import BaseNotifier

WEBHOOK_TIMEOUT_S = 10


class BudgetWebhookNotifier(BaseNotifier):
    """POST ``payload`` (plus a rendered ``text``) to the webhook; raises if it does not answer 2xx.

    ``Idempotency-Key`` carries ``key`` so a receiver can drop a repeat after a crash between the
    POST and the ledger commit (the one window where the ledger cannot prevent a second send).
    """

    template_fields: Sequence[str] = ("text",)

    def __init__(self, *, http_conn_id: str, text: str, payload: Mapping[str, Any], key: str) -> None:
        super().__init__()
        self.http_conn_id = http_conn_id
        self.text = text
        self.payload = dict(payload)
        self.key = key

    def notify(self, context) -> None:
        from airflow.providers.http.hooks.http import HttpHook

        hook = HttpHook(method="POST", http_conn_id=self.http_conn_id)
        hook.run(
            endpoint="",
            json={"text": self.text, **self.payload},
            headers={"Content-Type": "application/json", "Idempotency-Key": self.key},
            extra_options={"timeout": WEBHOOK_TIMEOUT_S, "check_response": True},
        )
        self.log.info("budget notification %s sent through connection %s", self.key, self.http_conn_id)
