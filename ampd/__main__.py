import sys

from ampd.cli import main

sys.exit(main())
