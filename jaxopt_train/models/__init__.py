"""jaxopt_train.models."""
