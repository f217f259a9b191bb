import sys

from dpml.cli import main

sys.exit(main())
