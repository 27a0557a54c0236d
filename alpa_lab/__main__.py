import sys

from alpa_lab.cli import main

sys.exit(main())
