"""MLflow: a view of the app database (one experiment per sweep, a nested run per trial)."""
