"""`sluice epp`'s process: gRPC's listener chosen before gRPC is imported (it reads
GRPC_EXPERIMENTS once, at import)."""

import os
import subprocess
import sys

from sluice.gateway.server.cli import LISTENER_EXPERIMENT

# Runs `sluice epp` up to its event loop, then reports what gRPC would start with.
CHECK = """
import os, sys
import sluice.gateway.server.cli as epp
def report(coro):
    coro.close()
    print("grpc imported:", "grpc" in sys.modules, "experiments:", os.environ.get("GRPC_EXPERIMENTS"))
epp.run_loop = report
from sluice.cli import main
main(["epp", "--routing", "round_robin", "--engine", "http://127.0.0.1:1"])
"""


def _start(env: dict[str, str]) -> str:
    out = subprocess.run([sys.executable, "-c", CHECK], env=env, capture_output=True, text=True,
                         timeout=60, check=True)
    return out.stdout.strip().splitlines()[-1]


def test_epp_sets_the_grpc_listener_before_grpc_is_imported():
    env = {k: v for k, v in os.environ.items() if k != "GRPC_EXPERIMENTS"}
    assert _start(env) == f"grpc imported: False experiments: {LISTENER_EXPERIMENT}"


def test_an_operators_grpc_experiments_are_kept():
    env = {**os.environ, "GRPC_EXPERIMENTS": "-event_engine_client"}
    assert _start(env) == "grpc imported: False experiments: -event_engine_client"
