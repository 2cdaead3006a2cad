"""Stopping a run on SIGTERM / SIGINT at a step boundary, every process at the same step.

A preempted job gets SIGTERM (Ctrl-C gives SIGINT); the loop finishes the step in
flight, saves a checkpoint and returns. With several processes the signals do not
land at the same step, and a process that stops alone leaves the others waiting in
the next step's collectives, then everything aborts with no checkpoint. So on
several processes the stop is agreed through the devices themselves: after each
dispatch every process contributes its "signal received" flag to a tiny max over
all devices, and reads the result one dispatch later, while the next step is
already queued (no pipeline bubble). Every process reads the same value after the
same dispatch, so all stop, and save, at the same step.
"""

from __future__ import annotations

import signal
import threading
from typing import Any

import jax
import numpy as np


class StopSignal:
    """Records SIGTERM/SIGINT instead of dying mid-step; restores the old handlers on exit."""

    def __init__(self):
        self.received: int | None = None
        self._old: dict[int, Any] = {}

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._old[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame):  # noqa: ARG002
        if self.received is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt  # a second Ctrl-C means "now"
        self.received = signum

    def __exit__(self, *exc):
        for sig, handler in self._old.items():
            signal.signal(sig, handler)
        return False


class StopAgreement:
    """Whether to stop after the dispatch just made, the same answer on every process.

    One process: the local signal, at once. Several: the max of every process's flag
    from the previous dispatch (`update` after each dispatch), so a signal is acted
    on one dispatch after it arrives, and the signal's number is agreed too
    (SIGTERM, 15, outranks SIGINT, 2).
    """

    def __init__(self, devices=None):
        self.local_only = jax.process_count() == 1  # its own signal decides, at any time
        self._pending = None  # the max over devices of the previous dispatch's flags
        self.signal: int | None = None
        if self.local_only:
            return
        from jax.sharding import Mesh, NamedSharding, PartitionSpec  # noqa: PLC0415

        devices = sorted(devices or jax.devices(), key=lambda d: (d.process_index, d.id))
        mesh = Mesh(np.asarray(devices), ("processes",))
        self._local = [d for d in devices if d.process_index == jax.process_index()]
        self._sharding = NamedSharding(mesh, PartitionSpec("processes"))
        self._shape = (len(devices),)
        self._max = jax.jit(lambda flags: flags.max(),
                            out_shardings=NamedSharding(mesh, PartitionSpec()))

    def update(self, received: int | None) -> bool:
        """Call once after each dispatch with the local signal (None: none): True to stop now."""
        if self.local_only:
            self.signal = received
            return received is not None
        flag = np.int32(received or 0)
        shards = [jax.device_put(np.full((1,), flag, np.int32), d) for d in self._local]
        current = self._max(jax.make_array_from_single_device_arrays(
            self._shape, self._sharding, shards))
        previous, self._pending = self._pending, current
        if previous is None:
            return False
        # Waits for the previous dispatch's max only: the step just dispatched stays queued.
        agreed = int(np.asarray(previous.addressable_data(0)))
        if agreed:
            self.signal = agreed
        return bool(agreed)
