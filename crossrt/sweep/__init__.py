"""`crossrt sweep`: sweep files, executors (here and on Ray) and the sweep directory (docs/scale.md)."""
