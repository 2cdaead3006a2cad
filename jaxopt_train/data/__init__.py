"""jaxopt_train.data."""
