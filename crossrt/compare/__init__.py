"""Stage 4, comparing records: parity verdicts, the explanation of every split (near-ties
re-scored in-process), token-level diffs, tolerances, the split census, and why tau differs."""
