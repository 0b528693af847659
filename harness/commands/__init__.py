"""One module per verb (run, replay, resume, audit, trace, verify, study, bundle, runs, mark): the Python API the CLI calls."""
