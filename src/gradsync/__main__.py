import sys

from gradsync.apps.commands import main

sys.exit(main())
