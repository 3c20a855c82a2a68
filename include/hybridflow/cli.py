"""``hybridflow``: the operator's command line for the embedded default.

    hybridflow demo            set up and run the training pipeline end to end (metered, its day
                               allocated and budgets evaluated), print where things are
    hybridflow ui              set up and start Airflow (UI on http://127.0.0.1:8080) on the same setup
    hybridflow dev up|down     start/stop the embedded object stores and deployed endpoints
    hybridflow dev k8s build|up|down|status   a local Kubernetes control plane (hybridflow dev k8s -h)
    hybridflow seed [DATASET...]
                               write the example datasets (those with a seed function in datasets.yaml)
    hybridflow cache versions|prune --cluster C --dataset D
                               list a cloud cache's dataset versions, or prune the old ones
    hybridflow dcgm URL|FILE   scrape a dcgm-exporter (or read a saved page), print per-GPU samples as JSON
    hybridflow local-exporter --cluster C [--port P]
                               serve a local cluster's slots in dcgm-exporter's format (the local stand-in)
    hybridflow cluster down C --reason R | up C | status
                               declare a cluster down (fenced, its gangs checkpointed, serving on DR) or up
                               again (serving back through the deploy gate); the fence as JSON
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

DAG_ID = "hybrid_training"


def _scripts_dir() -> Path:
    """Where this interpreter's console scripts are (the virtualenv's bin), activated or not."""
    return Path(sys.executable).parent


def _airflow() -> str:
    return str(_scripts_dir() / "airflow")


def _prepare(stack) -> dict[str, str]:
    env = {**os.environ, **stack.up()}
    # Airflow starts its components (and task processes) as `airflow ...` found on PATH: the scripts
    # next to this interpreter come first, so a shell without the virtualenv on PATH works too.
    env["PATH"] = os.pathsep.join([str(_scripts_dir()), *filter(None, env.get("PATH", "").split(os.pathsep))])
    log = stack.dev_dir / "airflow-db-migrate.log"
    with open(log, "wb") as fh:
        done = subprocess.run([_airflow(), "db", "migrate"], env=env, stdout=fh, stderr=subprocess.STDOUT)
    if done.returncode != 0:
        raise SystemExit(f"airflow db migrate failed; see {log}")
    return env


def _newest_record(private_root: Path, since: float) -> dict | None:
    records = [p for p in (private_root / "records").glob("*/*.json") if p.stat().st_mtime >= since]
    if not records:
        return None
    return json.loads(max(records, key=lambda p: p.stat().st_mtime).read_text())


def cmd_demo(args) -> int:
    from hybridflow.config import load_estate
    from hybridflow.devenv.demo_costs import DemoMeter, meterable_clusters
    from hybridflow.devenv.stack import DevStack

    stack = DevStack.default()
    env = _prepare(stack)
    os.environ.update(env)  # metering and allocation run here: the tasks' settings, ledger and connections
    for name in ("alembic", "matplotlib", "hybridflow"):  # their progress lines; warnings still show
        logging.getLogger(name).setLevel(logging.WARNING)
    conf = json.loads(args.conf) if args.conf else {}
    started = time.time()
    log_path = stack.dev_dir / f"demo-{int(started)}.log"
    print(f"Running {DAG_ID} with {conf or 'default Params'} (full log: {log_path})", flush=True)
    meter = DemoMeter(meterable_clusters(load_estate(stack.settings.config_dir))).start()
    try:
        returncode = _run_pipeline(conf, env, log_path, quiet=args.quiet)
    finally:
        metered = meter.stop()
    record = _newest_record(stack.settings.private_root, started)
    if returncode != 0 or record is None:
        print(f"\nThe pipeline run failed; see {log_path}", file=sys.stderr)
        return 1
    _print_run(record, stack, time.time() - started)
    return _allocate_costs(record, metered, started)


def _run_pipeline(conf: dict, env: dict[str, str], log_path: Path, *, quiet: bool) -> int:
    """``airflow dags test`` of the pipeline, its output to ``log_path`` (and the terminal unless quiet)."""
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [_airflow(), "dags", "test", DAG_ID, "-c", json.dumps(conf)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for line in proc.stdout:
            log.write(line)
            if not quiet:
                sys.stdout.write(line)
        return proc.wait()


def _print_run(record: dict, stack, wall: float) -> None:
    print(f"\n=== {DAG_ID} finished in {wall:.1f} s ===")
    print(f"run:               {record['run_id']} ({record['run_key']})")
    print(f"placement:         {record['cluster']} ({record['location']}, {record['pricing_class']})")
    metric = record.get("metric") or {}
    print(f"model:             {record['model']} on dataset {record['dataset']} ({record['classification']})")
    print(f"held-out metric:   {metric.get('name')} {metric.get('value')} (gate {metric.get('gate')})")
    print(f"model bundle:      {record['artefacts']['model']}")
    print(f"compressed model:  {record['artefacts']['compressed_model']}")
    print(f"validation report: {record['artefacts']['validation_report']}")
    print(f"evaluation report: {record['artefacts']['evaluation_report']}")
    print(f"run record:        {stack.settings.private_root / 'records' / record['project'] / (record['run_key'] + '.json')}")
    if record.get("endpoint"):
        print(f"endpoint:          {record['endpoint']}:predict  (POST {{\"instances\": [[...], ...]}}; "
              f"GET {record['endpoint']} lists the inputs)")
    else:
        print("endpoint:          not deployed (deploy=false)")
    print(f"Airflow env:       source {stack.env_file}   # then: airflow dags list-runs {DAG_ID}")


def _allocate_costs(record: dict, metered, started: float) -> int:
    """Allocate the days the demo spanned, as the nightly DAGs would, and print what it cost."""
    from datetime import UTC, datetime

    from hybridflow.devenv.demo_costs import allocate_demo_days, days_between
    from hybridflow.errors import HybridFlowError

    print("\n=== GPU metering and cost allocation ===")
    print(f"metering:          {metered.passes} passes, {metered.samples} GPU samples stored, "
          f"{metered.attributed} of them tied to runs")
    for error in metered.errors[:5]:
        print(f"metering problem:  {error}", file=sys.stderr)
    if len(metered.errors) > 5:
        print(f"metering problem:  {len(metered.errors) - 5} more like these", file=sys.stderr)
    days = days_between(datetime.fromtimestamp(started, UTC), datetime.now(UTC))
    try:
        costs = allocate_demo_days(days)
    except (HybridFlowError, OSError, ValueError) as exc:
        print(f"The run succeeded but its cost allocation failed: {exc}", file=sys.stderr)
        return 1
    effective = costs["effective_gpu_hours"]
    print(f"allocated {', '.join(d.isoformat() for d in days)}: {costs['gpu_hours']:.4f} GPU-hours"
          f"{'' if effective is None else f' ({effective:.4f} effective)'}, {costs['cost_usd']:,.4f} USD to "
          f"projects; idle owned capacity {costs['idle_cost_usd']:,.2f} USD")
    for evaluated in costs["budgets"]:
        mine = [p for p in evaluated["projects"] if p["project"] == record["project"]]
        state = (f"{mine[0]['spend_usd']:,.2f} of {mine[0]['budget_usd']:,.2f} USD ({mine[0]['share']:.2%})"
                 + (", FROZEN" if mine[0]["frozen"] else "")) if mine else "no budget in budgets.yaml"
        print(f"budget {evaluated['period']}:    {record['project']} {state}")
    print(f"cost report:       {costs['allocations'][-1]['files']}/report.html")
    print("GPU costs page:    hybridflow ui, then Browse -> GPU costs & budgets; the run's Cost & budget tab")
    return 0


def cmd_ui(args) -> int:
    from hybridflow.devenv.stack import DevStack

    stack = DevStack.default()
    env = _prepare(stack)
    print(f"Airflow UI on http://127.0.0.1:{env['AIRFLOW__API__PORT']} (Ctrl-C stops it)", flush=True)
    return subprocess.call([_airflow(), "standalone"], env=env)


def cmd_dev(args) -> int:
    if args.action == "k8s":
        from hybridflow.devenv.k8s.cli import main as k8s_main

        return k8s_main(args.rest)
    from hybridflow.devenv.stack import DevStack

    stack = DevStack.default()
    if args.action == "up":
        stack.up()
        print(f"embedded default is up; environment in {stack.env_file}")
    else:
        for line in stack.down():
            print(f"stopped {line}")
    return 0


def cmd_seed(args) -> int:
    from hybridflow.config import load_estate
    from hybridflow.datasets import seed
    from hybridflow.settings import get_settings

    settings = get_settings()
    estate = load_estate(settings.config_dir)
    seedable = sorted(n for n, e in estate.datasets.datasets.items() if e.seed)
    names = args.datasets or seedable
    unknown = [n for n in names if n not in seedable]
    if unknown:
        raise SystemExit(f"hybridflow seed: {', '.join(unknown)} cannot be seeded; datasets with a seed function: "
                         f"{', '.join(seedable) or 'none'}")
    for name in names:
        entry = estate.datasets.get(name)
        path = seed(entry, settings.private_root, estate.file_roots(settings.home))
        print(f"dataset {name} ({entry.location}) is in {path}")
    return 0


def _cache_store(cluster_name: str):
    from hybridflow.config import load_estate
    from hybridflow.hooks.object_store import ObjectStoreHook
    from hybridflow.settings import get_settings

    estate = load_estate(get_settings().config_dir)
    cluster = estate.clusters.get(cluster_name)
    if cluster is None or cluster.cache is None:
        with_cache = ", ".join(n for n, c in estate.clusters.items() if c.cache) or "none"
        raise SystemExit(f"--cluster {cluster_name!r} has no cloud cache; clusters with one: {with_cache}")
    try:
        return ObjectStoreHook(cluster.cache.conn_id).get_store(cluster.cache.bucket), estate
    except Exception as exc:  # noqa: BLE001 - the connection lookup's own error says which id
        raise SystemExit(
            f"cannot open the cache of {cluster_name} through connection {cluster.cache.conn_id!r}: {exc}. "
            "On the embedded default run `source var/dev/airflow.env` first."
        ) from exc


def cmd_cache(args) -> int:
    from datetime import datetime

    from hybridflow.cache import PruneRefused, list_versions, prune_cluster
    from hybridflow.settings import get_settings

    store, estate = _cache_store(args.cluster)
    if args.action == "versions":
        for v in list_versions(store, args.dataset):
            when = datetime.fromtimestamp(v.created_at).isoformat(timespec="seconds")
            print(f"{v.version}  {when}  {v.files:>7} files  {v.bytes:>14} bytes  by {v.created_by}")
        return 0
    keep = args.keep if args.keep is not None else estate.pipeline.staging.keep_versions
    try:
        report = prune_cluster(
            estate, args.cluster, store, args.dataset, private_root=get_settings().private_root, keep=keep,
            dry_run=args.dry_run, protect_s=args.protect_hours * 3600.0, min_blob_age_s=args.protect_hours * 3600.0,
        )
    except PruneRefused as exc:
        raise SystemExit(f"hybridflow cache prune: {exc}") from exc
    except ValueError as exc:
        raise SystemExit(f"--keep: {exc}") from exc
    print(report.summary())
    return 0


def cmd_dcgm(args) -> int:
    from datetime import UTC, datetime

    from hybridflow.metering.dcgm import DcgmError, ScrapeSettings, scrape

    settings = ScrapeSettings(connect_timeout_s=args.timeout, read_timeout_s=args.timeout, retries=args.retries)
    try:
        samples = scrape(args.source, cluster=args.cluster, ts=datetime.now(UTC), settings=settings,
                         default_node=args.node)
    except DcgmError as exc:
        raise SystemExit(f"hybridflow dcgm: {exc}") from exc
    json.dump([s.to_json() for s in samples], sys.stdout, indent=2)
    sys.stdout.write("\n")
    return 0


def cmd_local_exporter(args) -> int:
    from hybridflow.config import load_estate
    from hybridflow.metering.local_exporter import LocalExporterServer, LocalSlotExporter
    from hybridflow.settings import get_settings

    settings = get_settings()
    estate = load_estate(settings.config_dir)
    if args.cluster not in estate.clusters:
        raise SystemExit(f"--cluster: {args.cluster!r} is not in clusters.yaml; use one of {sorted(estate.clusters)}")
    metering = estate.pipeline.metering
    try:
        exporter = LocalSlotExporter(settings.state_dir, estate.clusters[args.cluster],
                                     idle_w=metering.local_idle_w, busy_w=metering.local_busy_w)
    except ValueError as exc:
        raise SystemExit(f"--cluster: {exc}") from exc
    from hybridflow.signals import stop_on_signals

    stop_on_signals()
    with LocalExporterServer(exporter, host="127.0.0.1", port=args.port) as server:
        print(f"serving {args.cluster}'s slots at {server.url} (the local stand-in for dcgm-exporter); Ctrl-C or SIGTERM stops",
              flush=True)
        try:
            while True:
                time.sleep(3600)
        except KeyboardInterrupt:
            pass
    return 0


def cmd_budgets(args) -> int:
    from datetime import UTC, datetime

    from hybridflow.budgets.config import period_of
    from hybridflow.budgets.enforce import default_store
    from hybridflow.settings import get_settings
    from hybridflow.ui.costs import budget_rows

    period = args.period or period_of(datetime.now(UTC).date())
    store = default_store()
    rows = budget_rows(get_settings().config_dir, store if store and store.has_schema() else None, period)
    json.dump({"period": period, "projects": rows}, sys.stdout, indent=2)
    sys.stdout.write("\n")
    return 0


def cmd_ledger(args) -> int:
    from sqlalchemy.engine import make_url

    from hybridflow.ledger import upgrade
    from hybridflow.ledger.engine import ledger_url
    from hybridflow.settings import get_settings

    settings = get_settings()
    url = make_url(args.url or ledger_url(settings.home))
    upgrade(url)
    where = url.render_as_string(hide_password=True)
    if args.action == "upgrade":
        print(f"ledger at {where} is at the latest schema")
        return 0
    from sqlalchemy import create_engine

    if args.action == "prices":
        return _import_prices(args, create_engine(url), settings)

    from hybridflow.ledger.sync import sync_run_records

    engine = create_engine(url)
    try:
        result = sync_run_records(settings.private_root, engine=engine, project=args.project)
    finally:
        engine.dispose()
    json.dump({"ledger": where, **result.to_json()}, sys.stdout, indent=2)
    sys.stdout.write("\n")
    return 1 if result.errors else 0


def _import_prices(args, engine, settings) -> int:
    from datetime import date

    from hybridflow.config import load_estate
    from hybridflow.ledger.prices import import_price_table

    missing = [f"--{n.replace('_', '-')}" for n in ("csv", "cluster", "provider", "valid_from") if not getattr(args, n)]
    if missing:
        print(f"hybridflow ledger prices needs {', '.join(missing)}", file=sys.stderr)
        return 2
    try:
        valid_from = date.fromisoformat(args.valid_from)
    except ValueError:
        print(f"--valid-from {args.valid_from!r} is not a date; use YYYY-MM-DD", file=sys.stderr)
        return 2
    from hybridflow.errors import ConfigError

    try:
        versions = import_price_table(engine, load_estate(settings.config_dir), args.csv, cluster=args.cluster,
                                      provider=args.provider, region=args.region, valid_from=valid_from)
    except ConfigError as exc:
        print(exc, file=sys.stderr)
        return 1
    finally:
        engine.dispose()
    json.dump(versions, sys.stdout, indent=2)
    sys.stdout.write("\n")
    return 0


def cmd_node(args: argparse.Namespace) -> int:
    from hybridflow import nodehealth

    if args.action == "list":
        json.dump(nodehealth.read_state(), sys.stdout, indent=2, sort_keys=True)
        sys.stdout.write("\n")
        return 0
    if not (args.cluster and args.node):
        print("hybridflow node restore needs the cluster and the node, e.g. hybridflow node restore cloud-east "
              "gpu-7", file=sys.stderr)
        return 2
    try:
        done = nodehealth.restore_node(args.cluster, args.node)
    except ValueError as exc:
        print(f"hybridflow node restore: {exc}", file=sys.stderr)
        return 2
    print("\n".join(done))
    return 0


def cmd_cluster(args: argparse.Namespace) -> int:
    """Exit 0; 2: bad input (nothing changed); 3: ``up`` lifted the fence but an endpoint stays served
    on the DR side (the primary failed the deploy gate); 4: ``down`` fenced, but its drain is incomplete."""
    from hybridflow.dr.fencing.drain import DrainIncomplete, fence_and_drain
    from hybridflow.dr.fencing.failback import declare_up
    from hybridflow.fencing import FencingError, fence_status, serving_stayed

    if args.action != "status" and not args.cluster:
        print(f"hybridflow cluster {args.action} needs the cluster, e.g. hybridflow cluster {args.action} onprem-a",
              file=sys.stderr)
        return 2
    stayed: list[str] = []
    try:
        if args.action == "down":
            out = fence_and_drain(args.cluster, args.reason or "", by=args.by)
        elif args.action == "up":
            change = declare_up(args.cluster, by=args.by, log=lambda m: print(m, file=sys.stderr))
            out, stayed = change.to_dict(), serving_stayed(change)
        else:
            out = fence_status()
    except (FencingError, DrainIncomplete) as exc:  # DrainIncomplete: fenced; a rerun drains what failed
        print(f"hybridflow cluster {args.action}: {exc}", file=sys.stderr)
        return 4 if isinstance(exc, DrainIncomplete) else 2
    json.dump(out, sys.stdout, indent=2, sort_keys=True)
    sys.stdout.write("\n")
    if args.action == "up" and stayed:
        print(f"hybridflow cluster up: {args.cluster} takes placements again, but serving stays on the "
              "disaster-recovery side:\n" + "\n".join(f"  - {s}" for s in stayed)
              + f"\nrun `hybridflow cluster up {args.cluster}` again to retry the serving failback", file=sys.stderr)
        return 3
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="hybridflow", description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="run the training pipeline end to end on the embedded default, then allocate its GPU cost")
    demo.add_argument("--conf", help='trigger Params as JSON, e.g. \'{"cluster_preference": "public"}\'')
    demo.add_argument("--quiet", action="store_true", help="only print the summary")
    demo.set_defaults(func=cmd_demo)
    ui = sub.add_parser("ui", help="start Airflow (api-server, scheduler, triggerer) on the same setup")
    ui.set_defaults(func=cmd_ui)
    dev = sub.add_parser("dev", help="start or stop the embedded object stores and endpoints; k8s: a local cluster")
    dev.add_argument("action", choices=["up", "down", "k8s"])
    dev.add_argument("rest", nargs=argparse.REMAINDER, help="k8s: its action and options (hybridflow dev k8s -h)")
    dev.set_defaults(func=cmd_dev)
    seed = sub.add_parser("seed", help="write the example datasets where the catalogue puts them (idempotent)")
    seed.add_argument("datasets", nargs="*", help="catalogue names (default: every dataset with a seed function)")
    seed.set_defaults(func=cmd_seed)
    cache = sub.add_parser("cache", help="a cloud cache's dataset versions; pruning old ones")
    cache.add_argument("action", choices=["versions", "prune"])
    cache.add_argument("--cluster", required=True, help="a cluster with a cache in config/clusters.yaml")
    cache.add_argument("--dataset", required=True, help="dataset name, as in datasets.yaml")
    cache.add_argument("--keep", type=int, help="versions to keep (at least 3; default staging.keep_versions)")
    cache.add_argument("--protect-hours", type=float, default=24.0,
                       help="never delete versions or blobs younger than this (default 24)")
    cache.add_argument("--dry-run", action="store_true", help="say what would be deleted, delete nothing")
    cache.set_defaults(func=cmd_cache)
    dcgm = sub.add_parser("dcgm", help="scrape a dcgm-exporter /metrics URL or read a saved page; print samples as JSON")
    dcgm.add_argument("source", help="http(s)://node:9400/metrics, or a file holding such a page")
    dcgm.add_argument("--cluster", default="adhoc", help="cluster name to put in the samples (default adhoc)")
    dcgm.add_argument("--node", help="node name for exporters run without a Hostname label")
    dcgm.add_argument("--timeout", type=float, default=5.0, help="connect and read timeout in seconds (default 5)")
    dcgm.add_argument("--retries", type=int, default=2, help="retries on connection errors and 5xx (default 2)")
    dcgm.set_defaults(func=cmd_dcgm)
    lx = sub.add_parser("local-exporter", help="serve a local cluster's slots in dcgm-exporter's format on 127.0.0.1")
    lx.add_argument("--cluster", required=True, help="a cluster with backend local in config/clusters.yaml")
    lx.add_argument("--port", type=int, default=9400, help="port on 127.0.0.1 (default 9400, dcgm-exporter's)")
    lx.set_defaults(func=cmd_local_exporter)
    budgets = sub.add_parser("budgets", help="each project's budget, spend and freeze for a month, as JSON")
    budgets.add_argument("--period", help="month as YYYY-MM (default: the current month)")
    budgets.set_defaults(func=cmd_budgets)
    ledger = sub.add_parser("ledger", help="upgrade: create or migrate the ledger database to the latest schema; "
                            "sync: ingest the run records in private storage (those written before, or missed); "
                            "prices: add a price table's prices to the catalog")
    ledger.add_argument("action", choices=["upgrade", "sync", "prices"])
    ledger.add_argument("--project", help="sync only this project's records")
    ledger.add_argument("--csv", type=Path, help="prices: a price table (provider, region, gpu_model, "
                        "gpu_memory_gb, pricing_tier, usd_per_gpu_hour, price_scope)")
    ledger.add_argument("--cluster", help="prices: the public cluster whose on-demand and spot pools get them")
    ledger.add_argument("--provider", help="prices: the table's provider for that cluster, e.g. aws")
    ledger.add_argument("--region", help="prices: the table's region (default: the cluster's region)")
    ledger.add_argument("--valid-from", help="prices: first day (YYYY-MM-DD) the prices apply")
    ledger.add_argument("--url", help="SQLAlchemy URL (default: HYBRIDFLOW_LEDGER_URL, else ledger/ledger.db under HYBRIDFLOW_HOME)")
    ledger.set_defaults(func=cmd_ledger)
    node = sub.add_parser("node", help="list: nodes node health marked unhealthy; restore: uncordon a repaired "
                          "node (kubernetes) and clear its mark")
    node.add_argument("action", choices=["list", "restore"])
    node.add_argument("cluster", nargs="?", help="restore: the node's cluster in config/clusters.yaml")
    node.add_argument("node", nargs="?", help="restore: the node's name")
    node.set_defaults(func=cmd_node)
    cluster = sub.add_parser("cluster", help="down: fence a cluster (no new placements, its gangs checkpointed, its "
                             "serving moved to the DR side; a primary down puts the estate in takeover); up: lift the "
                             "fence, serving back through the deploy gate (exit 3 while it stays on DR); status: as JSON")
    cluster.add_argument("action", choices=["down", "up", "status"])
    cluster.add_argument("cluster", nargs="?", help="down/up: a cluster of config/clusters.yaml")
    cluster.add_argument("--reason", help="down: why the cluster is declared down (kept with the fence)")
    cluster.add_argument("--by", help="who declares it (default: the login name)")
    cluster.set_defaults(func=cmd_cluster)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
