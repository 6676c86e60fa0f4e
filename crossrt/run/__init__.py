"""Stage 2b, running a pair: the runtime contract and registry, the driver that runs crossrt's
speculative loop (crossrt/speculative/) and writes records, the baseline store, and where a runtime
runs (isolated children, their zygotes, crashes, memory)."""
