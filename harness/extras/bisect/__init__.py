"""`harness bisect`: which difference between a good and a bad run (a commit between theirs, a config key) flips
the result, found by replays of the good run with part of the bad one's changes."""

from harness.extensions import Extra

EXTRA = Extra("bisect", cli="harness.extras.bisect.cli", api="harness.extras.bisect.api",
              names=("BisectOptions", "bisect"))
