"""jaxopt_train.runtime."""
