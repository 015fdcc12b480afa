"""`python -m tests.cluster.cluster_probe --ray-address A --cluster-name N [--wait-clean S]`: from a process
of its own (a test session already holds a Ray connection of its own), read a running cluster's
membership and wait until every worker's pool is clean. Prints one JSON line; exits 0 when clean."""
from __future__ import annotations

import argparse
import json
import sys

import ray


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ray-address", required=True)
    parser.add_argument("--cluster-name", required=True)
    parser.add_argument("--wait-clean", type=float, default=30.0)
    args = parser.parse_args(argv)
    from cluster.launcher import RAY_NAMESPACE, connect_controller
    from tests.router.cleanliness import wait_workers_clean

    ray.init(address=args.ray_address, namespace=RAY_NAMESPACE, configure_logging=False, log_to_driver=False)
    controller = connect_controller(args.cluster_name)
    membership = ray.get(controller.membership(), timeout=30)
    report = {"members": [[m.worker_id, m.role, m.epoch, m.state] for m in membership.members]}
    try:
        wait_workers_clean(membership, args.wait_clean)
        report["clean"] = True
    except AssertionError as err:
        report["clean"], report["error"] = False, str(err)
    print(json.dumps(report), flush=True)
    return 0 if report["clean"] else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
