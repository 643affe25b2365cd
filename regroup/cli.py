"""The ``regroup`` command.

Each subcommand lives in the module that owns it and exposes
``add_arguments(parser)`` and ``run(args) -> int``; modules are imported only when
their subcommand runs, so ``regroup controller`` never imports torch.
"""

from __future__ import annotations

import argparse
import importlib
import sys

SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "controller": ("regroup.controller.main", "run the elastic controller against a Kubernetes API and etcd"),
    "status": ("regroup.controller.status", "show a job's world size, members, progress and last re-form"),
    "etcd-auth": ("regroup.controller.etcd_auth", "etcd authentication for regroup: bootstrap root and the controller's user"),
    "demo": ("regroup.demo.main", "run the whole loop locally: etcd, agents, trainers, controller, churn"),
    "trace-report": ("regroup.trace_report", "re-form latency table from exported spans (OTLP JSON lines)"),
    "whatif": ("regroup.whatif.command", "expected goodput under a churn rate, three ways (four with spares); min/max and checkpoint interval"),
    "smoke": ("regroup.elastic.smoke", "all-reduce + matmul smoke check: bus bandwidth, TFLOP/s and MFU"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="regroup", description="Elastic PyTorch training that survives node churn.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        sub_parser = sub.add_parser(name, help=help_text, description=help_text)
        sub_parser.set_defaults(_module=module_name)
        # Arguments are added lazily below, once we know which subcommand runs.
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    if not argv or argv[0] not in SUBCOMMANDS:
        parser.parse_args(argv)  # prints usage / the error and exits
        return 2
    name = argv[0]
    module = importlib.import_module(SUBCOMMANDS[name][0])
    sub_parser = argparse.ArgumentParser(prog=f"regroup {name}", description=SUBCOMMANDS[name][1])
    module.add_arguments(sub_parser)
    args = sub_parser.parse_args(argv[1:])
    return int(module.run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
