"""``hybridflow dev k8s build|up|down|status`` (also ``scripts/k8s-cluster``): a real Kubernetes
control plane on 127.0.0.1 for development and the ``k8s_real`` tests.

    build                build the missing binaries (cached per version outside the repository)
    up [--port P] [--nodes-from CLUSTER] [--gpus-per-node N] [--addons kueue,volcano,kserve]
                         start it (or reuse the running one) and register fake GPU nodes from a
                         cluster of config/clusters.yaml; prints the kubeconfig's path and a
                         Connection value for AIRFLOW_CONN_<ID>
    down                 stop every process ``up`` started
    status               the running plane's server, kubeconfig and processes, as JSON
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path


def _nodes(cluster_name: str | None, gpus_per_node: int):
    from hybridflow.devenv.k8s.nodes import pool_nodes

    if not cluster_name:
        return pool_nodes("local", [{"name": "a100", "gpus": 8, "node_labels": {"hybridflow.io/pool": "a100"}}],
                          gpus_per_node=gpus_per_node)
    from hybridflow.config import load_estate
    from hybridflow.settings import get_settings

    estate = load_estate(get_settings().config_dir)
    cluster = estate.clusters.get(cluster_name)
    if cluster is None:
        raise SystemExit(f"--nodes-from {cluster_name!r} is not a cluster of config/clusters.yaml; "
                         f"clusters: {', '.join(sorted(estate.clusters))}")
    pools = [p.model_dump() for p in cluster.node_pools]
    return pool_nodes(cluster_name, pools, gpus_per_node=gpus_per_node)


def main(argv: list[str] | None = None) -> int:
    from hybridflow.devenv.k8s.build import BuildError, build
    from hybridflow.devenv.k8s.controlplane import ADDONS, ControlPlane, default_root
    from hybridflow.devenv.k8s.processes import ControlPlaneError

    parser = argparse.ArgumentParser(prog="hybridflow dev k8s", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("action", choices=["build", "up", "down", "status"])
    parser.add_argument("--dir", type=Path, help="the plane's folder (default HYBRIDFLOW_K8S_DIR, else var/dev/k8s)")
    parser.add_argument("--port", type=int, default=int(os.environ.get("HYBRIDFLOW_K8S_PORT", "16443")),
                        help="the API server's port on 127.0.0.1 (default 16443)")
    parser.add_argument("--nodes-from", help="a cluster of config/clusters.yaml whose node pools become fake nodes "
                        "(default: one 8-GPU a100 pool)")
    parser.add_argument("--gpus-per-node", type=int, default=8)
    parser.add_argument("--addons", default=",".join(ADDONS), help=f"comma-separated, of {','.join(ADDONS)}")
    args = parser.parse_args(argv)
    try:
        if args.action == "build":
            for name, path in build(log=lambda m: print(m, flush=True)).items():
                print(f"{name}: {path}")
            return 0
        plane = ControlPlane(args.dir or default_root(), port=args.port,
                             addons=[a for a in args.addons.split(",") if a], log=lambda m: print(m, flush=True))
        if args.action == "up":
            plane.up(_nodes(args.nodes_from, args.gpus_per_node))
            conn = json.dumps({"conn_type": "kubernetes", "extra": {"kube_config_path": str(plane.kubeconfig)}})
            print(f"export KUBECONFIG={plane.kubeconfig}\nConnection: AIRFLOW_CONN_<ID>='{conn}'")
        elif args.action == "down":
            stopped = plane.down()
            print(f"stopped {', '.join(stopped)}" if stopped else "nothing was running")
        else:
            print(json.dumps({"running": plane.running(), **plane.state(), "kubeconfig": str(plane.kubeconfig)},
                             indent=2))
    except (BuildError, ControlPlaneError) as exc:
        print(f"hybridflow dev k8s {args.action}: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
