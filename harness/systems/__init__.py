"""Doors to outside systems: git and the Docker engine, each behind one module."""
