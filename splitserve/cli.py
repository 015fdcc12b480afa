"""The `splitserve` command line. Subcommands live in a small registry; unknown ones are listed."""

from __future__ import annotations

import argparse
import importlib.util
import sys
from collections.abc import Callable

from splitserve import __version__


def _demo_model(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(
        prog="splitserve demo-model", description="Write the deterministic demo checkpoint to DIR."
    )
    parser.add_argument("dir")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    from engine.demo_model import write_demo_model

    print(write_demo_model(args.dir, seed=args.seed))


def _bench_engine(argv: list[str]) -> None:
    """Runs the engine benchmark script of a source checkout (`benchmarks/`) as its own program: the
    product never imports benchmark code. `--accuracy` runs the quantization accuracy report instead."""
    import subprocess

    script = "benchmarks.bench_quant_accuracy" if "--accuracy" in argv else "benchmarks.bench_engine"
    if importlib.util.find_spec("benchmarks") is None:
        raise SystemExit(f"splitserve bench-engine: {script} is not installed (run it from a source checkout)")
    args = [arg for arg in argv if arg != "--accuracy"]
    raise SystemExit(subprocess.call([sys.executable, "-m", script, *args]))


def _bench(argv: list[str]) -> None:
    from loadtest.cli import main

    main(argv)


def _chaos(argv: list[str]) -> None:
    from loadtest.chaos import main

    main(argv)


def _simulate(argv: list[str]) -> None:
    from loadtest.sim_cli import main

    main(argv)


def _plan(argv: list[str]) -> None:
    from loadtest.plan_cli import main

    main(argv)


def _profile(argv: list[str]) -> None:
    from loadtest.profile_cli import main

    main(argv)


def _quantize(argv: list[str]) -> None:
    from splitserve.quantize import main

    main(argv)


def _offline(argv: list[str]) -> None:
    from engine.demo import main

    main(argv)


def _serve(argv: list[str]) -> None:
    from splitserve.serve import main

    main(argv)


def _controller(argv: list[str]) -> None:
    from splitserve.serve import controller_main

    controller_main(argv)


def _router(argv: list[str]) -> None:
    from splitserve.serve import router_main

    router_main(argv)


def _generate(argv: list[str]) -> None:
    from splitserve_client.cli_client import generate_main

    generate_main(argv)


def _status(argv: list[str]) -> None:
    from splitserve_client.cli_client import status_main

    status_main(argv)


def _health(argv: list[str]) -> None:
    from splitserve_client.cli_client import health_main

    health_main(argv)


COMMANDS: dict[str, tuple[Callable[[list[str]], None], str]] = {
    "serve": (_serve, "start (or join) a cluster's controller and serve one router"),
    "controller": (_controller, "start only a cluster's controller in a running Ray cluster"),
    "router": (_router, "serve one more router against a running cluster"),
    "generate": (_generate, "stream a completion from a router to the terminal"),
    "status": (_status, "show a router's workers, load and cache figures"),
    "health": (_health, "exit 0 iff a router's gRPC health service is SERVING"),
    "demo-model": (_demo_model, "write the demo checkpoint to a directory"),
    "bench-engine": (
        _bench_engine,
        "offline throughput of the engine vs transformers.generate; --accuracy: quantized vs unquantized",
    ),
    "bench": (_bench, "load-test a running router (Poisson, shared-prefix, trace replay)"),
    "chaos": (_chaos, "SIGKILL workers while a bench workload runs; report lost, diverged, migrated requests"),
    "profile": (_profile, "measure this machine's step costs (or write a GPU roofline profile) for the simulator"),
    "plan": (_plan, "size the prefill / decode pools (and TP) for a workload at an SLO, by simulation"),
    "simulate": (_simulate, "simulate a bench workload on a cluster of a given shape, from a profile"),
    "offline": (_offline, "generate offline with the in-process engine and print timings"),
    "quantize": (_quantize, "write a GPTQ / AWQ / round-to-nearest quantized copy of a checkpoint"),
}


def version_line() -> str:
    """splitserve's version and those of the packages a bug report needs, read from their metadata
    (nothing heavy is imported)."""
    from importlib import metadata

    def version(dist: str) -> str:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            return "not installed"

    deps = ", ".join(f"{d} {version(d)}" for d in ("torch", "ray", "transformers", "grpcio", "protobuf"))
    return f"splitserve {__version__} (Python {sys.version.split()[0]}; {deps})"


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in ("-V", "--version"):
        print(version_line())
        return
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: splitserve [--version] COMMAND [ARGS]\n\ncommands:")
        for name, (_, help_text) in COMMANDS.items():
            print(f"  {name:<14} {help_text}")
        return
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        sys.exit(f"splitserve: unknown command {name!r}; known: {', '.join(COMMANDS)}")
    COMMANDS[name][0](rest)


if __name__ == "__main__":
    main()
