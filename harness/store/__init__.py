"""The tracking store: the only package that imports MLflow or knows its schema."""
