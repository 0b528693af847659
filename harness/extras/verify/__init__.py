"""`harness verify`: a paper's claims (a claims file) checked against the recorded studies and runs, optionally
replaying them; the claims, their verdicts and the report."""

from harness.extensions import Extra

EXTRA = Extra("verify", cli="harness.extras.verify.cli", api="harness.extras.verify.api",
              names=("VerifyOptions", "verify"))
