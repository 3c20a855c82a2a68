"""A published GPU price table (provider, region, GPU, tier, USD per GPU-hour; the format of
tests/fixtures/reference/pricing/gpu_pricing_ondemand_vs_spot.csv) into the ledger's versioned catalog, for
one public cluster's pools from a given day on.

A new version applies from its valid_from until the next one for the same cluster, pricing class and
GPU model: a later change of the price in clusters.yaml, or a later import, takes over from its day.
"""

from __future__ import annotations

import csv
import statistics
from datetime import date
from pathlib import Path

from sqlalchemy import Engine, delete, insert

from hybridflow.errors import ConfigError
from hybridflow.ledger.models import Price

# Rows that price a whole GPU: a full instance (per GPU) or a per-GPU list price. GCP's split rows
# (GPU component, host VM) are left out: neither alone is what a GPU-hour costs.
WHOLE_GPU_SCOPES = ("full_instance", "per_gpu_list_price")
TIERS = ("on_demand", "spot")
REQUIRED = ("provider", "gpu_model", "gpu_memory_gb", "region", "pricing_tier", "usd_per_gpu_hour", "price_scope")


def _rows(path: Path) -> list[dict]:
    try:
        with open(path, newline="") as fh:
            reader = csv.DictReader(fh)
            missing = [c for c in REQUIRED if c not in (reader.fieldnames or [])]
            if missing:
                raise ConfigError(f"{path}: columns {missing} are missing; a price table has {', '.join(REQUIRED)}")
            return list(reader)
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read the price table ({exc.strerror}); give --csv an existing file") from None


def _model_name(row: dict) -> str:
    return f"{row['gpu_model']}-{row['gpu_memory_gb']}GB"


def import_price_table(engine: Engine, estate, path: Path, *, cluster: str, provider: str, valid_from: date,
                       region: str | None = None) -> list[dict]:
    """Set the on-demand and spot prices of ``cluster``'s pools from the table's rows for ``provider`` in
    ``region`` (default: the cluster's), valid from ``valid_from``; returns the versions written.

    Several matching rows (spot prices per zone, instance sizes) give their median. Nothing is
    written unless every on-demand or spot pool of the cluster has a price in the table.
    """
    target = estate.clusters.get(cluster)
    if target is None:
        raise ConfigError(f"--cluster {cluster!r} is not in clusters.yaml; known: {', '.join(sorted(estate.clusters))}")
    region = region or target.region
    rows = [r for r in _rows(Path(path)) if r["provider"] == provider and r["region"] == region
            and r["price_scope"] in WHOLE_GPU_SCOPES and r["usd_per_gpu_hour"].strip()]
    versions, missing = [], []
    for pool in target.node_pools:
        pclass = target.pricing_class(pool)
        if pclass not in TIERS:
            continue  # reserved and onprem rates are contracts, not list prices: they stay in clusters.yaml
        usd = [float(r["usd_per_gpu_hour"]) for r in rows if r["pricing_tier"] == pclass and _model_name(r) == pool.gpu_model]
        if not usd:
            missing.append(f"{pool.gpu_model} {pclass}")
            continue
        versions.append({"cluster": cluster, "pricing_class": pclass, "gpu_model": pool.gpu_model,
                         "usd_per_gpu_hour": statistics.median(usd), "valid_from": valid_from.isoformat(),
                         "source": f"{Path(path).name}: median of {len(usd)} {provider} {region} rows"})
    if missing or not versions:
        raise ConfigError(f"{path}: no {provider} {region} price for {', '.join(missing) or 'any pool'} of cluster "
                          f"{cluster}; check --provider/--region (the table's gpu_model + gpu_memory_gb must read "
                          "like the pool's gpu_model, e.g. H100 + 80 = H100-80GB)")
    with engine.begin() as conn:
        for v in versions:  # the same day imported again replaces that day's version
            conn.execute(delete(Price).where(Price.cluster == cluster, Price.pricing_class == v["pricing_class"],
                                             Price.gpu_model == v["gpu_model"], Price.valid_from == v["valid_from"]))
        conn.execute(insert(Price), versions)
    return versions
