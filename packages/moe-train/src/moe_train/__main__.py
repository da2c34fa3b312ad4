import sys

from moe_train.cli import main

sys.exit(main())
