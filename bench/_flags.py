"""The flags the benchmarks share, defined in one place: the parser (the benchmark's docstring as its
description), the model preset or presets it builds, the numerics it runs, its timed repeats and its JSON
output. Each benchmark picks its defaults; the names, types and choices are the same everywhere."""

import argparse

NUMERICS = ("strict", "fast")


def parser(description: str) -> argparse.ArgumentParser:
    return argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)


def add_model(ap: argparse.ArgumentParser, default: str | None, help: str = "model preset (random weights)"):
    ap.add_argument("--model", default=default, help=help)


def add_models(
    ap: argparse.ArgumentParser, default: str, help: str = "comma-separated presets (random weights)", **kwargs
):
    ap.add_argument("--models", default=default, help=help, **kwargs)


def add_numerics(ap: argparse.ArgumentParser, default: str = "strict", help: str = "strict or fast numerics"):
    ap.add_argument("--numerics", default=default, choices=NUMERICS, help=help)


def add_repeats(ap: argparse.ArgumentParser, default: int, help: str = "timed runs per row (median)"):
    ap.add_argument("--repeats", type=int, default=default, help=help)


def add_out(ap: argparse.ArgumentParser, help: str = "write the results as JSON here", default: str | None = None):
    ap.add_argument("--out", default=default, help=help)
