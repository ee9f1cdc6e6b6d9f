import sys

from threefold.cli import main

sys.exit(main())
