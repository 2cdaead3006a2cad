"""jaxopt_train.train."""
