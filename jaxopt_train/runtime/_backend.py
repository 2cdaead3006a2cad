"""Facts about JAX's backend: whether it has started (settings read at start-up must come
before it), why it could not start, and a device's CUDA compute capability."""

from __future__ import annotations

import os
import sys


def backend_started() -> bool:
    """True once any JAX backend (cpu, cuda, tpu) has been created in this process.

    Environment settings such as `XLA_FLAGS` and `XLA_CLIENT_MEM_FRACTION` are read
    exactly once, when the backend starts; changing them later silently does nothing.
    Only looks at JAX's backend cache, so it never starts a backend itself.
    """
    xla_bridge = sys.modules.get("jax._src.xla_bridge")
    if xla_bridge is None:  # jax not imported yet: nothing can have started
        return False
    # `jax.extend.backend.clear_backends()` empties the cache below, but XLA has read
    # its flags by then and does not read them again: the plugin discovery that the first
    # backend start runs is not undone, so it says "started" for good.
    if getattr(xla_bridge, "_plugins_registered", False):
        return True
    checker = getattr(xla_bridge, "backends_are_initialized", None)
    if checker is not None:
        return bool(checker())
    # Older/newer jax without the helper: fall back to the cache it reads.
    return bool(getattr(xla_bridge, "_backends", {}))


def require_backend_not_started(what: str) -> None:
    """Raises RuntimeError naming `what` if the JAX backend is already running."""
    if backend_started():
        raise RuntimeError(
            f"{what} must run before the JAX backend starts (the first jax.devices(), "
            "jax.jit call or array creation); it has already started in this process, so "
            "the setting would be silently ignored. Call it at the top of your script, "
            "before any JAX computation, or set the environment variable in the shell."
        )


def backend_start_failure() -> str | None:
    """Why JAX cannot start a backend in this process, or None when it can (or when jax
    was never imported: then nothing tried to start one).

    Starts the backend if it has not started. JAX_PLATFORMS naming a platform whose
    plugin is missing (`cuda` without jax[cuda]) ends in a bare AssertionError inside
    jax's xla_bridge, with no text: the reason given then names JAX_PLATFORMS.
    """
    if "jax" not in sys.modules:
        return None
    import jax

    try:
        jax.devices()
    except Exception as err:  # noqa: BLE001 - any start-up failure is the answer
        platforms = os.environ.get("JAX_PLATFORMS")
        return str(err) or f"{type(err).__name__} with JAX_PLATFORMS={platforms!r}"
    return None


def compute_capability(device) -> tuple[int, int]:
    """(major, minor) of a device's `compute_capability` such as "9.0"; (0, 0) if it has
    none or it cannot be read (CPU, TPU), so a check for a minimum refuses it."""
    try:
        major, minor = str(getattr(device, "compute_capability", "")).split(".")[:2]
        return int(major), int(minor)
    except ValueError:
        return 0, 0
