"""The etcd flags the controller's commands share (``regroup controller``, ``regroup
etcd-auth``): where etcd is and the client certificate to present, parsed once."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from regroup.etcd import EtcdSettings


def add_etcd_arguments(parser: argparse.ArgumentParser, endpoint_help: str) -> None:
    """``--etcd`` (default ``$REGROUP_ETCD``, else 127.0.0.1:2379) and the TLS files."""
    parser.add_argument("--etcd", default=os.environ.get("REGROUP_ETCD", "127.0.0.1:2379"),
                        help=f"{endpoint_help} (default %(default)s)")
    parser.add_argument("--etcd-cacert", type=Path, default=None, help="CA bundle for etcd TLS")
    parser.add_argument("--etcd-cert", type=Path, default=None,
                        help="client certificate for etcd mTLS (with etcd's --client-cert-auth, its CN is the etcd "
                             "user)")
    parser.add_argument("--etcd-key", type=Path, default=None, help="client key for etcd mTLS")


def etcd_settings(args: argparse.Namespace) -> EtcdSettings:
    """The ``EtcdSettings`` the flags of ``add_etcd_arguments`` describe."""
    return EtcdSettings.from_endpoint_string(args.etcd, cacert=args.etcd_cacert, cert=args.etcd_cert, key=args.etcd_key)
