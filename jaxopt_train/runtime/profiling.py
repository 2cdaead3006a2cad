"""Profile a chosen range of training steps with jax.profiler.

`--profile-steps 10:12` traces steps 10 and 11 (a Python slice: start included, stop
excluded), after compilation and warm-up, so the trace shows steady state. The
trace lands in `LOGDIR/plugins/profile/<run>/` and opens in TensorBoard's profile
plugin (`tensorboard --logdir LOGDIR`) or in Perfetto (ui.perfetto.dev, the
`*.trace.json.gz` file).
"""

from __future__ import annotations

import operator
import os
import re
from typing import Any


def parse_step_range(text: str | int) -> tuple[int, int]:
    """`"10:12"` -> `(10, 12)` (steps 10 and 11); `"10"` or `10` -> `(10, 11)`.

    Raises:
      ValueError: unless `START:STOP` with 0 <= START < STOP, or a single step.
    """
    match = re.fullmatch(r"\s*(\d+)\s*(?::\s*(\d+)\s*)?", str(text))
    if match is None:
        raise ValueError(f"a step range is START:STOP (Python slice, e.g. '10:12' for steps 10 and 11) "
                         f"or a single step '10'; got {text=}")
    start = int(match.group(1))
    stop = int(match.group(2)) if match.group(2) is not None else start + 1
    if stop <= start:
        raise ValueError(f"step range {text!r} is empty: STOP must be greater than START "
                         f"(got {start=}, {stop=})")
    return start, stop


class StepProfiler:
    """Starts a jax.profiler trace at step START and stops it at step STOP.

    Call `.step(i)` at the top of every step (before dispatching step i). With several
    steps per dispatch, `i` may jump: tracing starts at the first `i` in
    [START, STOP) and stops at the first `i >= STOP`. Work is asynchronous, so pass
    the previous step's outputs as `outputs` to wait for them before the trace stops
    (otherwise the trace may miss the traced steps' device work). `close()` stops a
    trace still running at the end of training.

    Args:
      steps: what `parse_step_range` reads ("START:STOP", "10" or 10), or a
        (start, stop) pair of ints.
      logdir: directory for the trace.
      perfetto: also write a Perfetto trace file.

    Raises:
      TypeError: for a pair whose entries are not ints, or a non-bool `perfetto`.
      ValueError: for an empty or malformed range.
    """

    def __init__(self, steps: str | int | tuple[int, int], logdir: str | os.PathLike, *,
                 perfetto: bool = False):
        if isinstance(steps, (tuple, list)):
            if len(steps) != 2:
                raise ValueError(f"a step range pair is (start, stop), got {steps=}")
            try:  # int() would silently truncate a float step
                start, stop = (operator.index(s) for s in steps)
            except TypeError:
                raise TypeError(f"a step range pair holds two ints, got {steps=}") from None
            steps = f"{start}:{stop}"
        self.start_step, self.stop_step = parse_step_range(steps)
        if not isinstance(perfetto, bool):
            raise TypeError(f"perfetto must be True or False, got {perfetto=}")
        self.logdir = os.fspath(logdir)
        self._perfetto = perfetto
        self.active = False
        self.done = False

    def step(self, step: int, outputs: Any = None) -> None:
        """Starts or stops the trace as `step` enters or leaves the range."""
        import jax

        if self.done:
            return
        if not self.active and self.start_step <= step < self.stop_step:
            os.makedirs(self.logdir, exist_ok=True)
            jax.profiler.start_trace(self.logdir, create_perfetto_trace=self._perfetto)
            self.active = True
        elif self.active and step >= self.stop_step:
            self._stop(outputs)
        elif step >= self.stop_step:
            self.done = True  # the range was skipped over entirely

    def _stop(self, outputs: Any) -> None:
        import jax

        if outputs is not None:
            jax.block_until_ready(outputs)
        jax.profiler.stop_trace()
        self.active = False
        self.done = True

    def close(self, outputs: Any = None) -> None:
        """Stops a trace that is still running."""
        if self.active:
            self._stop(outputs)
