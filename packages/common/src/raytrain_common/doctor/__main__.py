"""`python -m raytrain_common.doctor`: the same as `raytrain-doctor`."""

import sys

from raytrain_common.doctor.cli import main

sys.exit(main())
