"""harness's version: a leaf, so that reading it (every record carries it; a rank's code reads it) imports nothing
else of harness - not the package's lazy API loader, which would put the API in its import graph."""

__version__ = "0.1.0"
