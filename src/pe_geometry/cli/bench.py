"""The benchmarks' scoring protocols on trained runs and real checkpoints, each a subcommand (pe_geometry/benchmarks/).

    pe-bench extrapolation SWEEP [SWEEP ...] --out DIR     # each run's loss at 1x-16x its training length
    pe-bench tasks SWEEP [SWEEP ...] --out DIR             # copy, recall, passkey, addition at 1x-16x: what it writes
    pe-bench pretrained --out DIR                          # real checkpoints beside the trained-here runs
    pe-bench training-length train|score                   # issue 51's experiment, from its committed plan
    pe-bench generation-context RUN                        # a sample past the training length vs one inside it
    pe-bench readers RUN [RUN ...] --out DIR               # a run's own record vs pe-pretrained on its export
    pe-bench <benchmark> --help                            # its protocol and options
"""

from __future__ import annotations

import argparse
import importlib
import textwrap

import pe_geometry.offline  # noqa: F401  (before anything that could reach a hub)
from pe_geometry.cli import console_script
from pe_geometry.extras import exit_on_missing_extra

# subcommand -> its module in pe_geometry.benchmarks (each has add_arguments(parser) and run(args, parser); some a
# torch-free check(args, parser) that runs first)
BENCHMARKS = {
    "extrapolation": "extrapolation",
    "tasks": "length_tasks",
    "pretrained": "pretrained_study",
    "training-length": "training_length",
    "generation-context": "generation_context",
    "readers": "two_readers",
}
QUIET_NUMPY = {"extrapolation", "tasks"}  # no warning for a NaN they mean (a length no example reaches, one seed's sd)


def parser() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    """The command line, and each benchmark's own parser (its ``error`` names the subcommand)."""
    main_parser = argparse.ArgumentParser(prog="pe-bench", description=__doc__.splitlines()[0],
                                          epilog=textwrap.dedent(__doc__.split("\n", 1)[1]).strip(),
                                          formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = main_parser.add_subparsers(dest="benchmark", required=True, metavar="BENCHMARK")
    subparsers = {}
    for name, module_name in BENCHMARKS.items():
        module = importlib.import_module(f"pe_geometry.benchmarks.{module_name}")
        doc = module.__doc__.strip()
        sub = commands.add_parser(name, help=doc.splitlines()[0], description=doc,
                                  formatter_class=argparse.RawDescriptionHelpFormatter)
        module.add_arguments(sub)
        subparsers[name] = sub
    return main_parser, subparsers


def main(argv: list[str] | None = None):
    """Run one benchmark; returns what it returns (the payload its JSON holds), for a Python caller."""
    main_parser, subparsers = parser()
    args = main_parser.parse_args(argv)
    module = importlib.import_module(f"pe_geometry.benchmarks.{BENCHMARKS[args.benchmark]}")
    if hasattr(module, "check"):  # what can be refused without torch (no runs, runs of the other kind): in a second
        module.check(args, subparsers[args.benchmark])
    from pe_geometry.training.threads import use_idle_cores

    use_idle_cores()  # the cores idle now, as pe-train (OMP_NUM_THREADS=N to choose)
    with exit_on_missing_extra():  # a missing extra: one error line naming it, exit code 2, before any run is read
        if args.benchmark not in QUIET_NUMPY:
            return module.run(args, subparsers[args.benchmark])
        import numpy as np

        with np.errstate(all="ignore"):
            return module.run(args, subparsers[args.benchmark])


cli = console_script(main)  # pe-bench


if __name__ == "__main__":
    cli()
