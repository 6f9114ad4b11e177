import sys

from llm_fsdp.cli import main

sys.exit(main())
