"""What a record is: how it is written, read back and checked.

The seal and its attestation, provenance, declared data, redaction, a recorded run checked out, checkpoints.
"""
