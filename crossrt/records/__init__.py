"""Stage 3 of the data path, the record: the versioned run-record schema and its JSON form,
the journals that keep finished work on disk, per-token traces, and the metric list with its
formulas and the tables that print it. Imports nothing of crossrt but errors."""
