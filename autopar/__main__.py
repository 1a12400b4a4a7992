"""`python -m autopar ...` (and `torchrun -m autopar calibrate ...`): the command line."""
import sys

from autopar.cli import main

sys.exit(main())
