"""``tokenfleet cluster up|down|kubeconfig-for``: the local control plane from the shell."""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from .nodes import ACCELERATOR_RESOURCES, NodePool
from .plane import LocalCluster, PlaneError

DEFAULT_DIR = Path(os.environ.get("TOKENFLEET_CLUSTER_DIR", Path.home() / ".cache" / "tokenfleet" / "cluster"))


def _dir_arg(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--dir", type=Path, default=DEFAULT_DIR,
                    help=f"state folder of the plane (default {DEFAULT_DIR}, or $TOKENFLEET_CLUSTER_DIR)")


def up(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="tokenfleet cluster up",
                                 description="Start etcd, kube-apiserver, kube-controller-manager, kube-scheduler, "
                                             "KWOK and the local pod runner on loopback, with fake accelerator nodes.")
    _dir_arg(ap)
    ap.add_argument("--nodes", type=int, default=4, help="number of fake accelerator nodes (default 4)")
    ap.add_argument("--accelerator", choices=sorted(ACCELERATOR_RESOURCES), default="gpu",
                    help="gpu → nvidia.com/gpu, tpu → google.com/tpu")
    ap.add_argument("--per-node", type=int, default=8, help="accelerators per node (default 8)")
    ap.add_argument("--accelerator-type", default=None, help="value of the tokenfleet.dev/accelerator label")
    ap.add_argument("--nodes-per-block", type=int, default=4, help="hosts per topology block (default 4)")
    ap.add_argument("--blocks-per-zone", type=int, default=4)
    ap.add_argument("--real-node", action="store_true",
                    help="also start a real node beside the KWOK nodes: the kubelet, containerd and CNI in a network "
                         "namespace of the plane's own (root; see docs/local-cluster.md)")
    ap.add_argument("--load-images", action="store_true",
                    help="with --real-node: build tokenfleet's images (hack/build-images.sh, cached) and load them "
                         "into the node's containerd")
    args = ap.parse_args(argv)
    if args.load_images and not args.real_node:
        print("tokenfleet cluster up: --load-images needs --real-node", file=sys.stderr)
        return 2
    try:
        pool = NodePool(count=args.nodes, accelerator=args.accelerator, per_node=args.per_node,
                        accelerator_type=args.accelerator_type or ("nvidia-h100-80gb" if args.accelerator == "gpu" else "tpu-v5p"),
                        nodes_per_block=args.nodes_per_block, blocks_per_zone=args.blocks_per_zone)
        plane = LocalCluster(args.dir, pools=[pool], real_node=args.real_node).up()
        if args.load_images:
            from .. import images
            images.build()
            loaded = images.load_into_node(plane.node_layout())
            print(f"images on {plane.node_layout().name}: {', '.join(images.ref(n) for n in images.NAMES)}"
                  f" ({'loaded ' + ', '.join(loaded) if loaded else 'already there'})")
    except (PlaneError, ValueError, RuntimeError) as e:
        print(f"tokenfleet cluster up: {e}", file=sys.stderr)
        return 1
    print(f"\nexport KUBECONFIG={plane.kubeconfig}\nkubectl get nodes   # kubectl v1.34 is in {plane.state()['bin_dir']}\n"
          f"stop it with: tokenfleet cluster down --dir {plane.dir}")
    return 0


def down(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="tokenfleet cluster down", description="Stop every process 'cluster up' started.")
    _dir_arg(ap)
    args = ap.parse_args(argv)
    stopped = LocalCluster(args.dir).down()
    print(f"stopped: {', '.join(stopped) or 'nothing was running'}")
    return 0


def kubeconfig_for(argv: list[str]) -> int:
    from .credentials import service_account_kubeconfig
    ap = argparse.ArgumentParser(prog="tokenfleet cluster kubeconfig-for",
                                 description="Write a kubeconfig that authenticates as a ServiceAccount (TokenRequest API).")
    _dir_arg(ap)
    ap.add_argument("--namespace", "-n", required=True)
    ap.add_argument("--service-account", required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--duration", type=int, default=3600, help="token lifetime in seconds")
    args = ap.parse_args(argv)
    path = service_account_kubeconfig(LocalCluster(args.dir), args.namespace, args.service_account, args.out,
                                      args.duration)
    print(path)
    return 0
