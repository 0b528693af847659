"""`python -m harness` is the `harness` command."""

from harness.cli.main import main

# Guarded: spawned ranks re-import the main module and must not start another CLI.
if __name__ == "__main__":
    main()
