"""Facts about JAX's backend: whether it has started (settings read at start-up must come
before it), and a device's CUDA compute capability."""

from __future__ import annotations


def backend_started() -> bool:
    """True once any JAX backend (cpu, cuda, tpu) has been created in this process.

    Environment settings such as `XLA_FLAGS` and `XLA_CLIENT_MEM_FRACTION` are read
    exactly once, when the backend starts; changing them later silently does nothing.
    Only looks at JAX's backend cache, so it never starts a backend itself.
    """
    import sys

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


def compute_capability(device) -> tuple[int, int]:
    """(major, minor) of a device's `compute_capability` such as "9.0"; (0, 0) if it has
    none or it cannot be read (CPU, TPU), so a check for a minimum refuses it."""
    try:
        major, minor = str(getattr(device, "compute_capability", "")).split(".")[:2]
        return int(major), int(minor)
    except ValueError:
        return 0, 0
