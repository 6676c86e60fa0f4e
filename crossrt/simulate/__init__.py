"""The loop replayed on an oracle: the chain oracle (the target's greedy output with the drafter's
drafts at every position, built by running both models once), and simulators that reproduce a
real run of the one loop step for step under any k, confidence cut-off, k policy, static tree or
schedule, with the run stage's own policy and acceptance objects."""
