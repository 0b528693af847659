"""The extras: optional verbs and modes beside the core, one folder each, registered through harness.extensions
as an outside package's would be (its commands, its API names, the core's extension points it fills).

trace (op-level traces and localisation), bisect, verify (paper claims), attest (signed attestations) and invariant
(world-size-invariant mode, inside the ranks). The core imports none of them (pyproject.toml's contract); each may
import the core.
"""
