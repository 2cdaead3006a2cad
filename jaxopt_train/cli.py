"""The thin `jaxopt-train` entry point.

Each subcommand lives in the module that owns its idea and exposes
`main(argv: list[str] | None) -> int`; this file only dispatches, importing
lazily so that `jaxopt-train --help` never starts a JAX backend.
"""

from __future__ import annotations

import gc
import importlib
import logging
import os
import signal
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import NoReturn

# What `main` returns for a Ctrl-C, and only for one: the shell's status for SIGINT.
EXIT_INTERRUPTED = 130

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
        with _interrupts_raise():
            return int(importlib.import_module(_COMMANDS[command][0]).main(rest) or 0)
    except KeyboardInterrupt:
        # Ctrl-C is the user's choice, not a crash: no traceback, the shell's status for
        # SIGINT. (A training loop catches it itself and saves a checkpoint first.)
        print(f"jaxopt-train {command}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except (AssertionError, RuntimeError):
        from jaxopt_train.runtime._backend import backend_start_failure  # noqa: PLC0415

        reason = backend_start_failure()
        if reason is None:
            raise
        # JAX_PLATFORMS=cuda without the CUDA plugin ends in a bare AssertionError deep in
        # jax: say what failed and where to look, not a page of jax's frames.
        print(f"jaxopt-train {command}: error: JAX could not start a backend: {reason}\n"
              f"  a platform named in JAX_PLATFORMS needs its plugin (CUDA: pip install -e "
              f"'.[gpu]'); unset JAX_PLATFORMS to let JAX choose; `jaxopt-train doctor` "
              f"checks the setup", file=sys.stderr)
        return 1


def run() -> NoReturn:
    """The `jaxopt-train` program: `main()`, then exit with its status.

    After a Ctrl-C the process ends at once (`os._exit`, once stdio and logging are
    flushed): XLA may still be compiling on its own threads, and the interpreter's teardown
    under them crashed (SIGSEGV in `PjRtLoadedExecutable::Create`, exit -11, in 4 of 4
    interrupts of `bench train` during its first compile). By then the command's
    `finally` blocks have closed its files and checkpoints.
    """
    code = main()
    if code == EXIT_INTERRUPTED:
        sys.stdout.flush()
        sys.stderr.flush()
        logging.shutdown()
        os._exit(code)
    sys.exit(code)


@contextmanager
def _interrupts_raise() -> Iterator[None]:
    """Within it a Ctrl-C raises KeyboardInterrupt where the program can see it.

    Python's own handler raises it in whatever Python code runs next, and when that is a
    garbage-collector callback (JAX registers one) or a `__del__`, the exception is printed
    as "Exception ignored" and dropped: the command ran on as if no key had been pressed.
    There the signal is sent again a moment later instead. A handler the caller installed
    (or SIG_IGN, as a shell gives background jobs) is left alone.
    """
    if (threading.current_thread() is not threading.main_thread()
            or signal.getsignal(signal.SIGINT) is not signal.default_int_handler):
        yield
        return
    previous = signal.signal(signal.SIGINT, _raise_interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def _raise_interrupt(signum, frame) -> None:  # noqa: ARG001
    if _swallows_exceptions(frame):
        threading.Timer(0.05, os.kill, (os.getpid(), signal.SIGINT)).start()
        return
    raise KeyboardInterrupt


def _swallows_exceptions(frame) -> bool:
    """Whether `frame` runs inside a gc callback or a `__del__`, whose exceptions Python
    prints and drops."""
    callbacks = {getattr(cb, "__code__", None) for cb in gc.callbacks} - {None}
    while frame is not None:
        if frame.f_code in callbacks or frame.f_code.co_name == "__del__":
            return True
        frame = frame.f_back
    return False


if __name__ == "__main__":
    run()
