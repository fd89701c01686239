import sys

from fedhpro.cli import main

sys.exit(main())
