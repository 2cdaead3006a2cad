import sys

from jaxopt_train.cli import main

sys.exit(main())
