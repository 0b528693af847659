"""`python -m harness` is the `harness` command."""

from harness.cli import entry

# Guarded: spawned ranks re-import the main module and must not start another CLI.
if __name__ == "__main__":
    entry()
