import sys

from mm3_compile.cli import main

sys.exit(main())
