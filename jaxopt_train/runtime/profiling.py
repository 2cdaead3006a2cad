"""Profile a chosen range of training steps with jax.profiler.

`--profile-steps 10:12` traces steps 10 and 11 (a Python slice: start included, stop
excluded), after compilation and warm-up, so the trace shows steady state. With
several steps per dispatch it traces every dispatch group that runs a step of the
range (a group cannot be split). The trace lands in `LOGDIR/plugins/profile/<run>/`
and opens in TensorBoard's profile plugin (`tensorboard --logdir LOGDIR`) or in
Perfetto (ui.perfetto.dev, the `*.trace.json.gz` file).
"""

from __future__ import annotations

import logging
import operator
import os
import re
from typing import Any

_log = logging.getLogger(__name__)


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


def _check_step(name: str, value: Any, *, minimum: int) -> int:
    if isinstance(value, bool):
        raise TypeError(f"{name} must be an int >= {minimum}, got {name}={value!r}")
    try:  # int() would accept "10" and silently truncate 10.5
        value = operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an int >= {minimum}, got {name}={value!r}") from None
    if value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {name}={value}")
    return value


def _check_logdir(logdir: str | bytes) -> None:
    """Refuses a logdir os.makedirs would fail on at step START, possibly hours into the run.

    Nothing is created: the profiler writes nothing before START.
    """
    if not logdir:  # os.makedirs("") raises FileNotFoundError
        raise ValueError(f"StepProfiler needs a logdir for the trace, got {logdir=}")
    if os.path.lexists(logdir) and not os.path.isdir(logdir):
        what = "a broken symlink" if os.path.islink(logdir) else "a file"
        raise NotADirectoryError(f"StepProfiler logdir={logdir!r} is {what}, not a directory; "
                                 "pass a directory for the trace (it is created if missing)")
    # A missing logdir is made at START: a file on its way (run.log/trace) would fail it then.
    parent = os.path.dirname(os.path.abspath(logdir))
    while not os.path.lexists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        raise NotADirectoryError(f"StepProfiler logdir={logdir!r} cannot be created: {parent!r} "
                                 "is not a directory; pass a directory for the trace")


class StepProfiler:
    """Starts a jax.profiler trace at step START and stops it after step STOP - 1.

    Call `.step(i)` at the top of every dispatch (before dispatching step i). With
    several steps per dispatch, one call covers steps `i .. i + steps_per_dispatch - 1`:
    tracing starts at the first dispatch that covers any step of [START, STOP) and
    stops at the first call with `i >= STOP` (after the dispatch that ran step
    STOP - 1), so a range inside one dispatch group traces that whole group. Work is
    asynchronous, so pass the previous step's outputs as `outputs` to wait for them
    before the trace stops (otherwise the trace may miss the traced steps' device
    work). `close()` stops a trace still running at the end of training. A range the
    calls skip over, or that training never reaches, is logged as a warning.

    Args:
      steps: what `parse_step_range` reads ("START:STOP", "10" or 10), or a
        (start, stop) pair of ints.
      logdir: directory for the trace.
      perfetto: also write a Perfetto trace file.
      steps_per_dispatch: steps each `.step(i)` call stands for; None (the default)
        infers it from the gap between consecutive calls (1 at the first call).

    Raises:
      TypeError: for a pair whose entries are not ints (bools included), a non-bool
        `perfetto`, a non-int `steps_per_dispatch` or a `logdir` that is not a path.
      ValueError: for an empty or malformed range, `steps_per_dispatch < 1` or an empty
        `logdir`.
      NotADirectoryError: if `logdir` is an existing file (or broken symlink), or a file
        stands where one of its missing parent folders would be made.
    """

    def __init__(self, steps: str | int | tuple[int, int], logdir: str | os.PathLike, *,
                 perfetto: bool = False, steps_per_dispatch: int | None = None):
        if isinstance(steps, (tuple, list)):
            if len(steps) != 2:
                raise ValueError(f"a step range pair is (start, stop), got {steps=}")
            # operator.index alone took (True, 3) as steps 1:3; int() would truncate a float.
            if any(isinstance(s, bool) for s in steps):
                raise TypeError(f"a step range pair holds two ints, got {steps=}")
            try:
                start, stop = (operator.index(s) for s in steps)
            except TypeError:
                raise TypeError(f"a step range pair holds two ints, got {steps=}") from None
            if start < 0:  # the text made of it was refused as malformed, naming '-1:3'
                raise ValueError(f"a step range pair (start, stop) needs start >= 0, got {steps=}")
            steps = f"{start}:{stop}"
        self.start_step, self.stop_step = parse_step_range(steps)
        if not isinstance(perfetto, bool):
            raise TypeError(f"perfetto must be True or False, got {perfetto=}")
        if steps_per_dispatch is not None:
            steps_per_dispatch = _check_step("steps_per_dispatch", steps_per_dispatch, minimum=1)
        try:  # os.fspath's own error does not name the argument
            self.logdir = os.fspath(logdir)
        except TypeError:
            raise TypeError(f"StepProfiler logdir must be a path (str or os.PathLike), "
                            f"got {type(logdir).__name__}: {logdir!r}") from None
        _check_logdir(self.logdir)
        self._perfetto = perfetto
        self._steps_per_dispatch = steps_per_dispatch
        self._last_step: int | None = None
        self.active = False
        self.done = False

    def step(self, step: int, outputs: Any = None) -> None:
        """Starts or stops the trace as the dispatch starting at `step` enters or leaves the range.

        Raises:
          TypeError: unless `step` is an int.
          ValueError: for a negative `step`.
        """
        step = _check_step("step", step, minimum=0)
        size = self._dispatch_size(step)
        previous, self._last_step = self._last_step, step
        if self.done:
            return
        if self.active:
            if step >= self.stop_step:
                self._stop(outputs)
        elif step >= self.stop_step:
            self.done = True
            before = ("training started" if previous is None
                      else f"the dispatches jumped from step {previous}")
            _log.warning("profile steps %d:%d were never traced: %s to step %d, past them",
                         self.start_step, self.stop_step, before, step)
        elif step + size > self.start_step:  # this dispatch runs a step of the range
            import jax

            os.makedirs(self.logdir, exist_ok=True)
            jax.profiler.start_trace(self.logdir, create_perfetto_trace=self._perfetto)
            self.active = True

    def _dispatch_size(self, step: int) -> int:
        if self._steps_per_dispatch is not None:
            return self._steps_per_dispatch
        if self._last_step is not None and step > self._last_step:
            return step - self._last_step  # loops dispatch groups of one fixed size
        return 1

    def _stop(self, outputs: Any) -> None:
        import jax

        # Waiting only makes the trace complete; a failed wait (a donated or deleted
        # buffer, a step that failed on the device) must not leave the trace running,
        # where it would make every later start_trace in this process fail. The step's
        # own failure surfaces where its results are used; here it is only logged.
        try:
            if outputs is not None:
                jax.block_until_ready(outputs)
        except Exception as err:
            _log.warning("profile steps %d:%d: could not wait for the traced steps' outputs "
                         "(%s: %s); the trace may miss their last device work",
                         self.start_step, self.stop_step, type(err).__name__, err)
        finally:
            self.active = False
            self.done = True
            jax.profiler.stop_trace()

    def close(self, outputs: Any = None) -> None:
        """Stops a trace that is still running; warns if the range was never reached.

        The trace is stopped even if waiting for `outputs` fails (that is logged as a
        warning), so `close` is safe in a `finally` block.
        """
        if self.active:
            self._stop(outputs)
        elif not self.done:
            self.done = True
            reached = "no step" if self._last_step is None else f"step {self._last_step}"
            _log.warning("profile steps %d:%d were never traced: training ended at %s",
                         self.start_step, self.stop_step, reached)
