"""`python -m cli ARGS` runs `legion-nn ARGS`."""

import sys

from cli.main import main

sys.exit(main())
