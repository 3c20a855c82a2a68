"""The costs page's section on storage and transfer quotas: each project's bytes held and moved this
month beside its GPU spend, each quota's share, the notifications sent and whether staging is refused."""

from __future__ import annotations

from html import escape
from typing import Any

from hybridflow.budgets.quotas import GIB, STORAGE, TRANSFER
from hybridflow.ui.runs import _cell


def _share(q: dict[str, Any]) -> str:
    if q["share"] is None:
        return f"{q['bytes'] / GIB:,.2f} GiB (no quota)"
    width = min(q["share"], 1.2) * 100
    over = " over" if q["frozen"] else ""
    return (f"{q['bytes'] / GIB:,.2f} of {q['quota_gib']:g} GiB <span class='bar{over}' style='width:{width:.0f}px'>"
            f"</span> {q['share']:.1%}")


def _state(row: dict[str, Any]) -> str:
    full = [name for name in (STORAGE, TRANSFER) if row[name]["frozen"]]
    if full:
        return (f"frozen ({', '.join(full)} at 100 %): runs whose staging needs more are refused; raise the quota "
                f"in projects.yaml or prune old versions (hybridflow cache prune)")
    return "open"


def render_quotas(rows: list[dict[str, Any]], period: str) -> str:
    if not rows:
        return (f"<p class='muted'>No storage or transfer usage counted for {escape(period)} yet: the nightly "
                "job counts it once a project has a quota or a cluster prices storage or egress.</p>")
    body = []
    for r in rows:
        notified = "; ".join(f"{name}: {', '.join(f'{t:.0%}' for t in r[name]['notified'])}"
                             for name in (STORAGE, TRANSFER) if r[name]["notified"]) or None
        css = "frozen" if any(r[n]["frozen"] for n in (STORAGE, TRANSFER)) else ("warn" if notified else "")
        body.append(
            f"<tr class='{css}'><td>{escape(r['project'])}</td><td>{r['gpu_usd']:,.2f}</td>"
            f"<td>{_share(r[STORAGE])}</td><td>{_share(r[TRANSFER])}</td><td>{r['storage_transfer_usd']:,.2f}</td>"
            f"<td>{_cell(notified)}</td><td>{escape(_state(r))}</td><td>{escape(r['day'])}</td></tr>"
        )
    return (
        "<table><tr><th>project</th><th>GPU spend (USD)</th><th>held (storage_gib)</th>"
        f"<th>moved in {escape(period)} (transfer_gib_per_month)</th><th>storage &amp; transfer (USD)</th>"
        "<th>notified at</th><th>state</th><th>counted</th></tr>" + "".join(body) + "</table>"
    )
