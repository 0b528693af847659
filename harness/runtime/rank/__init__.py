"""The body of a rank: what runs inside a rank's process, under the contract that code in a rank never reaches the
store or MLflow (pyproject.toml). The launcher that starts and supervises ranks is harness/executors/launch.py.

- spec.py: what a rank is told (LaunchSpec, its rendezvous variables);
- progress.py: what a rank tells its launcher through the shared progress array;
- process.py: a rank's process, from its start to its spec (log, stacks on demand, preloads, torch facts);
- body.py: the rank itself (process group, seeds, determinism, the experiment's entry, teardown);
- failure.py: what a rank died of, written for the launcher to tell cause from consequence;
- facts.py: what a rank measures of its machine for the record (torch, the device, variables, NCCL's files).
"""
