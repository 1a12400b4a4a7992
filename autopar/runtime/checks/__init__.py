"""What goes wrong at run time, caught and named: stalled collectives and non-finite steps
(faults.py), bad inputs (inputs.py), ranks running out of data unevenly (join.py)."""
