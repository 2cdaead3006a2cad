"""jaxopt_train.bench."""
