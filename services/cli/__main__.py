"""`python -m services.cli ...` is the `pdmesh` command."""
import sys

from services.cli import main

sys.exit(main())
