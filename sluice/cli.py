"""`sluice` command line: one subcommand per process kind.

Each subcommand lives in the module that implements it, which exposes
`add_arguments(parser)` and `main(args) -> int`; modules are imported lazily
so the gateway and operator images never import torch.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# (subcommand path, module, help)
COMMANDS: list[tuple[tuple[str, ...], str, str]] = [
    (("engine",), "sluice.engine.cli", "serve a model with the Sluice engine (OpenAI API)"),
    (("epp",), "sluice.gateway.server.cli", "the endpoint picker for Envoy (GIE ext_proc)"),
    (("up",), "sluice.local.cli", "run Redis, engines and the gateway on this machine"),
    (("operator",), "sluice.operator.cli", "run the Kubernetes operator (kopf)"),
    (("bench", "engine"), "sluice.bench.engine", "offline engine throughput / latency"),
    (("bench", "serve"), "sluice.bench.serve", "drive an OpenAI endpoint with a workload"),
    (("bench", "soak"), "sluice.bench.soak", "long mixed load through the local stack, with faults"),
    (("bench", "flow"), "sluice.bench.flow_control",
     "priorities and tenants under saturation, with and without flow control"),
    (("bench", "step"), "sluice.bench.step_profile", "where a decode step's time goes"),
    (("bench", "gguf"), "sluice.bench.gguf_matvec",
     "one decode matvec per GGUF type and kernel build, against bf16"),
    (("bench", "lora"), "sluice.bench.lora", "serving with LoRA adapters against the base model"),
    (("bench", "structured"), "sluice.bench.structured",
     "what structured outputs add to a decode step"),
]


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sluice", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    groups: dict[str, argparse._SubParsersAction] = {}
    for path, module, help_text in COMMANDS:
        parent = sub
        if len(path) == 2:
            if path[0] not in groups:
                group = sub.add_parser(path[0], help=f"{path[0]} commands")
                groups[path[0]] = group.add_subparsers(dest="subcommand", required=True)
            parent = groups[path[0]]
        p = parent.add_parser(path[-1], help=help_text)
        p.set_defaults(_module=module)
        # Only the chosen subcommand's module is imported (keeps torch out of
        # the gateway and the operator).
        if _selected(argv, path):
            importlib.import_module(module).add_arguments(p)
    return parser


def _selected(argv: list[str], path: tuple[str, ...]) -> bool:
    words = [a for a in argv if not a.startswith("-")]
    return tuple(words[: len(path)]) == path


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser(argv).parse_args(argv)
    return int(importlib.import_module(args._module).main(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
