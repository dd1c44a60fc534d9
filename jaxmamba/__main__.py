import sys

from jaxmamba.cli import main

sys.exit(main())
