"""Stage 5, the report: a self-contained HTML page of records, parity splits, step-coloured
outputs, SVG charts, and the ceiling study's page."""
