"""Stage 5, reading records for their numbers: acceptance by category, position and entropy,
and claims checked against community figures."""
