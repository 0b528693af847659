"""One module per verb (run, replay, resume, audit, trace, verify, study, bundle, runs, mark, ui).

Together they are the Python API; the CLI only parses, calls one of them and prints.
"""
