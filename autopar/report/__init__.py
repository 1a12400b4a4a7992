"""Stage 4, the plan's records: what autopar chose and predicts, and how a person reads it.

records.py (per-node choices, collectives, placements, pipeline layout), plan.py (the Plan:
save, load, compare), text.py (terminal text), html.py (one HTML page), gantt.py (timeline SVG).
The solve stage fills these records; passes and runtime read only them."""
