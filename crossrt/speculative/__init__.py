"""Stage 2a, the speculative-decoding algorithm apart from the machinery that runs it: the one
loop with its strategies (schedules, drafters and lookups, k policies, acceptance rules, trees),
the drafting rules it is given, the session types it drives and the numerics verdict it chooses
by. It imports no runtime: crossrt/run/ drives it on one, and crossrt/simulate/ on an oracle."""
