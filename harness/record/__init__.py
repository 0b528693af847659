"""What a record is: how it is written, read back and checked (seal, attestation, provenance, declared data, checkpoints)."""
