"""The thin `jaxopt-train` entry point.

Each subcommand lives in the module that owns its idea and exposes
`main(argv: list[str] | None) -> int`; this file only dispatches, importing
lazily so that `jaxopt-train --help` never starts a JAX backend.
"""

from __future__ import annotations

import importlib
import sys

# subcommand -> (module, one-line help)
_COMMANDS: dict[str, tuple[str, str]] = {
    "train": ("jaxopt_train.train.cli", "train a model (default: gpt-tiny on the embedded corpus)"),
    "bench": ("jaxopt_train.bench.cli", "benchmarks: train | collectives | matmul | accumulation"),
    "doctor": ("jaxopt_train.runtime.doctor", "check the environment (versions, GPUs, drivers, flags)"),
    "plot": ("jaxopt_train.plot", "plot loss/throughput/MFU/memory curves of run directories"),
    "kernels": ("jaxopt_train.runtime.kernel_time", "GPU kernel time per step by name in a profile trace"),
    # Also `python -m jaxopt_train.kernels.autotune`, which works but makes runpy warn: the
    # kernels package imports that module for its `autotune` function.
    "autotune": ("jaxopt_train.kernels.autotune", "tune matmul kernel tilings and cache the winners"),
}


def _usage() -> str:
    lines = ["usage: jaxopt-train COMMAND [ARGS ...]", "       jaxopt-train --help | --version", "", "commands:"]
    lines += [f"  {name:<8} {help_}" for name, (_, help_) in _COMMANDS.items()]
    lines += ["", "Run `jaxopt-train COMMAND --help` for a command's options."]
    return "\n".join(lines)


def _usage_error(message: str) -> int:
    print(f"jaxopt-train: error: {message}", file=sys.stderr)
    print(_usage(), file=sys.stderr)
    return 2


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv:
        # A bare `jaxopt-train` used to start a 200-step training run; training is
        # `jaxopt-train train`, so a missing command is a usage error like any other.
        return _usage_error(f"a command is required; expected one of {list(_COMMANDS)}")
    command, rest = argv[0], argv[1:]
    if command in ("-h", "--help"):
        print(_usage())
        return 0
    if command in ("-V", "--version"):
        from jaxopt_train import __version__  # noqa: PLC0415

        print(f"jaxopt-train {__version__}")
        return 0
    if command.startswith("-"):
        return _usage_error(f"unknown option {command!r} before the command; options other than "
                            f"--help/--version go after it (`jaxopt-train COMMAND --help` lists them)")
    if command not in _COMMANDS:
        return _usage_error(f"unknown command {command!r}; expected one of {list(_COMMANDS)}")
    try:  # importing the command (jax with it) takes seconds: a Ctrl-C then is the user's too
        return int(importlib.import_module(_COMMANDS[command][0]).main(rest) or 0)
    except KeyboardInterrupt:
        # Ctrl-C is the user's choice, not a crash: no traceback, the shell's status for
        # SIGINT. (A training loop catches it itself and saves a checkpoint first.)
        print(f"jaxopt-train {command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
