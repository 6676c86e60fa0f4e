"""Stage 2, running a pair: the runtime contract and registry, crossrt's speculative loop with
its strategies (drafters, schedules, k policies, acceptance rules), the driver that writes
records, the baseline store, and the chain oracle with the simulators that replay the loop on
it."""
