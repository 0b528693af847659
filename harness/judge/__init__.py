"""Pure judgement: records in, verdicts and reports out. Nothing here reads a store, a repository or a process."""
