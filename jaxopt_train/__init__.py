"""jaxopt_train: fast, measured large-model training on JAX/XLA."""

__version__ = "0.1.0"
