"""jaxopt_train.kernels."""
