import sys

from gradsync.cli import main

sys.exit(main())
