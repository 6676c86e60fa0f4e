"""The loop run on an oracle: the chain oracle (the target's greedy output with the drafter's
drafts at every position, built by running both models once) as the one loop's target and
drafter, so a simulation is a real run step for step under any k, confidence cut-off, k policy,
schedule or lookup; static trees and exllamav3's schedules simulated beside it."""
